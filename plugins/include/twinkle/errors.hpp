// The error vocabulary every part of Twinkle shares (host side: the loader, transports, the job
// model, the runtime). Header-only and free of any Twinkle library, like the rest of the SDK.
// Each message names the file or thing that is wrong and the fix. Which exit code an error means
// is decided in one place only, the command line (cli/), by its type.
#pragma once

#include <stdexcept>
#include <string>

namespace twinkle {

// Base of every error Twinkle raises on the host side.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A job file, a --set override or a command line flag is wrong.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A plugin cannot be loaded or its table is invalid.
class PluginError : public Error {
 public:
  using Error::Error;
};

// A socket, a message or a peer of a channel failed.
class TransportError : public Error {
 public:
  using Error::Error;
};

}  // namespace twinkle
