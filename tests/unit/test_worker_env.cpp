#include <catch2/catch.hpp>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "core/job/placement.hpp"
#include "core/runtime/worker_env.hpp"

using namespace twinkle::core;

namespace {

// The value of `key` in `env`; nullopt when absent. Fails the test when `key` appears twice.
std::optional<std::string> get(const std::vector<std::string>& env, const std::string& key) {
  std::optional<std::string> found;
  for (const auto& kv : env) {
    if (!kv.starts_with(key + "=")) continue;
    INFO(key << " appears more than once");
    CHECK_FALSE(found);
    found = kv.substr(key.size() + 1);
  }
  return found;
}

// Two groups on two nodes, placed by hand:
//   model (cuda, 2 GPUs per worker): index 0, 1 on node 0 (GPUs 0,1 and 2,3), index 2 on node 1
//   (GPUs 2,3); global ranks 4..6.
//   proc (cpu): index 0 on node 1, index 1 on node 0: its first node is node 1.
struct TwoNodes {
  GroupSpec model;
  GroupSpec proc;
  Placement placement;
  Rendezvous rendezvous{"10.0.0.1", 29500};
  RunInfo run{"1a2b3c4d", Mode::remote, 42};

  TwoNodes() {
    model.name = "model";
    model.ranks = {4, 5, 6};
    model.device = DeviceType::cuda;
    model.gpus_per_worker = 2;
    proc.name = "proc";
    proc.ranks = {0, 1};
    placement.nodes = {{"node-a", false}, {"node-b", false}};
    placement.groups.push_back({&model,
                                {{.rank = 4, .index = 0, .node = 0, .gpus = {0, 1}},
                                 {.rank = 5, .index = 1, .node = 0, .gpus = {2, 3}},
                                 {.rank = 6, .index = 2, .node = 1, .gpus = {2, 3}}}});
    placement.groups.push_back({&proc,
                                {{.rank = 0, .index = 0, .node = 1, .gpus = {}},
                                 {.rank = 1, .index = 1, .node = 0, .gpus = {}}}});
  }

  std::vector<std::string> env(std::size_t group, std::size_t worker,
                               const std::vector<std::string>& base = {}) const {
    return worker_env(base, placement, group, worker, rendezvous, run);
  }
};

}  // namespace

TEST_CASE("ranks: RANK and WORLD_SIZE in the group, LOCAL_* per node, GROUP_RANK per node",
          "[env]") {
  TwoNodes t;
  struct Want {
    std::size_t group, worker;
    const char *rank, *world, *local_rank, *local_world, *group_rank, *global;
  };
  for (const Want& w :
       {Want{0, 0, "0", "3", "0", "2", "0", "4"}, Want{0, 1, "1", "3", "1", "2", "0", "5"},
        Want{0, 2, "2", "3", "0", "1", "1", "6"}, Want{1, 0, "0", "2", "0", "1", "0", "0"},
        Want{1, 1, "1", "2", "0", "1", "1", "1"}}) {
    INFO("group " << w.group << " worker " << w.worker);
    const auto env = t.env(w.group, w.worker);
    CHECK(get(env, "RANK") == w.rank);
    CHECK(get(env, "WORLD_SIZE") == w.world);
    CHECK(get(env, "LOCAL_RANK") == w.local_rank);
    CHECK(get(env, "LOCAL_WORLD_SIZE") == w.local_world);
    CHECK(get(env, "GROUP_RANK") == w.group_rank);
    CHECK(get(env, "TWINKLE_GLOBAL_RANK") == w.global);
  }
}

