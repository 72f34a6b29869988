// The worker's fork server (docs/ARCHITECTURE.md, Processes): one `twinkle-worker --fork-server`
// per launcher, started at the first worker, that forks every later worker from an image whose
// libraries are already loaded and relocated, so that a worker's start costs a fork instead of an
// exec, a dynamic link and its page faults (most of a run's launch CPU).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::core {

// The argument that makes twinkle-worker a fork server: `twinkle-worker --fork-server PAD`.
inline constexpr const char* kForkServerFlag = "--fork-server";

// What a worker process runs: the worker binary's main, called in each forked child with the
// child's own argv.
using WorkerMain = int (*)(int argc, char** argv);

// Serves forks on descriptors 3 (requests and replies) and 4 (exit reports) until the launcher
// sends `stop` on 3, then kills and reaps what it forked and ends the process (_exit); where 3
// ends without `stop` (the launcher died) it ends at once and kills nothing (each worker, seeing
// its driver dead, cleans up). Returns 1 only when it cannot start serving. In a child it calls
// `main` with the request's argv and exits with what it returns. `argv` is the server's
// own: its strings' memory becomes each child's command line (/proc/PID/cmdline), so that `ps`
// and pgrep show a forked worker like a spawned one.
int serve_forks(int argc, char** argv, WorkerMain main);

// In a process forked by a fork server: the server's pid (its parent, whose death it watches);
// 0 in any other process.
pid_t forked_by();

// Whether local workers are forked by a fork server: yes unless TWINKLE_FORK_SERVER=0 (then every
// one is spawned, as before the server existed).
bool fork_server_enabled();

// The launcher's side: a running fork server, its child.
class ForkServer {
 public:
  // Starts `exe --fork-server` with environment `env`. Returns null (with a reason in `why`) when
  // it cannot be started: the launcher spawns workers itself then.
  static std::unique_ptr<ForkServer> start(const std::filesystem::path& exe,
                                           const std::vector<std::string>& env, std::string& why);
  ForkServer(const ForkServer&) = delete;
  ForkServer& operator=(const ForkServer&) = delete;
  // Tells the server to stop and reaps it (it kills what it forked and still runs first).
  ~ForkServer();

  const std::filesystem::path& exe() const { return exe_; }
  pid_t pid() const { return pid_; }

  // Whether a process with environment `env` may be forked from this server: only when what the
  // dynamic linker and the C library read once at a process's start (LD_*, GLIBC_TUNABLES,
  // MALLOC_*) is as the server had it; otherwise it must be spawned.
  bool suits(const std::vector<std::string>& env) const;
  // How many processes it forked.
  std::size_t forks() const { return forks_; }

  struct Forked {
    pid_t pid = 0;
    pid_t pgid = 0;  // its process group: `pgid`, or its own pid when that group was gone
  };
  // The server is gone and forked nothing: spawn this process and the ones after it.
  struct Gone : Error {
    using Error::Error;
  };
  // Forks a process with this argv (argv[0] the server's executable) and environment, stdout and
  // stderr on `out` and `err`, stdin on /dev/null, descriptors `inherit` (here, number there) and
  // no other, in process group `pgid` (0: a new one). Nullopt when this one is to be spawned
  // instead (argv and environment too large for one message, or the fork failed: spawning says
  // why); Gone; Error when the server did not answer (it may have forked it: the launcher must
  // not spawn it too).
  std::optional<Forked> fork(pid_t pgid, const std::vector<std::string>& argv,
                             const std::vector<std::string>& env, int out, int err,
                             const std::vector<std::pair<int, int>>& inherit);

  // The descriptor that becomes readable when an exit report (or the server's end) is there.
  int reports_fd() const { return reports_.get(); }
  // Reads the reports there are now: `on_exit(pid, wait status)` for each. Returns false once the
  // server is gone (its socket closed): what it forked ends by itself (its parent-death signal).
  bool read_reports(const std::function<void(pid_t, int)>& on_exit);
  // False once read_reports() found the server gone.
  bool reports_open() const { return reports_open_; }

 private:
  ForkServer() = default;
  void stop_serving();  // tells the server to kill what it forked and end; no fork after it
  std::filesystem::path exe_;
  pid_t pid_ = 0;
  Fd requests_;
  Fd reports_;
  std::vector<std::string> startup_env_;  // the LD_*, GLIBC_TUNABLES and MALLOC_* entries, sorted
  std::size_t forks_ = 0;
  std::atomic<bool> reports_open_{true};
};

}  // namespace twinkle::core
