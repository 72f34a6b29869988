#include <catch2/catch.hpp>

#include <cstdlib>
#include <fstream>
#include <numeric>
#include <sstream>

#include "core/job/placement.hpp"
#include "core/job/topology.hpp"
#include "tests/unit/fixtures.hpp"

using namespace twinkle::core;

namespace {

using twinkle::test::kThreeGroups;
using twinkle::test::machine;

// Compares with tests/golden/NAME; TWINKLE_UPDATE_GOLDEN=1 rewrites the file instead, except
// under CI (CI set), where an update must never pass: it fails the test.
void check_golden(const std::string& name, const std::string& actual) {
  const std::string path = std::string(TWINKLE_TEST_DATA) + "/golden/" + name;
  if (std::getenv("TWINKLE_UPDATE_GOLDEN")) {
    if (const char* ci = std::getenv("CI"); ci && *ci) {
      FAIL("TWINKLE_UPDATE_GOLDEN is set under CI (CI="
           << ci
           << "): golden files are updated "
              "by hand and committed, never rewritten by a CI run");
    }
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
  std::iota(r16.begin(), r16.end(), 0);
  std::iota(r17.begin(), r17.end(), 0);
  CHECK(format_rank_list(r16) ==
        "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]");  // 16 print in full
  CHECK(format_rank_list(r17) == "[0, 1, 2, 3, 4, 5] ... [14, 15, 16] (17 total)");
}

TEST_CASE("long names are cut to fit 80 columns", "[topology]") {
  Job job = parse_job("[job]\nname = \"" + std::string(120, 'n') +
                          "\"\nplugin = \"x.so\"\n[[group]]\nname = \"" + std::string(64, 'g') +
                          "\"\nranks = 1\n",
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
