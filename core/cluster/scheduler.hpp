#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/job/job.hpp"

// Where a job's workers go on a cluster (docs/ARCHITECTURE.md, Placement): the head's
// decision, a pure function of what the nodes have free and what the groups ask for.
namespace twinkle::core::cluster {

// What one node offers.
struct NodeCapacity {
  std::string id;
  int cpus = 0;           // free CPUs
  std::vector<int> gpus;  // free GPU indices, ascending
  std::map<std::string, std::string> labels;
  std::int64_t memory = -1;  // free bytes for workers with a memory limit; -1: not counted
};

// What one group asks for: `workers` workers, each one CPU plus `gpus_per_worker` GPUs (cuda
// groups), on nodes that carry every one of `labels`.
struct GroupDemand {
  std::string name;
  int workers = 0;
  int gpus_per_worker = 0;  // 0 for cpu groups
  PlacementStrategy strategy = PlacementStrategy::pack;
  std::map<std::string, std::string> labels;
  std::int64_t memory = 0;  // each worker's memory limit in bytes (0: none, not counted)
};

// Where one worker goes.
struct Slot {
  std::string node;
  std::vector<int> gpus;
};

// Worker slots per group, in the order of the demands and of each group's workers; nullopt when
// the demands do not fit, with `why` saying which group did not and what it lacked.
//  - pack: as few nodes as possible (each node filled before the next, those with the most room
//    first); spread: one worker per node per round over the eligible nodes;
//  - strict_pack: the whole group on one node; strict_spread: every worker on its own node.
// Groups are placed in order and share the nodes (CPUs and GPUs taken by one are gone for the
// next); a GPU is never given twice.
std::optional<std::vector<std::vector<Slot>>> schedule(std::vector<NodeCapacity> nodes,
                                                       const std::vector<GroupDemand>& demands,
                                                       std::string* why = nullptr);

}  // namespace twinkle::core::cluster
