#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/cluster/scheduler.hpp"
#include "core/runtime/launcher.hpp"

// Remote mode inside a Slurm allocation (docs/ARCHITECTURE.md, Slurm): the driver is
// its own head, and one node agent per allocated node is started with srun, so no standing
// cluster is needed and Slurm's CPU and GPU binding is what the agents offer.
namespace twinkle::core::cluster {

struct SlurmNode {
  std::string name;
  std::string address;  // NodeAddr
  int cpus = 0;         // allocated to the job on this node
  int gpus = 0;         // allocated to the job on this node
};

struct SlurmAllocation {
  std::string job_id;
  std::vector<SlurmNode> nodes;

  // "Slurm job 42: 2 nodes (node1: 4 CPUs, 0 GPUs; node2: ...)"
  std::string describe() const;
};

// The allocation this process runs in (SLURM_JOB_ID), read with scontrol. Throws ConfigError
// outside an allocation (naming salloc/sbatch) or when scontrol fails.
SlurmAllocation slurm_allocation();

// What the allocation offers the scheduler (for `twinkle topology`).
std::vector<NodeCapacity> slurm_capacity(const SlurmAllocation& a);

// Starts a head in this process and the agents with srun, waits (bounded) until every node has
// joined, and returns the site that `twinkle run` uses. Everything it started ends with it.
std::unique_ptr<RemoteSite> start_slurm_site(const SlurmAllocation& a,
                                             const std::filesystem::path& exe);

}  // namespace twinkle::core::cluster
