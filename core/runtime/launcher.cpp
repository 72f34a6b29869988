#include "core/runtime/launcher.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

#include "core/runtime/worker_env.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core {

namespace {

// Workers are forked by their fork server (fork_server_enabled()).
SpawnerOptions spawner_options(const LocalLaunchOptions& o) {
  SpawnerOptions s{o.log_dir, o.quiet, 20, {}, {}, o.fork_server};
  if (fork_server_enabled()) s.fork_server = o.exe;
  return s;
}

}  // namespace

std::string Launcher::restart(const std::vector<std::size_t>&, const std::vector<std::string>&) {
  throw Error("this launcher cannot restart workers (restarts work in local mode)");
}

LocalLauncher::LocalLauncher(LocalLaunchOptions options, transport::LocalDriverChannel& channel)
    : options_(std::move(options)),
      channel_(channel),
      spawner_(spawner_options(options_), [this](const ProcessExit& e) { on_exit(e); }) {}

LocalLauncher::~LocalLauncher() { stop(std::chrono::milliseconds(0)); }

void LocalLauncher::start(const std::vector<WorkerLaunch>& workers) {
  // All names first: the spawner's thread reads them when a worker ends, even during this loop.
  for (const auto& w : workers) names_.push_back(w.name);
  launches_ = workers;
  restartable_.resize(workers.size(), false);
  {
    std::lock_guard lock(pids_mu_);
    pids_.assign(workers.size(), 0);
  }
  for (std::size_t i = 0; i < workers.size(); ++i) {
    const pid_t pid = spawn(i, workers[i].env);
    std::lock_guard lock(pids_mu_);
    if (!pids_[i]) pids_[i] = pid;
  }
}

pid_t LocalLauncher::spawn(std::size_t peer, std::vector<std::string> env) {
  ProcessSpec spec;
  spec.name = names_[peer];
  spec.argv = {options_.exe.string(),    "--endpoint", channel_.endpoint(),      "--plugin",
               options_.plugin.string(), "--run-dir",  options_.run_dir.string()};
  spec.env = std::move(env);
  // The worker sets its parent-death signal itself and checks that its parent is still this
  // process (posix_spawn cannot set it).
  spec.env.push_back("TWINKLE_PARENT_PID=" + std::to_string(::getpid()));
  using Channel = transport::LocalDriverChannel;
  spec.env.push_back(fmt::format("TWINKLE_SHM_FD={}", Channel::kShmFd));
  auto ends = channel_.take_worker_ends(peer);
  spec.inherit.emplace_back(std::move(ends.shm), Channel::kShmFd);
  spec.inherit.emplace_back(std::move(ends.control_in), Channel::kControlInFd);
  spec.inherit.emplace_back(std::move(ends.control_out), Channel::kControlOutFd);
  return spawner_.spawn(std::move(spec));
}

std::string LocalLauncher::restart(const std::vector<std::size_t>& peers,
                                   const std::vector<std::string>& env) {
  for (std::size_t p : peers) {
    pid_t old = 0;
    {
      std::lock_guard lock(pids_mu_);
      old = std::exchange(pids_.at(p), 0);
      if (old > 0) replaced_.insert(old);  // its exit, whenever it comes, is not a loss
      // A loss of this peer reported but not read yet is of the process being replaced (on_exit
      // reports under this lock, so none can come in between).
      channel_.forget_lost(p);
    }
    if (old > 0) spawner_.signal_pid(old, SIGKILL);
  }
  for (std::size_t p : peers) {
    channel_.renew_worker_ends(p);
    std::vector<std::string> e = launches_.at(p).env;
    override_env(e, env);
    const pid_t pid = spawn(p, std::move(e));
    std::lock_guard lock(pids_mu_);
    if (!pids_[p]) pids_[p] = pid;
  }
  return {};
}

void LocalLauncher::on_exit(const ProcessExit& e) {
  if (expecting_exits_) return;
  const auto peer =
      static_cast<std::size_t>(std::find(names_.begin(), names_.end(), e.name) - names_.begin());
  std::unique_lock lock(pids_mu_);
  if (peer < names_.size()) {
    if (replaced_.erase(e.pid)) return;  // a process that a restart replaced
    // An exit that raced its own spawn() returning: that is the current process.
    if (pids_[peer] == 0) pids_[peer] = e.pid;
    if (pids_[peer] != e.pid) return;
    pids_[peer] = -1;  // reaped: a restart must not signal its pid (it may be reused)
  }
  if (peer < restartable_.size() && restartable_[peer]) {
    std::fprintf(stderr, "twinkle: worker %s (pid %d) %s\n", e.name.c_str(), e.pid,
                 e.describe().c_str());
    std::fflush(stderr);
    std::string reason = e.describe();
    if (!e.last_stderr.empty()) {
      reason += "; its last stderr lines:";
      for (const auto& l : e.last_stderr) reason += "\n    | " + l;
    }
    channel_.lost(peer, std::move(reason));  // under pids_mu_: restart() forgets it atomically
    return;
  }
  lock.unlock();
  if (failed_.exchange(true)) return;
  std::fprintf(stderr, "twinkle: worker %s (pid %d) %s; stopping the other workers\n",
               e.name.c_str(), e.pid, e.describe().c_str());
  std::fflush(stderr);
  spawner_.signal_all(SIGTERM);
  std::string reason = e.describe();
  if (!e.last_stderr.empty()) {
    reason += "; its last stderr lines:";
    for (const auto& l : e.last_stderr) reason += "\n    | " + l;
  }
  channel_.lost(peer, std::move(reason));
}

std::vector<std::string> LocalLauncher::stop(std::chrono::milliseconds grace) {
  expecting_exits_ = true;
  return spawner_.stop(grace);
}

}  // namespace twinkle::core
