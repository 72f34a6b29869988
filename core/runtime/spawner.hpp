#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/runtime/fork_server.hpp"
#include "core/runtime/log_dir.hpp"
#include "transports/fd.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::core {

using transport::FdPair;

// The running twinkle binary (/proc/self/exe), which workers and node agents run. Throws Error
// when it cannot be found.
std::filesystem::path twinkle_binary();

// The worker binary, `twinkle-worker` beside `twinkle` (docs/ARCHITECTURE.md, Processes): what
// the local launcher and node agents start for each rank. Throws Error naming the path when it is
// not there or cannot be run.
std::filesystem::path worker_binary(const std::filesystem::path& twinkle);

// One process to start.
struct ProcessSpec {
  std::string name;               // "model:3": the prefix of its output lines and its log file
  std::vector<std::string> argv;  // argv[0] is the executable (a path: no PATH search)
  std::vector<std::string> env;   // the whole environment, KEY=VALUE
  // Descriptors the child inherits: (descriptor here, number in the child). The Fd is closed
  // here once the child has it.
  std::vector<std::pair<Fd, int>> inherit;
};

// How a process ended.
struct ProcessExit {
  std::string name;
  pid_t pid = 0;
  int exit_code = -1;  // when it exited
  int signal = 0;      // when a signal killed it
  std::vector<std::string> last_stderr;

  // "exited with code 3" / "was killed by signal 11 (Segmentation fault)"
  std::string describe() const;
};

struct SpawnerOptions {
  std::optional<std::filesystem::path> log_dir;  // one <name>.log per process (LogDir)
  bool quiet = false;                            // keep process output off the terminal
  std::size_t stderr_tail = 20;                  // lines of stderr kept for ProcessExit
  // Where output lines go instead of the terminal (a node agent relays them to the driver).
  std::function<void(const std::string& name, bool is_stderr, const std::string& line)> on_line;
  // The worker binary, when its processes are to be forked by its fork server (ForkServer,
  // started at the first of them) instead of spawned; the rest are spawned all the same.
  std::optional<std::filesystem::path> fork_server;
  // That binary's fork server when it was started before the spawner (the driver starts it
  // beside its own start-up); the spawner starts one itself otherwise.
  std::shared_ptr<ForkServer> started_server;
};

// Starts processes and watches them, for the local launcher and the node agent:
// - every process is started with posix_spawn (vfork semantics: no copy of a large parent), or
//   forked by the fork server of `fork_server` when it runs that binary, in one process group of
//   its own, with stdin on /dev/null, the signal mask cleared and only the descriptors of its spec
//   inherited;
// - one monitor thread relays each process's stdout/stderr line by line with a "[name] " prefix
//   (and into --log-dir), and reaps exits as they happen (pidfds: no polling interval), calling
//   the exit handler once per process, from the monitor thread, after its last output lines;
// - the destructor kills and reaps whatever still runs.
// spawn() and stop() are called from one thread; the rest from any.
class Spawner {
 public:
  using ExitHandler = std::function<void(const ProcessExit&)>;

  // Throws ConfigError when the log directory cannot be created or written. A log write that
  // fails later is a warning, once (LogDir).
  Spawner(SpawnerOptions options, ExitHandler on_exit);
  Spawner(const Spawner&) = delete;
  Spawner& operator=(const Spawner&) = delete;
  ~Spawner();

  // Starts one process; throws twinkle::Error naming it when a pipe or the spawn fails (nothing
  // is leaked: the spec's descriptors and the pipes are closed).
  pid_t spawn(ProcessSpec spec);

  // Waits up to `grace` for every process to exit by itself, then SIGTERM, then SIGKILL after
  // `term_grace`; reaps all and relays their last output. Returns the names of the processes
  // that had to be signalled. Idempotent.
  std::vector<std::string> stop(
      std::chrono::milliseconds grace,
      std::chrono::milliseconds term_grace = std::chrono::milliseconds(500));

  // Async-signal-safe: `sig` to the whole process group (and what the processes started).
  void signal_all(int sig) const noexcept;
  // SIGKILL to the group, then reaps every process (for a caller that is about to exit at once).
  void kill_and_reap() noexcept;
  // `sig` to the running processes named `name` (not to what they started). Returns how many.
  int signal(const std::string& name, int sig) const;
  // `sig` to process `pid` if it is one of these and still running (through its pidfd: a pid the
  // fork server reaped may already be another process's). Returns whether it was sent.
  bool signal_pid(pid_t pid, int sig) const;

  std::size_t running() const;
  std::vector<pid_t> pids() const;
  // How many of the processes started were forked by the fork server.
  std::size_t forked() const;

 private:
  struct Proc;
  void monitor();
  void wake() const noexcept;
  bool relay(Proc& p, int stream);
  void finish(Proc& p, int status);
  void write_line(Proc& p, bool is_stderr, const std::string& line);
  void close_all_pipes();
  bool fork_from_server(Proc& proc, ProcessSpec& spec, int out, int err);
  void spawn_process(Proc& proc, const ProcessSpec& spec, int out, int err);
  void server_reports(ForkServer& server);

  SpawnerOptions options_;
  ExitHandler on_exit_;
  std::optional<LogDir> logs_;
  std::vector<std::unique_ptr<Proc>> procs_;
  std::atomic<pid_t> pgid_{0};
  Fd wake_;  // eventfd: a new process or stop() wakes the monitor
  std::thread monitor_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;            // guards procs_ (the vector and each Proc's exit state)
  std::condition_variable exit_cv_;  // notified on every exit
  // The fork server: started, used, replaced and given up by spawn() (replaced under mu_); its
  // reports read by the monitor, which holds a copy while it does. Exits it reported before
  // spawn() knew the process: pid -> wait status.
  std::shared_ptr<ForkServer> server_;
  bool server_failed_ = false;
  std::vector<std::pair<pid_t, int>> early_exits_;  // guarded by mu_
  std::mutex out_mu_;                               // one line at a time on the terminal
};

}  // namespace twinkle::core
