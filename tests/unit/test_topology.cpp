#include <catch2/catch.hpp>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/job/placement.hpp"
#include "core/job/topology.hpp"

using namespace twinkle::core;

namespace {

NodeResources machine(int gpus) {
  NodeResources r;
  r.hostname = "node-a";
  r.cpus = 16;
  for (int i = 0; i < gpus; ++i) r.gpus.push_back(GpuInfo{i, "NVIDIA H200", 141ull << 30, ""});
  r.gpu_source = gpus ? GpuSource::nvml : GpuSource::none;
  return r;
}

// Compares with tests/golden/NAME; TWINKLE_UPDATE_GOLDEN=1 rewrites the file instead.
void check_golden(const std::string& name, const std::string& actual) {
  const std::string path = std::string(TWINKLE_TEST_DATA) + "/golden/" + name;
  if (std::getenv("TWINKLE_UPDATE_GOLDEN")) {
    std::ofstream(path) << actual;
    return;
  }
  std::ifstream in(path);
  REQUIRE(in);
  std::stringstream expected;
  expected << in.rdbuf();
  CHECK(actual == expected.str());
}

void check_width(const std::string& text) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    INFO(line);
    CHECK(display_width(line) <= 80);
  }
}

const char* kThreeGroups = R"([job]
name = "rlhf"
plugin = "librlhf.so"
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
device = "cpu"
)";

}  // namespace

TEST_CASE("three groups: two cuda, one cpu", "[topology]") {
  Job job = parse_job(kThreeGroups, "rlhf.toml");
  Placement p = place(job, machine(6));
  std::string text = render_topology(job, p);
  check_width(text);
  check_golden("three_groups.txt", text);
  std::string ascii = render_topology(job, p, {true});
  check_width(ascii);
  for (unsigned char c : ascii) CHECK(c < 0x80);
  check_golden("three_groups_ascii.txt", ascii);
}

TEST_CASE("a 64-rank group shortens its rank list and caps its layout", "[topology]") {
  Job job = parse_job(
      "[job]\nname = \"wide\"\nplugin = \"x.so\"\n[[group]]\nname = \"big\"\nranks = 64\n"
      "device = \"cuda\"\nmesh = { dp = 8, tp = 8 }\n"
      "[[group]]\nname = \"flat\"\nranks = 64\n",
      "wide.toml");
  Placement p = place(job, machine(64));
  std::string text = render_topology(job, p);
  check_width(text);
  CHECK_THAT(text, Catch::Contains("[0, 1, 2, 3, 4, 5] ... [61, 62, 63] (64 total)"));
  CHECK_THAT(text, Catch::Contains("⋮ (55 more)"));
  check_golden("rank64.txt", text);
}

TEST_CASE("a 3-dim mesh prints its shape", "[topology]") {
  Job job = parse_job(
      "[job]\nname = \"deep\"\nplugin = \"x.so\"\n[[group]]\nname = \"model\"\nranks = 8\n"
      "mesh = { pp = 2, dp = 2, tp = 2 }\n",
      "deep.toml");
  Placement p = place(job, machine(0));
  std::string text = render_topology(job, p);
  check_width(text);
  CHECK_THAT(text, Catch::Contains("Shape      : (2, 2, 2)"));
  check_golden("mesh3d.txt", text);
}

TEST_CASE("rank lists", "[topology]") {
  CHECK(format_rank_list({0, 1, 2, 3}) == "[0, 1, 2, 3]");
  std::vector<int> r16(16), r17(17);
  for (int i = 0; i < 17; ++i) (i < 16 ? r16[i] : r16[0]) = i, r17[i] = i;
  CHECK(format_rank_list(r16).find("...") == std::string::npos);
  CHECK(format_rank_list(r17) == "[0, 1, 2, 3, 4, 5] ... [14, 15, 16] (17 total)");
}

TEST_CASE("long names are cut to fit 80 columns", "[topology]") {
  Job job = parse_job("[job]\nname = \"n\"\nplugin = \"x.so\"\n[[group]]\nname = \"" +
                          std::string(120, 'g') + "\"\nranks = 1\n",
                      "n.toml");
  check_width(render_topology(job, place(job, machine(0))));
  check_width(render_topology(job, place(job, machine(0)), {true}));
}

TEST_CASE("json carries the same facts", "[topology]") {
  Job job = parse_job(kThreeGroups, "rlhf.toml");
  auto j = topology_json(job, place(job, machine(6)));
  CHECK(j["job"] == "rlhf");
  CHECK(j["world_size"] == 8);
  REQUIRE(j["groups"].size() == 3);
  const auto& model = j["groups"][0];
  CHECK(model["mesh"]["data_world"] == 2);
  CHECK(model["workers"][3]["gpus"] == nlohmann::json::array({3}));
  CHECK(model["workers"][3]["coords"]["tp"] == 1);
  CHECK(model["workers"][3]["data_rank"] == 1);
  CHECK(j["groups"][1]["workers"][1]["gpus"] == nlohmann::json::array({5}));
  CHECK(j["groups"][2]["workers"][0]["host"] == "node-a");
}
