#pragma once

#include <stdexcept>
#include <string>

namespace twinkle {

// Exit codes of `twinkle` (DESIGN.md section 1).
inline constexpr int kExitOk = 0;
inline constexpr int kExitJobFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitPlugin = 3;
inline constexpr int kExitInterrupted = 130;

// Base of every error Twinkle raises on the host side. The message names the file or thing that is
// wrong and the fix; exit_code() is what `twinkle` exits with when the error reaches main.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, int exit_code = kExitJobFailed)
      : std::runtime_error(what), exit_code_(exit_code) {}
  int exit_code() const noexcept { return exit_code_; }

 private:
  int exit_code_;
};

// A job file, a --set override or a command line flag is wrong (exit code 2).
class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& what) : Error(what, kExitUsage) {}
};

// A plugin cannot be loaded or its table is invalid (exit code 3).
class PluginError : public Error {
 public:
  explicit PluginError(const std::string& what) : Error(what, kExitPlugin) {}
};

// A socket, a message or a peer on the control channel failed (exit code 1).
class TransportError : public Error {
 public:
  explicit TransportError(const std::string& what) : Error(what, kExitJobFailed) {}
};

}  // namespace twinkle
