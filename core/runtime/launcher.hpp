#pragma once

#include <signal.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/job/job.hpp"
#include "core/job/placement.hpp"
#include "core/runtime/spawner.hpp"
#include "transports/zmq/channel.hpp"

namespace twinkle::core {

// One worker to start: channel peer i is entry i of start()'s list.
struct WorkerLaunch {
  std::string name;              // "model:3"
  std::vector<std::string> env;  // its whole environment (worker_env)
  std::uint64_t memory = 0;      // its memory limit in bytes (0 none; node agents enforce it)
};

// Starts the workers of a run wherever they run and reports each one it loses to the driver's
// channel (CallChannel::lost). The local launcher starts processes on this machine; remote mode
// starts them through node agents. The driver never knows which one it has.
class Launcher {
 public:
  virtual ~Launcher() = default;
  // Starts every worker. Throws twinkle::Error when one cannot be started.
  virtual void start(const std::vector<WorkerLaunch>& workers) = 0;
  // Exits are expected from now on (orderly shutdown): they are not losses.
  virtual void expect_exits() = 0;
  // Waits up to `grace` for every worker to exit by itself, then stops the rest. Returns the
  // names of the workers it had to stop. Idempotent.
  virtual std::vector<std::string> stop(std::chrono::milliseconds grace) = 0;
  // Async-signal-safe: kills every worker now.
  virtual void kill_now() const noexcept = 0;

  // Restarts (docs/ARCHITECTURE.md, Restarts). Peers marked here belong to groups that restart:
  // losing one is reported like any loss, but the other workers are not stopped (the driver
  // decides). Before start().
  virtual void set_restartable(std::vector<bool> by_peer) { (void)by_peer; }
  // Replaces the processes of `peers` (SIGKILLing those that still run; their exits are not
  // reported) with new ones, started as before with `env` added; where a peer's machine is gone,
  // on another. Returns what the driver's "back" line should add about where they started
  // ("model:2 on node h4: node h3 is DEAD"; "" for nothing). Throws Error when one cannot start, or
  // where this launcher cannot restart workers.
  virtual std::string restart(const std::vector<std::size_t>& peers,
                              const std::vector<std::string>& env);
};

// What a remote-mode run gets from its cluster (docs/ARCHITECTURE.md, Remote mode). core/cluster
// implements it; the cli hands run_job a way to connect to one, so the driver never sees the head's
// protocol.
class RemoteSite {
 public:
  virtual ~RemoteSite() = default;
  // Waits up to the given time; false when the wait was interrupted (a stop signal came).
  using Wait = std::function<bool(std::chrono::milliseconds)>;
  // Reserves devices for `job` as run `run_id` and says where each worker runs; while the
  // cluster is busy it says who holds the devices and waits (through `wait`) up to the job's
  // queue_timeout_s. Throws ConfigError when the job can never fit (listing what the cluster
  // has), Error when the wait runs out; returns nullopt when interrupted.
  virtual std::optional<Placement> reserve(const Job& job, const std::string& run_id,
                                           const Wait& wait) = 0;
  // Where the job would run now, reserving nothing (`twinkle topology`).
  virtual Placement plan(const Job& job) = 0;
  // The address of this machine that the cluster's nodes reach it on.
  virtual std::string driver_address() const = 0;
  // Whether the cluster uses keys: then the run's sockets use CURVE too.
  virtual bool secure() const = 0;
  // How the run ended, before the site goes: "succeeded", "failed" or "stopped" (the head records
  // it for `twinkle jobs`).
  virtual void ended(const std::string& outcome) { (void)outcome; }

  struct Launch {
    std::filesystem::path plugin;
    std::string endpoint;              // the driver's channel
    transport::SocketSecurity worker;  // the workers' keys for it
    std::optional<std::filesystem::path> log_dir;
    bool quiet = false;
  };
  // The launcher of the reserved run: it starts workers through the nodes' agents.
  virtual std::unique_ptr<Launcher> launcher(const Job& job, const Placement& placement,
                                             Launch launch, transport::CallChannel& channel) = 0;
};

struct LocalLaunchOptions {
  std::filesystem::path exe;                     // the worker binary (worker_binary())
  std::filesystem::path plugin;                  // what workers load
  std::filesystem::path run_dir;                 // removed by workers if the driver dies
  std::optional<std::filesystem::path> log_dir;  // one log file per worker
  bool quiet = false;                            // worker output off the terminal
  std::shared_ptr<ForkServer> fork_server;       // started early by the driver, or null
};

// Local workers: `twinkle worker` processes of this machine (Spawner), connected through a
// LocalDriverChannel, each with its descriptor channel as fd 3. The first worker that ends while
// the run needs it is reported at once on stderr and to the channel, and the others are stopped.
class LocalLauncher : public Launcher {
 public:
  LocalLauncher(LocalLaunchOptions options, transport::LocalDriverChannel& channel);
  ~LocalLauncher() override;

  void start(const std::vector<WorkerLaunch>& workers) override;
  void expect_exits() override { expecting_exits_ = true; }
  std::vector<std::string> stop(std::chrono::milliseconds grace) override;
  void kill_now() const noexcept override { spawner_.signal_all(SIGKILL); }
  void set_restartable(std::vector<bool> by_peer) override { restartable_ = std::move(by_peer); }
  std::string restart(const std::vector<std::size_t>& peers,
                      const std::vector<std::string>& env) override;

 private:
  void on_exit(const ProcessExit& e);
  pid_t spawn(std::size_t peer, std::vector<std::string> env);

  LocalLaunchOptions options_;
  transport::LocalDriverChannel& channel_;
  std::vector<std::string> names_;  // by peer; fixed before the first worker starts
  std::vector<WorkerLaunch> launches_;
  std::vector<bool> restartable_;  // by peer
  mutable std::mutex pids_mu_;
  std::vector<pid_t> pids_;   // by peer: its current process (0: not known yet)
  std::set<pid_t> replaced_;  // processes a restart replaced: their exits are not losses
  std::atomic<bool> expecting_exits_{false};
  std::atomic<bool> failed_{false};
  Spawner spawner_;  // last: its monitor thread calls on_exit until it is destroyed
};

}  // namespace twinkle::core
