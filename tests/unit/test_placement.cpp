#include <catch2/catch.hpp>

#include <cstdlib>

#include "core/job/placement.hpp"
#include "twinkle/errors.hpp"

using namespace twinkle::core;

namespace {

NodeResources machine(int gpus) {
  NodeResources r;
  r.hostname = "node-a";
  r.cpus = 8;
  for (int i = 0; i < gpus; ++i) r.gpus.push_back(GpuInfo{i, "Test GPU", 80ull << 30, ""});
  r.gpu_source = gpus ? GpuSource::nvml : GpuSource::none;
  return r;
}

const char* kThreeGroups = R"([job]
plugin = "x.so"
[[group]]
name = "model"
ranks = 4
device = "cuda"
mesh = { dp = 2, tp = 2 }
[[group]]
name = "sampler"
ranks = 2
device = "cuda"
[[group]]
name = "processor"
ranks = 2
)";

}  // namespace

TEST_CASE("local: cuda workers take consecutive GPUs in rank order", "[placement]") {
  Job job = parse_job(kThreeGroups, "job.toml");
  Placement p = place(job, machine(6));
  REQUIRE(p.groups.size() == 3);
  REQUIRE(p.nodes.size() == 1);
  CHECK(p.nodes[0].host == "node-a");
  for (int i = 0; i < 4; ++i) CHECK(p.groups[0].workers[i].gpus == std::vector<int>{i});
  CHECK(p.groups[1].workers[0].gpus == std::vector<int>{4});
  CHECK(p.groups[1].workers[1].gpus == std::vector<int>{5});
  CHECK(p.groups[2].workers[0].gpus.empty());
  CHECK(p.groups[2].workers[1].rank == 7);
  CHECK(p.groups[2].workers[1].index == 1);
}

TEST_CASE("local: gpus_per_worker takes k consecutive GPUs; physical indices are kept",
          "[placement]") {
  Job job = parse_job(
      "[job]\nplugin = \"x.so\"\n[[group]]\nname = \"g\"\nranks = 2\ndevice = \"cuda\"\n"
      "gpus_per_worker = 2\n",
      "job.toml");
  NodeResources r = machine(0);
  r.gpus = {{2, "", 0, ""},
            {3, "", 0, ""},
            {5, "", 0, ""},
            {7, "", 0, ""}};  // CUDA_VISIBLE_DEVICES=2,3,5,7
  r.gpu_source = GpuSource::visible_devices;
  Placement p = place(job, r);
  CHECK(p.groups[0].workers[0].gpus == std::vector<int>{2, 3});
  CHECK(p.groups[0].workers[1].gpus == std::vector<int>{5, 7});
}

TEST_CASE("local: a cuda group larger than the GPUs is an error at the group", "[placement]") {
  Job job = parse_job(kThreeGroups, "job.toml");
  CHECK_THROWS_WITH(
      place(job, machine(5)),
      "job.toml:8:1: group \"sampler\" does not fit: the cuda groups need 6 GPU(s) (2 x 1 for this "
      "group) but this machine has 5 (from nvml); lower ranks or gpus_per_worker, or run where "
      "more "
      "GPUs exist");
  CHECK_THROWS_AS(place(job, machine(0)), twinkle::ConfigError);
  CHECK_THROWS_WITH(place(job, machine(0)), Catch::Contains("declare them with --gpus N"));
}

TEST_CASE("remote plan: rank r on node r / nproc_per_node, GPU r % nproc_per_node", "[placement]") {
  Job job = parse_job(
      "[job]\nplugin = \"x.so\"\nmode = \"remote\"\nnproc_per_node = 4\n"
      "[[group]]\nname = \"model\"\nranks = 6\ndevice = \"cuda\"\n"
      "[[group]]\nname = \"cpu\"\nranks = 1\n",
      "job.toml");
  Placement p = place(job, machine(0));
  REQUIRE(p.nodes.size() == 2);
  CHECK(p.nodes[1].host == "node1");
  CHECK(p.nodes[1].planned);
  CHECK(p.groups[0].workers[5].node == 1);
  CHECK(p.groups[0].workers[5].gpus == std::vector<int>{1});
  CHECK(p.groups[0].workers[3].node == 0);
  CHECK(p.groups[0].workers[3].gpus == std::vector<int>{3});

  Job bad = parse_job(
      "[job]\nplugin = \"x.so\"\nmode = \"remote\"\n[[group]]\nname = \"m\"\nranks = 2\n"
      "device = \"cuda\"\n",
      "job.toml");
  CHECK_THROWS_WITH(place(bad, machine(0)), Catch::Contains("set job.nproc_per_node"));
}

TEST_CASE("CUDA_VISIBLE_DEVICES parsing", "[placement]") {
  auto v = parse_visible_devices("3,1");
  REQUIRE(v.size() == 2);
  CHECK(v[0].index == 3);
  CHECK(v[1].index == 1);
  CHECK(parse_visible_devices("").empty());
  CHECK(parse_visible_devices("-1").empty());
  CHECK(parse_visible_devices("0,-1,2").size() == 1);  // CUDA stops at the first invalid entry
  auto u = parse_visible_devices("GPU-abc,GPU-def");
  REQUIRE(u.size() == 2);
  CHECK(u[1].uuid == "GPU-def");
}

TEST_CASE("discover_local: CPUs and memory; --gpus only when nothing is found", "[placement]") {
  unsetenv("CUDA_VISIBLE_DEVICES");
  NodeResources r = discover_local(3);
  CHECK(r.cpus >= 1);
  CHECK(r.memory_bytes > 0);
  CHECK_FALSE(r.hostname.empty());
  if (r.gpu_source != GpuSource::nvml) {
    CHECK(r.gpu_source == GpuSource::declared);
    CHECK(r.gpus.size() == 3);
    setenv("CUDA_VISIBLE_DEVICES", "4,6", 1);
    NodeResources v = discover_local(3);
    CHECK(v.gpu_source == GpuSource::visible_devices);
    REQUIRE(v.gpus.size() == 2);
    CHECK(v.gpus[1].index == 6);
    unsetenv("CUDA_VISIBLE_DEVICES");
  }
}
