#pragma once

#include <string>
#include <vector>

#include "core/job/job.hpp"
#include "core/job/resources.hpp"

namespace twinkle::core {

// Where one worker of a group runs.
struct WorkerPlacement {
  int rank = 0;           // global rank
  int index = 0;          // index inside its group: its RANK
  int node = 0;           // index into Placement::nodes
  std::vector<int> gpus;  // physical GPU indices on that node; empty for cpu workers
};

struct GroupPlacement {
  const GroupSpec* group = nullptr;  // points into the Job, which must outlive the Placement
  std::vector<WorkerPlacement> workers;
};

struct NodeSlot {
  std::string host;
  // Nothing is held there: remote mode without a cluster (a node the job will need), or a
  // cluster's plan (where it would go now; `twinkle topology --address`, the dashboard's preview).
  bool planned = false;
  std::string id;       // remote mode: the cluster's node id
  std::string address;  // remote mode: where the node's peers reach it
};

// Ranks -> nodes -> devices for every group (docs/ARCHITECTURE.md, Placement).
struct Placement {
  std::vector<GroupPlacement> groups;
  std::vector<NodeSlot> nodes;
  NodeResources local;  // the machine the plan was made on
};

// Local mode: every worker runs on this machine; cuda workers take the next gpus_per_worker GPUs
// in order of global rank, across groups. Remote mode without a cluster: rank r of a cuda group
// goes to node r / nproc_per_node and GPU r % nproc_per_node; cpu groups to node 0.
// Throws ConfigError at the group's position when a cuda group does not fit the GPUs.
Placement place(const Job& job, const NodeResources& local);

}  // namespace twinkle::core
