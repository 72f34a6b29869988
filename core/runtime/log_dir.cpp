#include "core/runtime/log_dir.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core {

LogDir::LogDir(std::filesystem::path dir) : dir_(std::move(dir)) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec || ::access(dir_.c_str(), W_OK) != 0) {
    throw ConfigError(fmt::format("--log-dir {}: cannot write there ({}); choose a writable folder",
                                  dir_.string(), ec ? ec.message() : std::strerror(errno)));
  }
}

std::filesystem::path LogDir::file(const std::string& name) const {
  std::string file = name;
  std::replace(file.begin(), file.end(), ':', '-');
  return dir_ / (file + ".log");
}

Fd LogDir::open(const std::string& name) const {
  const std::filesystem::path path = file(name);
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0666));
  if (!fd) {
    throw ConfigError(fmt::format("--log-dir: cannot write {} ({}); choose a writable folder",
                                  path.string(), std::strerror(errno)));
  }
  return fd;
}

void LogDir::append(const Fd& log, const std::string& name, const std::string& line) {
  const std::string text = line + '\n';
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(log.get(), p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // Nothing written and no error given: no room, the usual reason.
      const int error = n < 0 ? errno : ENOSPC;
      if (!warned_.exchange(true)) {
        std::fprintf(stderr,
                     "twinkle: warning: --log-dir %s: cannot write %s (%s); the run goes on, and "
                     "the lines that cannot be written are lost (this warning is given once)\n",
                     dir_.c_str(), file(name).filename().c_str(), std::strerror(error));
        std::fflush(stderr);
      }
      return;
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

}  // namespace twinkle::core
