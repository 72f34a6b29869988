#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/job.hpp"

namespace twinkle::core {

struct RunOptions {
  std::filesystem::path job_file;
  std::vector<Override> overrides;
  std::optional<int> gpus;                       // as for topology
  std::optional<std::filesystem::path> log_dir;  // one log file per rank
  bool quiet = false;                            // worker output off the terminal
  bool ascii = false;                            // topology in plain ASCII
};

// `twinkle run`: validates the job, prints the topology, loads the plugin, starts one worker per
// rank, runs the plugin's driver entry, and tears everything down however it ends. Returns the
// exit code (0 ok, 1 job failed, 130/143 interrupted); throws ConfigError / PluginError for a bad
// job or plugin before anything was started.
int run_job(const RunOptions& options);

}  // namespace twinkle::core
