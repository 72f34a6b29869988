#include "core/job/size.hpp"

#include <cctype>
#include <exception>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace twinkle::core {

std::optional<std::uint64_t> parse_size(std::string_view text) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(std::string(text), &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  std::string unit(text.substr(used));
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  for (auto& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  static const std::pair<const char*, double> units[] = {
      {"", 1},         {"b", 1},       {"k", 0x1p10},   {"kb", 0x1p10}, {"kib", 0x1p10},
      {"m", 0x1p20},   {"mb", 0x1p20}, {"mib", 0x1p20}, {"g", 0x1p30},  {"gb", 0x1p30},
      {"gib", 0x1p30}, {"t", 0x1p40},  {"tb", 0x1p40},  {"tib", 0x1p40}};
  for (const auto& [name, scale] : units) {
    if (unit != name) continue;
    const double bytes = v * scale;
    if (!(bytes >= 1) || bytes > 0x1p62) return std::nullopt;
    return static_cast<std::uint64_t>(bytes);
  }
  return std::nullopt;
}

std::string format_size(std::uint64_t bytes) {
  const char* units[] = {"TiB", "GiB", "MiB", "KiB"};
  for (int i = 0; i < 4; ++i) {
    const std::uint64_t unit = 1ull << (10 * (4 - i));
    if (bytes >= unit && bytes % unit == 0) return fmt::format("{} {}", bytes / unit, units[i]);
  }
  return fmt::format("{} B", bytes);
}

}  // namespace twinkle::core
