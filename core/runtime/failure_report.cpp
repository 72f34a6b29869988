#include "core/runtime/failure_report.hpp"

#include <fmt/format.h>

namespace twinkle::core {

std::string root_cause(const FailureFacts& f) {
  if (f.lost) return f.lost->text;
  return f.error.empty() ? "the driver entry failed without a message" : f.error;
}

std::string failure_summary(const FailureFacts& f) {
  std::string s = fmt::format("twinkle: job \"{}\" failed (run {})\n", f.job, f.run_id);
  const std::string cause = root_cause(f);
  s += "  root cause: " + cause + "\n";
  if (f.lost) {
    for (const auto& c : f.lost->calls) s += "  the driver was waiting on: " + c + "\n";
    // The driver's error usually repeats the loss; show it only when it says something else.
    std::string first_line = cause.substr(0, cause.find('\n'));
    if (!f.error.empty() && f.error.find(first_line) == std::string::npos)
      s += "  then the driver: " + f.error + "\n";
  }
  return s;
}

}  // namespace twinkle::core
