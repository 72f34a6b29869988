#pragma once

#include <exception>

#include "twinkle/errors.hpp"
#include "twinkle/value.hpp"

// The exit codes of `twinkle` (docs/ARCHITECTURE.md, Exit codes), chosen here and nowhere else.
namespace twinkle::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitJobFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitPlugin = 3;
// Stopped on request (SIGTERM, SIGUSR1) after the driver entry returned: `twinkle run --resume`
// continues. EX_TEMPFAIL, which batch systems read as "try again".
inline constexpr int kExitStopped = 75;
inline constexpr int kExitInterrupted = 130;  // Ctrl-C; other signals 128 + the signal

// What `twinkle` exits with when `e` reaches main: a bad job file or flag is a usage error, a
// plugin that cannot be loaded a plugin error, anything else a failed job.
inline int exit_code_for(const std::exception& e) {
  if (dynamic_cast<const ConfigError*>(&e)) return kExitUsage;
  if (dynamic_cast<const PluginError*>(&e)) return kExitPlugin;
  return kExitJobFailed;
}

}  // namespace twinkle::cli
