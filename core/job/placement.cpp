#include "core/job/placement.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core {

namespace {

std::string gpu_source_fix(const NodeResources& local) {
  switch (local.gpu_source) {
    case GpuSource::none:
      return "no GPU was found (no NVML, no CUDA_VISIBLE_DEVICES); declare them with --gpus N";
    case GpuSource::declared: return fmt::format("--gpus declares {}", local.gpus.size());
    default:
      return fmt::format("this machine has {} (from {})", local.gpus.size(),
                         to_string(local.gpu_source));
  }
}

void place_local(const Job& job, Placement& p) {
  p.nodes.push_back(NodeSlot{p.local.hostname, false, "", ""});
  // cuda workers in global rank order take consecutive GPUs.
  struct Slot {
    int rank;
    size_t group;
    size_t worker;
  };
  std::vector<Slot> cuda;
  for (size_t gi = 0; gi < job.groups.size(); ++gi) {
    const auto& g = job.groups[gi];
    GroupPlacement gp{&g, {}};
    for (int i = 0; i < g.workers(); ++i) {
      gp.workers.push_back(WorkerPlacement{g.ranks[i], i, 0, {}});
      if (g.device == DeviceType::cuda) cuda.push_back({g.ranks[i], gi, static_cast<size_t>(i)});
    }
    p.groups.push_back(std::move(gp));
  }
  std::sort(cuda.begin(), cuda.end(), [](const Slot& a, const Slot& b) { return a.rank < b.rank; });
  size_t next = 0;
  for (const auto& s : cuda) {
    const auto& g = job.groups[s.group];
    if (next + g.gpus_per_worker > p.local.gpus.size()) {
      int needed = 0;
      for (const auto& other : job.groups) {
        if (other.device == DeviceType::cuda) needed += other.workers() * other.gpus_per_worker;
      }
      throw ConfigError(fmt::format(
          "{}: group \"{}\" does not fit: the cuda groups need {} GPU(s) ({} x {} for this group) "
          "but {}; "
          "lower ranks or gpus_per_worker, or run where more GPUs exist",
          g.where.text, g.name, needed, g.workers(), g.gpus_per_worker, gpu_source_fix(p.local)));
    }
    auto& w = p.groups[s.group].workers[s.worker];
    for (int k = 0; k < g.gpus_per_worker; ++k) w.gpus.push_back(p.local.gpus[next++].index);
  }
}

void plan_remote(const Job& job, Placement& p) {
  int max_node = 0;
  for (const auto& g : job.groups) {
    GroupPlacement gp{&g, {}};
    if (g.device == DeviceType::cuda && job.nproc_per_node == 0) {
      throw ConfigError(
          fmt::format("{}: group \"{}\" is a cuda group in remote mode; set job.nproc_per_node to "
                      "the GPUs per node",
                      g.where.text, g.name));
    }
    for (int i = 0; i < g.workers(); ++i) {
      WorkerPlacement w{g.ranks[i], i, 0, {}};
      if (g.device == DeviceType::cuda) {
        int per_node = job.nproc_per_node / g.gpus_per_worker;
        if (per_node < 1) {
          throw ConfigError(
              fmt::format("{}: group \"{}\": gpus_per_worker = {} exceeds nproc_per_node = {}",
                          g.where.text, g.name, g.gpus_per_worker, job.nproc_per_node));
        }
        // A worker of k GPUs takes GPU slots [r*k, r*k+k): with k = 1 this is node r /
        // nproc_per_node, GPU r % nproc_per_node.
        int r = g.ranks[i];
        int slot = r * g.gpus_per_worker;
        w.node = slot / job.nproc_per_node;
        int first = slot % job.nproc_per_node;
        if (first + g.gpus_per_worker > job.nproc_per_node) {
          throw ConfigError(
              fmt::format("{}: group \"{}\": rank {} with {} GPUs crosses a node boundary "
                          "(nproc_per_node = {})",
                          g.where.text, g.name, r, g.gpus_per_worker, job.nproc_per_node));
        }
        for (int k = 0; k < g.gpus_per_worker; ++k) w.gpus.push_back(first + k);
        max_node = std::max(max_node, w.node);
      }
      gp.workers.push_back(std::move(w));
    }
    p.groups.push_back(std::move(gp));
  }
  for (int n = 0; n <= max_node; ++n)
    p.nodes.push_back(NodeSlot{fmt::format("node{}", n), true, "", ""});
}

}  // namespace

Placement place(const Job& job, const NodeResources& local) {
  Placement p;
  p.local = local;
  if (job.mode == Mode::local) {
    place_local(job, p);
  } else {
    plan_remote(job, p);
  }
  return p;
}

}  // namespace twinkle::core
