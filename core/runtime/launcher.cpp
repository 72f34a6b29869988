#include "core/runtime/launcher.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

namespace twinkle::core {

LocalLauncher::LocalLauncher(LocalLaunchOptions options, transport::LocalDriverChannel& channel)
    : options_(std::move(options)),
      channel_(channel),
      spawner_(SpawnerOptions{options_.log_dir, options_.quiet, 20, {}},
               [this](const ProcessExit& e) { on_exit(e); }) {}

LocalLauncher::~LocalLauncher() { stop(std::chrono::milliseconds(0)); }

void LocalLauncher::start(const std::vector<WorkerLaunch>& workers) {
  const std::string parent = std::to_string(::getpid());
  // All names first: the spawner's thread reads them when a worker ends, even during this loop.
  for (const auto& w : workers) names_.push_back(w.name);
  for (std::size_t i = 0; i < workers.size(); ++i) {
    ProcessSpec spec;
    spec.name = workers[i].name;
    spec.argv = {options_.exe.string(),
                 "worker",
                 "--endpoint",
                 channel_.endpoint(),
                 "--plugin",
                 options_.plugin.string(),
                 "--run-dir",
                 options_.run_dir.string()};
    spec.env = workers[i].env;
    // The worker sets its parent-death signal itself and checks that its parent is still this
    // process (posix_spawn cannot set it).
    spec.env.push_back("TWINKLE_PARENT_PID=" + parent);
    spec.env.push_back("TWINKLE_SHM_FD=3");
    spec.inherit.emplace_back(channel_.take_worker_end(i), 3);
    spawner_.spawn(std::move(spec));
  }
}

void LocalLauncher::on_exit(const ProcessExit& e) {
  if (expecting_exits_ || failed_.exchange(true)) return;
  std::fprintf(stderr, "twinkle: worker %s (pid %d) %s; stopping the other workers\n",
               e.name.c_str(), e.pid, e.describe().c_str());
  std::fflush(stderr);
  spawner_.signal_all(SIGTERM);
  std::string reason = e.describe();
  if (!e.last_stderr.empty()) {
    reason += "; its last stderr lines:";
    for (const auto& l : e.last_stderr) reason += "\n    | " + l;
  }
  const auto peer = std::find(names_.begin(), names_.end(), e.name) - names_.begin();
  channel_.lost(static_cast<std::size_t>(peer), std::move(reason));
}

std::vector<std::string> LocalLauncher::stop(std::chrono::milliseconds grace) {
  expecting_exits_ = true;
  return spawner_.stop(grace);
}

}  // namespace twinkle::core
