#pragma once

#include <filesystem>
#include <string>

namespace twinkle::core {

// A run's private folder (mode 0700) for its sockets: $TMPDIR/twinkle-run.ID.PID.START.XXXXXX, or
// /tmp when TMPDIR is so long that a socket path inside would not fit a Unix socket address. Its
// name says which driver made it (pid and start time), from the moment it exists, so that a later
// run can tell a folder whose driver is gone (killed before it could clean up, however early) and
// remove it. Removed by the destructor.
class RunDir {
 public:
  // Throws twinkle::Error naming the folder when it cannot be created.
  explicit RunDir(const std::string& run_id);
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;
  ~RunDir();

  const std::filesystem::path& path() const { return path_; }
  // A socket path inside the folder.
  std::filesystem::path socket(const std::string& name) const { return path_ / name; }

  // Removes the run folders in `parent` whose driver is no longer running; returns how many.
  // Folders whose name names no driver are not a run's and stay.
  static int remove_stale(const std::filesystem::path& parent);

 private:
  std::filesystem::path path_;
};

}  // namespace twinkle::core
