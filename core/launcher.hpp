#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace twinkle::core {

// One worker process to start.
struct WorkerSpec {
  std::string name;               // "model:3": the prefix of its output lines
  std::vector<std::string> argv;  // argv[0] is the executable
  std::vector<std::string> env;   // the whole environment, KEY=VALUE
};

// How a worker ended.
struct WorkerExit {
  std::string name;
  pid_t pid = 0;
  int exit_code = -1;  // when it exited
  int signal = 0;      // when a signal killed it
  std::vector<std::string> last_stderr;

  // "exited with code 3" / "was killed by signal 11 (Segmentation fault)"
  std::string describe() const;
  int status_code() const { return signal ? 128 + signal : exit_code; }
};

struct LaunchOptions {
  std::optional<std::filesystem::path> log_dir;  // one <name>.log per worker, both streams
  bool quiet = false;                            // keep worker output off the terminal
  std::size_t stderr_tail = 20;                  // lines of stderr kept for failure reports
};

// Starts local worker processes and watches them, like torchrun's agent:
// - every worker gets PR_SET_PDEATHSIG(SIGHUP), so it dies with the driver, and all workers share
//   one process group, so one kill reaches them and their children;
// - a monitor thread relays each worker's stdout/stderr line by line with a "[name] " prefix (and
//   into --log-dir), reaps exits, and when a worker ends unexpectedly records it, reports it on
//   stderr at once and stops every other worker;
// - the destructor stops and reaps whatever is still running.
// start() and stop() are called from one thread; failure() from any.
class LocalLauncher {
 public:
  explicit LocalLauncher(LaunchOptions options);
  LocalLauncher(const LocalLauncher&) = delete;
  LocalLauncher& operator=(const LocalLauncher&) = delete;
  ~LocalLauncher();

  // Forks and execs every worker. Throws Error if a fork or pipe fails (already started workers
  // are stopped by the destructor).
  void start(const std::vector<WorkerSpec>& workers);

  // The first worker that ended while the run still needed it.
  std::optional<WorkerExit> failure() const;
  bool failed() const { return failed_.load(); }

  // Exits are expected from now on (orderly shutdown): they are not failures.
  void expect_exits() { expecting_exit_ = true; }

  // Waits up to `grace` for every worker to exit by itself, then SIGTERM, then SIGKILL after
  // another short grace; reaps all and relays their last output. Idempotent.
  void stop(std::chrono::milliseconds grace);

  // Async-signal-safe: SIGKILL to the whole worker process group.
  void kill_all_now() const noexcept;
  // SIGKILL to the group, then reaps every worker (for a driver that is about to exit at once,
  // so that no worker outlives it even as a zombie).
  void kill_and_reap() noexcept;

  // The driver's end of worker `index`'s shared-memory channel (the worker has the other end as
  // fd 3, named by TWINKLE_SHM_FD). Ownership passes to the caller; -1 once taken.
  int take_channel(std::size_t index);

  std::vector<pid_t> pids() const;
  std::size_t running() const;

 private:
  struct Proc;
  void monitor();
  bool pump_output(int timeout_ms);
  void reap();
  void on_exit(Proc& p, int status);
  void write_line(Proc& p, bool is_stderr, const std::string& line);

  LaunchOptions options_;
  std::vector<std::unique_ptr<Proc>> procs_;
  pid_t pgid_ = 0;
  std::thread monitor_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> expecting_exit_{false};
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;            // guards procs_ state (pid, exit) and failure_
  std::condition_variable exit_cv_;  // notified on every exit
  std::optional<WorkerExit> failure_;
  std::mutex out_mu_;  // one line at a time on the terminal
};

}  // namespace twinkle::core
