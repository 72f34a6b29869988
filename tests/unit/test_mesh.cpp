#include <catch2/catch.hpp>

#include "core/job/mesh.hpp"

using twinkle::core::DeviceMesh;
using V = std::vector<int>;
using VV = std::vector<std::vector<int>>;

TEST_CASE("dp x tp lays tp peers on adjacent ranks", "[mesh]") {
  DeviceMesh m({{"dp", 2}, {"tp", 2}});
  REQUIRE(m.world_size() == 4);
  CHECK(m.coords(0) == V{0, 0});
  CHECK(m.coords(1) == V{0, 1});
  CHECK(m.coords(2) == V{1, 0});
  CHECK(m.coords(3) == V{1, 1});
  CHECK(m.rank_of({1, 0}) == 2);
  CHECK(m.groups("tp") == VV{{0, 1}, {2, 3}});
  CHECK(m.groups("dp") == VV{{0, 2}, {1, 3}});
  CHECK(m.data_world() == 2);
  CHECK(V{m.data_rank(0), m.data_rank(1), m.data_rank(2), m.data_rank(3)} == V{0, 0, 1, 1});
  CHECK(m.group_of(3, "tp") == V{2, 3});
  CHECK(m.rank_in(3, "tp") == 1);
  CHECK(m.rank_in(3, "dp") == 1);
  CHECK(m.last_pp_ranks() == V{0, 1, 2, 3});
  CHECK(m.size("pp") == 1);
  CHECK(m.coord(3, "pp") == 0);
  CHECK(m.dimensions_text() == "dp=2 × tp=2");
  CHECK(m.parallelism_text() == "DP=2, TP=2");
}

TEST_CASE("pp x dp: the last stage and the data ranks", "[mesh]") {
  DeviceMesh m({{"pp", 2}, {"dp", 2}});
  CHECK(m.coords(1) == V{0, 1});
  CHECK(m.coords(2) == V{1, 0});
  CHECK(m.last_pp_ranks() == V{2, 3});
  CHECK(m.groups("pp") == VV{{0, 2}, {1, 3}});
  CHECK(m.groups("dp") == VV{{0, 1}, {2, 3}});
  CHECK(V{m.data_rank(0), m.data_rank(1), m.data_rank(2), m.data_rank(3)} == V{0, 1, 0, 1});
}

TEST_CASE("dp x fsdp: data rank = dp_rank * fsdp + fsdp_rank", "[mesh]") {
  DeviceMesh m({{"dp", 2}, {"fsdp", 3}});
  REQUIRE(m.data_world() == 6);
  for (int r = 0; r < 6; ++r) CHECK(m.data_rank(r) == r);
  CHECK(m.groups("fsdp") == VV{{0, 1, 2}, {3, 4, 5}});
  CHECK(m.groups("dp") == VV{{0, 3}, {1, 4}, {2, 5}});
}

TEST_CASE("pp x dp x tp: coordinates, sub-groups, last stage", "[mesh]") {
  DeviceMesh m({{"pp", 2}, {"dp", 2}, {"tp", 2}});
  REQUIRE(m.world_size() == 8);
  CHECK(m.coords(5) == V{1, 0, 1});
  CHECK(m.coord(5, "pp") == 1);
  CHECK(m.coord(5, "dp") == 0);
  CHECK(m.coord(5, "tp") == 1);
  CHECK(m.groups("tp") == VV{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(m.groups("dp") == VV{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(m.groups("pp") == VV{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(m.last_pp_ranks() == V{4, 5, 6, 7});
  // tp and pp peers share a data rank.
  CHECK(m.data_rank(0) == m.data_rank(1));
  CHECK(m.data_rank(0) == m.data_rank(4));
  CHECK(m.data_rank(2) == 1);
}

TEST_CASE("a custom order changes the layout", "[mesh]") {
  DeviceMesh m({{"tp", 2}, {"dp", 2}});
  CHECK(m.groups("dp") == VV{{0, 1}, {2, 3}});
  CHECK(m.groups("tp") == VV{{0, 2}, {1, 3}});
  CHECK(m.data_rank(1) == 1);
}

TEST_CASE("ep is an overlay of contiguous data-rank blocks", "[mesh]") {
  DeviceMesh m({{"dp", 4}, {"tp", 2}}, 2);
  CHECK(m.world_size() == 8);
  CHECK(m.data_world() == 4);
  CHECK(m.size("ep") == 2);
  // data ranks 0,1 | 2,3 in each tp column.
  CHECK(m.groups("ep") == VV{{0, 2}, {4, 6}, {1, 3}, {5, 7}});
  CHECK(m.coord(4, "ep") == 0);
  CHECK(m.coord(6, "ep") == 1);
  CHECK(m.dimensions_text() == "dp=4 × tp=2 (ep=2)");
}

TEST_CASE("ep over dp x fsdp", "[mesh]") {
  DeviceMesh m({{"dp", 2}, {"fsdp", 2}}, 4);
  CHECK(m.groups("ep") == VV{{0, 1, 2, 3}});
  DeviceMesh m2({{"dp", 2}, {"fsdp", 2}}, 2);
  CHECK(m2.groups("ep") == VV{{0, 1}, {2, 3}});
}

TEST_CASE("a dimension the mesh lacks gives singleton groups", "[mesh]") {
  DeviceMesh m = DeviceMesh::data_parallel(3);
  CHECK(m.groups("tp") == VV{{0}, {1}, {2}});
  CHECK(m.groups("dp") == VV{{0, 1, 2}});
  CHECK(m.data_rank(2) == 2);
}

TEST_CASE("invalid meshes are refused with the reason", "[mesh]") {
  CHECK_THROWS_WITH(DeviceMesh({{"xp", 2}}), "unknown mesh dimension \"xp\"");
  CHECK_THROWS_WITH(DeviceMesh({{"dp", 0}}), "mesh dimension dp must be >= 1, not 0");
  CHECK_THROWS_WITH(DeviceMesh({{"dp", 2}, {"dp", 2}}), "mesh dimension dp appears twice");
  CHECK_THROWS_WITH(DeviceMesh({{"dp", 3}}, 2), "ep=2 does not divide dp x fsdp = 3");
  DeviceMesh m({{"dp", 2}});
  CHECK_THROWS_AS(m.coords(2), std::out_of_range);
  CHECK_THROWS_AS(m.rank_of({2}), std::out_of_range);
}
