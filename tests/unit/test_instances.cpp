// The plugin's instances on one worker (core/runtime/instances.hpp), with the good fixture
// plugin: construction and its errors, calls, the state keys a restart and a resumed run find
// the state by, a checkpoint part written and read back, and a donor's state loaded.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "core/job/mesh.hpp"
#include "core/runtime/checkpoint.hpp"
#include "core/runtime/host_abi.hpp"
#include "core/runtime/instances.hpp"
#include "plugins/loader.hpp"
#include "tests/unit/fixtures.hpp"
#include "twinkle/value.hpp"

using namespace twinkle::core;
using twinkle::Value;
namespace proto = twinkle::transport::proto;

namespace {

// One worker's side: the plugin, a host table and the context of rank `rank`.
struct Site {
  twinkle::plugins::Plugin plugin = twinkle::plugins::Plugin::load(FIXTURE_GOOD);
  twk_host_v1 host = host_table();
  DeviceMesh mesh = DeviceMesh::data_parallel(4);
  MeshAbi mesh_abi{mesh};
  twinkle::EncodedValue args = twinkle::encode(Value::map({}));
  int rank;
  Instances instances{plugin, host, [this] { return context(); }};

  explicit Site(int r) : rank(r) {}
  twk_context_v1 context() {
    twk_context_v1 c{};
    c.size = sizeof c;
    c.rank = rank;
    c.world_size = 4;
    c.local_rank = rank;
    c.local_world_size = 4;
    c.job = "job";
    c.group = "model";
    c.device = "cpu";
    c.mesh = mesh_abi.view();
    c.args = args.view();
    return c;
  }

  std::optional<std::string> create(const std::string& cls, std::uint64_t id,
                                    const std::string& from = "") {
    proto::Create m{cls, twinkle::encode(Value::list({})), {}, std::nullopt};
    return instances.create(m, id, from).error;
  }
  proto::Reply call(std::uint64_t id, const std::string& method, Value args) {
    proto::Call m{id, method, "test.cpp:1", twinkle::encode(args), {}};
    return instances.call(m, [](const twk_value_v1& v) { return twinkle::copy_encoded(v); });
  }
  proto::State state() {
    return instances.state("model:" + std::to_string(rank),
                           [](const twk_value_v1& v) { return twinkle::copy_encoded(v); });
  }
};

// "key=rank" for every entry of a state, in order.
std::vector<std::string> ranks_by_key(const proto::State& s) {
  std::vector<std::string> out;
  for (const auto& e : s.entries)
    out.push_back(e.key + "=" + std::to_string(twinkle::decode(e.state)["rank"].as<int>()));
  return out;
}

}  // namespace

TEST_CASE("instances: construction, calls and their errors") {
  Site w(2);
  CHECK(w.create("Nope", 1).value_or("") == "the worker's plugin has no class Nope");
  CHECK(w.create("Throws", 2).value_or("").find("constructor refuses") != std::string::npos);
  CHECK(w.instances.class_of(2) == "?");  // a failed constructor leaves nothing behind
  REQUIRE_FALSE(w.create("Echo", 7));
  CHECK(w.instances.class_of(7) == "Echo");

  auto r = w.call(7, "echo", Value::list({Value("hi")}));
  REQUIRE_FALSE(r.error);
  CHECK(twinkle::decode(r.value).as<std::string>() == "hi");
  r = w.call(7, "whoami", Value::list({}));
  REQUIRE_FALSE(r.error);
  CHECK(twinkle::decode(r.value)["rank"].as<int>() == 2);
  r = w.call(7, "nothing", Value::list({}));
  REQUIRE_FALSE(r.error);
  CHECK(twinkle::decode(r.value).is_null());
  CHECK(w.call(7, "boom", Value::list({Value("why")})).error.value_or("").find("boom: why") !=
        std::string::npos);
  CHECK(w.call(7, "nope", Value::list({})).error.value_or("") ==
        "class Echo has no remote method nope");
  CHECK(w.call(8, "echo", Value::list({Value(1)})).error.value_or("") ==
        "no such instance on this worker");

  w.instances.clear();
  CHECK(w.instances.class_of(7) == "?");
}

TEST_CASE("instances: state keys name the maker, and a donor's state loads by key") {
  Site donor(3);
  REQUIRE_FALSE(donor.create("Echo", 1));
  REQUIRE_FALSE(donor.create("Echo", 2));
  REQUIRE_FALSE(donor.create("Echo", 3, "a:1"));
  const proto::State s = donor.state();
  REQUIRE_FALSE(s.error);
  CHECK(ranks_by_key(s) ==
        std::vector<std::string>{"driver/Echo/0=3", "driver/Echo/1=3", "a:1/Echo/0=3"});

  // A replacement (rank 0) makes the same instances, then loads the donor's state: each
  // instance gets the state of the one with its key.
  Site fresh(0);
  REQUIRE_FALSE(fresh.create("Echo", 1));
  REQUIRE_FALSE(fresh.create("Echo", 2));
  REQUIRE_FALSE(fresh.create("Echo", 3, "a:1"));
  CHECK(ranks_by_key(fresh.state()) ==
        std::vector<std::string>{"driver/Echo/0=0", "driver/Echo/1=0", "a:1/Echo/0=0"});
  proto::State copy = donor.state();
  const Instances::Loaded loaded = fresh.instances.load(copy.entries, "recovering");
  REQUIRE_FALSE(loaded.error);
  CHECK(loaded.instances == 3);
  CHECK(ranks_by_key(fresh.state()) ==
        std::vector<std::string>{"driver/Echo/0=3", "driver/Echo/1=3", "a:1/Echo/0=3"});

  // A state that load() refuses is the recovery's error, naming the class.
  Site other(1);
  REQUIRE_FALSE(other.create("Echo", 1));
  std::vector<proto::StateEntry> bad{
      proto::StateEntry{"driver/Echo/0", "Echo", twinkle::encode(Value::map({{"x", 1}}))}};
  const auto refused = other.instances.load(bad, "recovering model:1 from model:3");
  REQUIRE(refused.error);
  CHECK(*refused.error == "recovering model:1 from model:3: Echo.load: state has no rank");
  CHECK(refused.instances == 0);
}

TEST_CASE("instances: a checkpoint part written by one worker restores another") {
  twinkle::test::TempDir dir;
  Site a(3);
  REQUIRE_FALSE(a.create("Echo", 1));
  REQUIRE(a.create("Throws", 2));  // its constructor throws: nothing to save
  const proto::Saved saved = a.instances.save(proto::Save{dir.path.string(), "part-0", 5});
  REQUIRE_FALSE(saved.error);
  CHECK(saved.instances == 1);
  CHECK(saved.bytes > 0);
  CHECK(saved.sha256.size() == 64);

  Site b(0);
  b.instances.resume_from(5, checkpoint::Part::read(dir.path / "part-0", saved.sha256), "");
  REQUIRE_FALSE(b.create("Echo", 1));
  REQUIRE_FALSE(b.create("Echo", 2));  // made after that checkpoint: it starts fresh
  CHECK(ranks_by_key(b.state()) == std::vector<std::string>{"driver/Echo/0=3", "driver/Echo/1=0"});

  // A part that could not be read fails the first instance with state, naming the step.
  Site c(0);
  c.instances.resume_from(5, std::nullopt, "part-0: checksum mismatch");
  CHECK(c.create("Echo", 1).value_or("") ==
        "restoring Echo's state from the checkpoint of step 5: part-0: checksum mismatch");
  CHECK(c.instances.class_of(1) == "?");
}
