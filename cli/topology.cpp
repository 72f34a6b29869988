#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/cluster_flags.hpp"
#include "cli/commands.hpp"
#include "core/cluster/remote_site.hpp"
#include "core/job/job.hpp"
#include "core/job/placement.hpp"
#include "core/job/topology.hpp"

namespace twinkle::cli {

namespace {

struct TopologyOptions {
  std::string job_file;
  std::optional<int> gpus;
  std::vector<std::string> overrides;
  bool json = false;
  bool ascii = false;
  ClusterFlags cluster;
};

int run_topology(const TopologyOptions& o) {
  std::vector<core::Override> overrides;
  for (const auto& s : o.overrides) overrides.push_back(core::parse_override(s));
  core::Job job = core::load_job(o.job_file, overrides);
  const std::string address =
      job.mode == core::Mode::remote ? o.cluster.resolve(job.address) : std::string();
  if (!address.empty()) {
    // Remote mode with a cluster: where the head would put every rank now (nothing reserved).
    core::Placement placement = core::cluster::connect_site(address, o.cluster.keys)->plan(job);
    if (o.json) {
      fmt::print("{}\n", core::topology_json(job, placement).dump(2));
    } else {
      fmt::print("{}", core::render_topology(job, placement, {o.ascii}));
    }
    return 0;
  }
  core::NodeResources local = core::discover_local(o.gpus);
  if (o.gpus && local.gpu_source != core::GpuSource::declared &&
      static_cast<int>(local.gpus.size()) != *o.gpus) {
    fmt::print(stderr, "twinkle: note: --gpus {} ignored: {} GPU(s) found through {}\n", *o.gpus,
               local.gpus.size(), core::to_string(local.gpu_source));
  }
  core::Placement placement = core::place(job, local);
  if (o.json) {
    fmt::print("{}\n", core::topology_json(job, placement).dump(2));
  } else {
    fmt::print("{}", core::render_topology(job, placement, {o.ascii}));
  }
  return 0;
}

}  // namespace

void setup_topology(CLI::App& app, Action& action) {
  auto o = std::make_shared<TopologyOptions>();
  auto* sub =
      app.add_subcommand("topology", "Print where every rank of a job would run; starts nothing");
  sub->add_option("job", o->job_file, "The job file (TOML)")->required();
  sub->add_option("--gpus", o->gpus,
                  "GPUs to plan for when none are found (no NVML, no CUDA_VISIBLE_DEVICES)")
      ->check(CLI::Range(0, 1 << 16));
  sub->add_option("--set", o->overrides,
                  "Override a job file value: SECTION.KEY=VALUE (repeatable)")
      ->allow_extra_args(false);
  sub->add_flag("--json", o->json, "Print the topology as JSON for scripts");
  sub->add_flag("--ascii", o->ascii, "Draw with plain ASCII instead of box-drawing characters");
  add_cluster_flags(sub, o->cluster);
  sub->callback([o, &action] { action = [o] { return run_topology(*o); }; });
}

}  // namespace twinkle::cli
