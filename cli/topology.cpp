#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/cluster_flags.hpp"
#include "cli/commands.hpp"
#include "core/cluster/remote_site.hpp"
#include "core/cluster/scheduler.hpp"
#include "core/cluster/slurm.hpp"
#include "core/job/job.hpp"
#include "core/job/placement.hpp"
#include "core/job/topology.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::cli {

namespace {

struct TopologyOptions {
  std::string job_file;
  std::optional<int> gpus;
  std::vector<std::string> overrides;
  bool json = false;
  bool ascii = false;
  ClusterFlags cluster;
  std::string launcher;
};

// Inside a Slurm allocation: where the job's ranks would go on the allocated nodes.
core::Placement slurm_plan(const core::Job& job) {
  const auto alloc = core::cluster::slurm_allocation();
  std::vector<core::cluster::GroupDemand> demands;
  for (const auto& g : job.groups) {
    demands.push_back({g.name, g.workers(),
                       g.device == core::DeviceType::cuda ? g.gpus_per_worker : 0,
                       g.placement.value_or(job.placement), g.labels});
  }
  std::string why;
  auto slots = core::cluster::schedule(core::cluster::slurm_capacity(alloc), demands, &why);
  if (!slots) {
    throw ConfigError(
        fmt::format("{}: the job cannot run in {}: {}; ask Slurm for more (-N, "
                    "--gpus-per-node, --cpus-per-task)",
                    job.file.string(), alloc.describe(), why));
  }
  core::Placement p;
  std::map<std::string, int> index;
  for (std::size_t gi = 0; gi < job.groups.size(); ++gi) {
    core::GroupPlacement gp;
    gp.group = &job.groups[gi];
    for (std::size_t wi = 0; wi < (*slots)[gi].size(); ++wi) {
      const auto& s = (*slots)[gi][wi];
      auto [it, fresh] = index.emplace(s.node, static_cast<int>(p.nodes.size()));
      if (fresh) {
        for (const auto& n : alloc.nodes) {
          if (n.name == s.node)
            p.nodes.push_back({fmt::format("{} {}", n.name, n.address), false, n.name, n.address});
        }
      }
      gp.workers.push_back({gp.group->ranks.at(wi), static_cast<int>(wi), it->second, s.gpus});
    }
    p.groups.push_back(std::move(gp));
  }
  return p;
}

int run_topology(const TopologyOptions& o) {
  std::vector<core::Override> overrides;
  for (const auto& s : o.overrides) overrides.push_back(core::parse_override(s));
  if (!o.launcher.empty()) overrides.push_back(core::Override{"job.launcher", o.launcher});
  core::Job job = core::load_job(o.job_file, overrides);
  auto print = [&](const core::Placement& placement) {
    if (o.json) {
      fmt::print("{}\n", core::topology_json(job, placement).dump(2));
    } else {
      fmt::print("{}", core::render_topology(job, placement, {o.ascii}));
    }
    return 0;
  };
  const std::string address =
      job.mode == core::Mode::remote ? o.cluster.resolve(job.address) : std::string();
  // Inside an allocation a remote job without a cluster address is placed on the allocated nodes.
  const char* slurm_job = std::getenv("SLURM_JOB_ID");
  if (job.launcher == "slurm" ||
      (job.mode == core::Mode::remote && address.empty() && slurm_job && *slurm_job))
    return print(slurm_plan(job));
  if (!address.empty()) {
    // Remote mode with a cluster: where the head would put every rank now (nothing reserved).
    return print(core::cluster::connect_site(address, o.cluster.keys)->plan(job));
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
  sub->add_option("--launcher", o->launcher,
                  "slurm: place against the Slurm allocation this runs in; same as job.launcher")
      ->check(CLI::IsMember({"slurm", "local"}));
  sub->callback([o, &action] { action = [o] { return run_topology(*o); }; });
}

}  // namespace twinkle::cli
