#include <filesystem>
#include <string>
#include <vector>

#include <signal.h>

#include <fmt/format.h>

#include "cli/cluster_flags.hpp"
#include "cli/commands.hpp"
#include "cli/exit_codes.hpp"
#include "core/cluster/remote_site.hpp"
#include "core/cluster/slurm.hpp"
#include "core/runtime/driver.hpp"
#include "core/runtime/spawner.hpp"

namespace twinkle::cli {

namespace {

struct RunCliOptions {
  std::string job_file;
  std::vector<std::string> overrides;
  std::optional<int> gpus;
  std::string log_dir;
  bool quiet = false;
  bool ascii = false;
  bool resume = false;
  ClusterFlags cluster;
  std::string launcher;
};

int run_run(const RunCliOptions& o) {
  core::RunOptions r;
  r.job_file = o.job_file;
  for (const auto& s : o.overrides) r.overrides.push_back(core::parse_override(s));
  if (!o.launcher.empty()) r.overrides.push_back(core::Override{"job.launcher", o.launcher});
  r.gpus = o.gpus;
  if (!o.log_dir.empty()) r.log_dir = o.log_dir;
  r.quiet = o.quiet;
  r.ascii = o.ascii;
  r.resume = o.resume;
  r.connect = [cluster = o.cluster](const core::Job& job) -> std::unique_ptr<core::RemoteSite> {
    if (job.launcher == "slurm") {
      return core::cluster::start_slurm_site(core::cluster::slurm_allocation(),
                                             core::twinkle_binary());
    }
    const std::string address = cluster.resolve(job.address);
    if (address.empty()) {
      throw ConfigError(
          fmt::format("{}: mode = \"remote\" needs the cluster's address: set job.address = "
                      "\"tcp://HEAD:7100\", pass --address, or set TWINKLE_ADDRESS",
                      job.file.string()));
    }
    return core::cluster::connect_site(address, cluster.keys);
  };
  const core::RunResult result = core::run_job(r);
  switch (result.outcome) {
    case core::RunResult::Outcome::ok: return kExitOk;
    case core::RunResult::Outcome::failed: return kExitJobFailed;
    case core::RunResult::Outcome::interrupted:
      return result.signal == SIGINT ? kExitInterrupted : 128 + result.signal;
    case core::RunResult::Outcome::stopped: return kExitStopped;
  }
  return kExitJobFailed;
}

}  // namespace

void setup_run(CLI::App& app, Action& action) {
  auto o = std::make_shared<RunCliOptions>();
  auto* sub = app.add_subcommand(
      "run", "Run a job: start its workers, run the plugin's driver entry, clean up");
  sub->add_option("job", o->job_file, "The job file (TOML)")->required();
  sub->add_option("--set", o->overrides,
                  "Override a job file value: SECTION.KEY=VALUE (repeatable)")
      ->allow_extra_args(false);
  sub->add_option("--gpus", o->gpus,
                  "GPUs to use when none are found (no NVML, no CUDA_VISIBLE_DEVICES)")
      ->check(CLI::Range(0, 1 << 16));
  sub->add_option("--log-dir", o->log_dir, "Also keep each worker's output in DIR/GROUP-RANK.log");
  sub->add_flag("--quiet", o->quiet, "Show only the driver's output, not the workers'");
  sub->add_flag("--ascii", o->ascii, "Draw the topology with plain ASCII");
  sub->add_flag("--resume", o->resume,
                "Start from the newest complete checkpoint in job.checkpoint_dir");
  add_cluster_flags(sub, o->cluster);
  sub->add_option("--launcher", o->launcher,
                  "slurm: run inside a Slurm allocation, one node agent per node (srun); same "
                  "as job.launcher")
      ->check(CLI::IsMember({"slurm", "local"}));
  sub->callback([o, &action] { action = [o] { return run_run(*o); }; });
}

}  // namespace twinkle::cli
