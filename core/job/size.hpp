#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

// Sizes in bytes as people write and read them (job files' memory limits, messages).
namespace twinkle::core {

// "4GiB", "512MiB", "100M", "2g", "4096" (bytes): K, M, G and T are powers of 1024, with or
// without "iB"/"B". nullopt when it is not a size, or below one byte.
std::optional<std::uint64_t> parse_size(std::string_view text);

// "4 GiB", "256 MiB": a size in its largest whole unit, else in bytes ("1536 B").
std::string format_size(std::uint64_t bytes);

}  // namespace twinkle::core
