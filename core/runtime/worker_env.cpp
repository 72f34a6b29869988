#include "core/runtime/worker_env.hpp"

#include <algorithm>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace twinkle::core {

namespace {

// Variables a worker gets from Twinkle only, never from the launcher's environment. The tests'
// fault switches (TWINKLE_TEST_*) pass, so that a test can reach the workers.
bool owned(const std::string& kv) {
  if (kv.starts_with("TWINKLE_TEST_")) return false;
  static const char* kOwned[] = {"RANK=",        "LOCAL_RANK=",
                                 "WORLD_SIZE=",  "LOCAL_WORLD_SIZE=",
                                 "GROUP_RANK=",  "MASTER_ADDR=",
                                 "MASTER_PORT=", "CUDA_VISIBLE_DEVICES=",
                                 "TWINKLE_",     "TORCHELASTIC_RESTART_COUNT="};
  return std::any_of(std::begin(kOwned), std::end(kOwned),
                     [&](const char* k) { return kv.starts_with(k); });
}

}  // namespace

Rendezvous remote_rendezvous(const Placement& placement, std::size_t group) {
  const GroupPlacement& gp = placement.groups.at(group);
  const int first = gp.workers.empty() ? 0 : gp.workers.front().node;
  std::mt19937 pick(std::random_device{}());
  return Rendezvous{placement.nodes.at(static_cast<std::size_t>(first)).address,
                    std::uniform_int_distribution<int>(20000, 39999)(pick)};
}

std::vector<std::string> worker_env(const std::vector<std::string>& base,
                                    const Placement& placement, std::size_t group,
                                    std::size_t worker, const Rendezvous& rendezvous,
                                    const RunInfo& run) {
  const GroupPlacement& gp = placement.groups.at(group);
  const WorkerPlacement& w = gp.workers.at(worker);
  int local_rank = 0, local_world = 0;
  std::vector<int> nodes;  // the group's nodes in order of first use
  for (const auto& o : gp.workers) {
    if (std::find(nodes.begin(), nodes.end(), o.node) == nodes.end()) nodes.push_back(o.node);
    if (o.node != w.node) continue;
    if (o.index < w.index) ++local_rank;
    ++local_world;
  }
  const auto group_rank = std::find(nodes.begin(), nodes.end(), w.node) - nodes.begin();

  std::vector<std::string> env;
  bool has_omp = false;
  for (const auto& kv : base) {
    if (owned(kv)) continue;
    has_omp |= kv.starts_with("OMP_NUM_THREADS=");
    env.push_back(kv);
  }
  auto set = [&](const char* k, const std::string& v) {
    env.push_back(fmt::format("{}={}", k, v));
  };
  set("RANK", std::to_string(w.index));
  set("WORLD_SIZE", std::to_string(gp.workers.size()));
  set("LOCAL_RANK", std::to_string(local_rank));
  set("LOCAL_WORLD_SIZE", std::to_string(local_world));
  set("GROUP_RANK", std::to_string(group_rank));
  set("MASTER_ADDR", rendezvous.addr);
  set("MASTER_PORT", std::to_string(rendezvous.port));
  set("CUDA_VISIBLE_DEVICES", fmt::format("{}", fmt::join(w.gpus, ",")));
  set("TWINKLE_GROUP", gp.group->name);
  set("TWINKLE_WORKER_NAME", fmt::format("{}:{}", gp.group->name, w.index));
  set("TWINKLE_GLOBAL_RANK", std::to_string(w.rank));
  set("TWINKLE_MODE", std::string(to_string(run.mode)));
  set("TWINKLE_SEED", std::to_string(run.seed));
  set("TWINKLE_RUN_ID", run.run_id);
  // Restarts replace these (torchrun programs read the second).
  set("TWINKLE_RESTART_COUNT", "0");
  set("TORCHELASTIC_RESTART_COUNT", "0");
  if (!has_omp) set("OMP_NUM_THREADS", "1");
  return env;
}

void override_env(std::vector<std::string>& env, const std::vector<std::string>& vars) {
  for (const auto& kv : vars) {
    const std::string key = kv.substr(0, kv.find('=') + 1);
    std::erase_if(env, [&](const std::string& x) { return x.starts_with(key); });
    env.push_back(kv);
  }
}

}  // namespace twinkle::core
