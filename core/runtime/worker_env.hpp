#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/job/job.hpp"
#include "core/job/placement.hpp"

namespace twinkle::core {

// What a worker's environment depends on besides its placement.
struct RunInfo {
  std::string run_id;
  Mode mode = Mode::local;
  std::int64_t seed = 0;
};

// Where a group's workers rendezvous (torchrun's MASTER_ADDR and MASTER_PORT).
struct Rendezvous {
  std::string addr;  // the address of the group's first node
  int port = 0;
};

// Where group `group` of a remote placement rendezvouses: the address of its rank 0's node and a
// random port from 20000 to 39999 (none is free to ask for on another machine).
Rendezvous remote_rendezvous(const Placement& placement, std::size_t group);

// The environment of worker `worker` of group `group` of `placement` (docs/ARCHITECTURE.md, Worker
// environment): `base` (the launcher's own environment) without the variables Twinkle owns, plus
// RANK, WORLD_SIZE (in the group), LOCAL_RANK and LOCAL_WORLD_SIZE (among the group's workers on
// the same node), GROUP_RANK (the node's index among the group's nodes), MASTER_ADDR/PORT,
// CUDA_VISIBLE_DEVICES (the worker's physical GPUs; empty for cpu workers), TWINKLE_GROUP,
// TWINKLE_WORKER_NAME ("group:rank"), TWINKLE_GLOBAL_RANK, TWINKLE_MODE, TWINKLE_SEED,
// TWINKLE_RUN_ID, and OMP_NUM_THREADS=1 unless `base` sets it. A pure function.
std::vector<std::string> worker_env(const std::vector<std::string>& base,
                                    const Placement& placement, std::size_t group,
                                    std::size_t worker, const Rendezvous& rendezvous,
                                    const RunInfo& run);

// Sets each KEY=VALUE of `vars` in `env`, replacing what `env` had for KEY (a restarted worker's
// TWINKLE_RESTART_COUNT, for one).
void override_env(std::vector<std::string>& env, const std::vector<std::string>& vars);

}  // namespace twinkle::core
