#pragma once

#include <atomic>
#include <filesystem>
#include <string>

#include "twinkle/fd.hpp"

namespace twinkle::core {

// The folder of `twinkle run --log-dir DIR`: one file per worker, DIR/GROUP-RANK.log (worker
// "model:3" writes model-3.log), both of its streams, appended line by line; local workers' lines
// come from the Spawner, remote ones' from their node agents.
//
// A write that fails once the run is going (the file system filled up, a quota, an I/O error)
// costs lines, never the run: the first failure prints one warning on stderr naming the file and
// the error, and later writes are still tried (space may come back) but fail silently.
// append() may be called from any thread.
class LogDir {
 public:
  // Creates the folder and its parents where missing. Throws ConfigError naming it when it cannot
  // be created or written.
  explicit LogDir(std::filesystem::path dir);
  LogDir(const LogDir&) = delete;
  LogDir& operator=(const LogDir&) = delete;

  const std::filesystem::path& path() const { return dir_; }
  // Worker `name`'s file, opened for appending (created if missing, close-on-exec: the processes
  // spawned later must not inherit it). Throws ConfigError naming the file when it cannot be
  // opened.
  Fd open(const std::string& name) const;
  // Appends `line` and a newline to `log`, worker `name`'s file from open().
  void append(const Fd& log, const std::string& name, const std::string& line);

 private:
  std::filesystem::path file(const std::string& name) const;

  std::filesystem::path dir_;
  std::atomic<bool> warned_{false};
};

}  // namespace twinkle::core