TEST_CASE("rendezvous, devices and the TWINKLE_ variables", "[env]") {
  TwoNodes t;
  const auto env = t.env(0, 1);
  CHECK(get(env, "MASTER_ADDR") == "10.0.0.1");
  CHECK(get(env, "MASTER_PORT") == "29500");
  CHECK(get(env, "CUDA_VISIBLE_DEVICES") == "2,3");
  CHECK(get(env, "TWINKLE_GROUP") == "model");
  CHECK(get(env, "TWINKLE_WORKER_NAME") == "model:1");
  CHECK(get(env, "TWINKLE_MODE") == "remote");
  CHECK(get(env, "TWINKLE_SEED") == "42");
  CHECK(get(env, "TWINKLE_RUN_ID") == "1a2b3c4d");
  CHECK(get(env, "OMP_NUM_THREADS") == "1");
  // A first start; restarts replace both (torchrun programs read the second).
  CHECK(get(env, "TWINKLE_RESTART_COUNT") == "0");
  CHECK(get(env, "TORCHELASTIC_RESTART_COUNT") == "0");

  // A cpu worker sees no GPU: the variable is set, and empty.
  const auto cpu = t.env(1, 0);
  CHECK(get(cpu, "CUDA_VISIBLE_DEVICES") == "");
  CHECK(get(cpu, "TWINKLE_WORKER_NAME") == "proc:0");

  t.run.mode = Mode::local;
  CHECK(get(t.env(0, 0), "TWINKLE_MODE") == "local");
}

TEST_CASE("owned variables of the launcher's environment are replaced, not duplicated", "[env]") {
  TwoNodes t;
  const std::vector<std::string> base = {"PATH=/usr/bin",
                                         "RANK=99",
                                         "LOCAL_RANK=7",
                                         "WORLD_SIZE=100",
                                         "MASTER_ADDR=elsewhere",
                                         "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7",
                                         "TWINKLE_X=leftover",
                                         "TWINKLE_GROUP=other",
                                         "RANKING=kept",
                                         "HOME=/home/u",
                                         "TORCHELASTIC_RESTART_COUNT=5",
                                         "TWINKLE_TEST_FAULT=passes"};
  const auto env = t.env(0, 2, base);
  CHECK(get(env, "RANK") == "2");
  CHECK(get(env, "LOCAL_RANK") == "0");
  CHECK(get(env, "WORLD_SIZE") == "3");
  CHECK(get(env, "MASTER_ADDR") == "10.0.0.1");
  CHECK(get(env, "CUDA_VISIBLE_DEVICES") == "2,3");
  CHECK(get(env, "TWINKLE_GROUP") == "model");
  CHECK_FALSE(get(env, "TWINKLE_X"));
  CHECK(get(env, "TORCHELASTIC_RESTART_COUNT") == "0");
  CHECK(get(env, "TWINKLE_TEST_FAULT") == "passes");  // the tests' switches reach the workers
  // Everything else passes through, in its order.
  CHECK(get(env, "PATH") == "/usr/bin");
  CHECK(get(env, "RANKING") == "kept");
  CHECK(get(env, "HOME") == "/home/u");
  CHECK(std::find(env.begin(), env.end(), "PATH=/usr/bin") <
        std::find(env.begin(), env.end(), "HOME=/home/u"));
  // Every entry is KEY=VALUE, each key once.
  std::vector<std::string> keys;
  for (const auto& kv : env) {
    REQUIRE(kv.find('=') != std::string::npos);
    keys.push_back(kv.substr(0, kv.find('=')));
  }
  std::sort(keys.begin(), keys.end());
  CHECK(std::adjacent_find(keys.begin(), keys.end()) == keys.end());
}

TEST_CASE("OMP_NUM_THREADS=1 is added only when the environment does not set it", "[env]") {
  TwoNodes t;
  CHECK(get(t.env(0, 0, {"PATH=/bin"}), "OMP_NUM_THREADS") == "1");
  CHECK(get(t.env(0, 0, {"OMP_NUM_THREADS=8"}), "OMP_NUM_THREADS") == "8");
  CHECK(get(t.env(0, 0, {"OMP_NUM_THREADS="}), "OMP_NUM_THREADS") == "");
}
