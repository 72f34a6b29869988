#pragma once

#include <chrono>
#include <cstdint>

namespace twinkle::core {

// Seconds since 1970 (UTC), as the job history, the node table and the agents record times.
inline std::int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The same with the fraction of a second.
inline double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace twinkle::core
