#include <catch2/catch.hpp>

#include <set>
#include <string>
#include <vector>

#include "core/cluster/scheduler.hpp"

using twinkle::core::PlacementStrategy;
using namespace twinkle::core::cluster;

namespace {

// Three nodes: n1 has 4 CPUs and GPUs 0-3 (zone a), n2 and n3 have 4 CPUs each (zone b).
std::vector<NodeCapacity> cluster() {
  return {{"n1", 4, {0, 1, 2, 3}, {{"zone", "a"}}},
          {"n2", 4, {}, {{"zone", "b"}}},
          {"n3", 4, {}, {{"zone", "b"}}}};
}

GroupDemand group(int workers, PlacementStrategy s = PlacementStrategy::pack, int gpus = 0) {
  GroupDemand d;
  d.name = "g";
  d.workers = workers;
  d.strategy = s;
  d.gpus_per_worker = gpus;
  return d;
}

std::vector<std::string> nodes_of(const std::vector<Slot>& slots) {
  std::vector<std::string> out;
  for (const auto& s : slots) out.push_back(s.node);
  return out;
}

}  // namespace

TEST_CASE("pack fills a node before the next", "[scheduler]") {
  auto r = schedule(cluster(), {group(6)});
  REQUIRE(r);
  CHECK(nodes_of((*r)[0]) == std::vector<std::string>{"n1", "n1", "n1", "n1", "n2", "n2"});
}

TEST_CASE("spread puts one worker per node per round", "[scheduler]") {
  auto r = schedule(cluster(), {group(5, PlacementStrategy::spread)});
  REQUIRE(r);
  CHECK(nodes_of((*r)[0]) == std::vector<std::string>{"n1", "n2", "n3", "n1", "n2"});
}

TEST_CASE("strict_pack keeps a group on one node or fails", "[scheduler]") {
  auto r = schedule(cluster(), {group(4, PlacementStrategy::strict_pack)});
  REQUIRE(r);
  const auto used = nodes_of((*r)[0]);
  CHECK(used.size() == 4);
  CHECK(std::set<std::string>(used.begin(), used.end()).size() == 1);
  std::string why;
  CHECK_FALSE(schedule(cluster(), {group(5, PlacementStrategy::strict_pack)}, &why));
  CHECK(why ==
        "group \"g\" (5 worker(s) of 1 CPU each, placement strict_pack): no single node has room "
        "for all of them (the most any has is 4)");
}

TEST_CASE("strict_spread needs as many nodes as workers", "[scheduler]") {
  auto r = schedule(cluster(), {group(3, PlacementStrategy::strict_spread)});
  REQUIRE(r);
  CHECK(nodes_of((*r)[0]) == std::vector<std::string>{"n1", "n2", "n3"});
  std::string why;
  CHECK_FALSE(schedule(cluster(), {group(4, PlacementStrategy::strict_spread)}, &why));
  CHECK(why ==
        "group \"g\" (4 worker(s) of 1 CPU each, placement strict_spread): they need 4 distinct "
        "nodes with room, and 3 have it");
}

TEST_CASE("labels select nodes", "[scheduler]") {
  GroupDemand d = group(2, PlacementStrategy::strict_spread);
  d.labels = {{"zone", "b"}};
  auto r = schedule(cluster(), {d});
  REQUIRE(r);
  CHECK(nodes_of((*r)[0]) == std::vector<std::string>{"n2", "n3"});
  d.labels = {{"zone", "c"}};
  std::string why;
  CHECK_FALSE(schedule(cluster(), {d}, &why));
  CHECK(why.find("no node carries the labels zone=c") != std::string::npos);
}

TEST_CASE("GPUs are never given twice, across groups too", "[scheduler]") {
  auto r = schedule(cluster(),
                    {group(2, PlacementStrategy::pack, 1), group(1, PlacementStrategy::pack, 2)});
  REQUIRE(r);
  CHECK((*r)[0][0].gpus == std::vector<int>{0});
  CHECK((*r)[0][1].gpus == std::vector<int>{1});
  CHECK((*r)[1][0].gpus == std::vector<int>{2, 3});
  std::string why;
  CHECK_FALSE(schedule(cluster(),
                       {group(3, PlacementStrategy::pack, 1), group(1, PlacementStrategy::pack, 2)},
                       &why));
  CHECK(why ==
        "group \"g\" (1 worker(s) of 2 GPU(s) and 1 CPU each, placement pack): the nodes have room "
        "for 0 of them");
}

TEST_CASE("CPUs are shared by groups until they run out", "[scheduler]") {
  auto r = schedule(cluster(), {group(8), group(4)});
  REQUIRE(r);
  CHECK(nodes_of((*r)[1]) == std::vector<std::string>{"n3", "n3", "n3", "n3"});
  CHECK_FALSE(schedule(cluster(), {group(8), group(5)}));
}

TEST_CASE("a malformed request is refused, never scheduled", "[scheduler]") {
  std::string why;
  CHECK_FALSE(schedule(cluster(), {group(-1)}, &why));
  CHECK(why == "group \"g\": -1 workers of 0 GPUs each is not a request a job can make");
  CHECK_FALSE(schedule(cluster(), {group(1, PlacementStrategy::pack, -2)}, &why));
  CHECK_FALSE(schedule(cluster(), {group(1 << 20)}, &why));
  CHECK(schedule(cluster(), {group(0)}));
}
