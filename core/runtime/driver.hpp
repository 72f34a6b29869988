#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/job/job.hpp"
#include "core/runtime/launcher.hpp"

namespace twinkle::core {

struct RunOptions {
  std::filesystem::path job_file;
  std::vector<Override> overrides;
  std::optional<int> gpus;                       // as for topology
  std::optional<std::filesystem::path> log_dir;  // one log file per rank
  bool quiet = false;                            // worker output off the terminal
  bool ascii = false;                            // topology in plain ASCII
  bool resume = false;  // start from the newest checkpoint in job.checkpoint_dir (--resume)
  // Remote mode: connects to the cluster at the job's address (the cli picks the site).
  std::function<std::unique_ptr<RemoteSite>(const Job&)> connect;
};

// How a run ended.
struct RunResult {
  // stopped: a stop was requested (SIGTERM, SIGUSR1) and the driver entry returned in its grace
  // time; --resume continues the run.
  enum class Outcome { ok, failed, interrupted, stopped };
  Outcome outcome = Outcome::ok;
  int signal = 0;  // interrupted, stopped: the signal
};

// `twinkle run`: validates the job, prints the topology, loads the plugin, starts one worker per
// rank, runs the plugin's driver entry, and tears everything down however it ends: a failure, a
// signal (SIGINT, SIGTERM, SIGHUP, SIGUSR1) or success all unwind through the same path. With a
// checkpoint_dir, SIGTERM and SIGUSR1 first ask the driver entry to stop (stop_grace_s). Throws
// ConfigError / PluginError for a bad job or plugin before anything was started.
RunResult run_job(const RunOptions& options);

}  // namespace twinkle::core
