// Checkpoints on disk (core/runtime/checkpoint): parts written and read back, manifests,
// publishing, the newest complete one, pruning and the job's shape.
#include <unistd.h>

#include <cstdio>

#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/job/digest.hpp"
#include "core/job/job.hpp"
#include "core/runtime/checkpoint.hpp"
#include "twinkle/errors.hpp"

namespace ck = twinkle::core::checkpoint;
namespace fs = std::filesystem;
using twinkle::Tensor;
using twinkle::Value;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/twinkle-ck-test.XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

ck::PartWriter::Written write_part(const fs::path& file, const std::vector<Value>& states) {
  ck::PartWriter w(file, static_cast<std::uint32_t>(states.size()), 1);
  for (std::size_t i = 0; i < states.size(); ++i) {
    twinkle::EncodedValue e = twinkle::encode(states[i]);
    w.add("driver/Model/" + std::to_string(i), "Model", *e.view());
  }
  return w.finish();
}

ck::Manifest manifest(std::int64_t step) {
  ck::Manifest m;
  m.step = step;
  m.job = "j";
  m.run_id = "r";
  m.meta = Value::map({{"loss", 0.5}, {"epoch", step}});
  m.groups = {{"model", 2, {{"dp", 2}}}};
  return m;
}

// Publishes an empty checkpoint of `step`.
fs::path publish(const fs::path& root, std::int64_t step, int keep = 3) {
  const fs::path tmp = ck::begin(root, step, "r");
  return ck::publish(root, tmp, manifest(step), keep);
}

}  // namespace

TEST_CASE("a part holds states with their tensors and reads back verified", "[checkpoint]") {
  TempDir d;
  const fs::path file = d.path / "model.rank0.part";
  auto big = Tensor::from(std::vector<double>(1000, 1.5), {10, 100});
  auto small = Tensor::from(std::vector<std::int32_t>{1, 2, 3});
  const auto written =
      write_part(file, {Value::map({{"w", big}, {"step", 7}}), Value::map({{"ids", small}})});
  CHECK(written.bytes == fs::file_size(file));
  CHECK(written.sha256.size() == 64);

  ck::Part part = ck::Part::read(file, written.sha256);
  REQUIRE(part.size() == 2);
  twinkle::EncodedValue* s0 = part.state("driver/Model/0", "Model");
  REQUIRE(s0);
  const Value v0 = twinkle::decode(*s0);
  CHECK(v0["step"].as<int>() == 7);
  CHECK(v0["w"].tensor().equals(big));
  // Tensor payloads start aligned, so a plugin may view them as doubles.
  CHECK(reinterpret_cast<std::uintptr_t>(s0->tensors[0].data()) % 64 == 0);
  CHECK(twinkle::decode(*part.state("driver/Model/1", "Model"))["ids"].tensor().equals(small));
  CHECK(part.state("driver/Model/2", "Model") == nullptr);
  CHECK_THROWS_WITH(part.state("driver/Model/0", "Other"),
                    Catch::Contains("is a Model's, not a Other's"));
}

TEST_CASE("a part with a payload larger than the writer's chunks reads back verified",
          "[checkpoint]") {
  // 20 MiB and 12 bytes: hashed aside and written in chunks, the last one partial.
  TempDir d;
  const fs::path file = d.path / "model.rank0.part";
  std::vector<float> values((20u << 18) + 3);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 9973);
  auto large = Tensor::from(values);
  const auto written = write_part(file, {Value::map({{"ids", Tensor::from(std::vector<int>{4})}}),
                                         Value::map({{"w", large}, {"step", 3}})});
  CHECK(written.bytes == fs::file_size(file));
  // The checksum is of the file's bytes as they are on disk, in order.
  CHECK(written.sha256 == twinkle::core::sha256_file(file));
  ck::Part part = ck::Part::read(file, written.sha256);
  const Value v = twinkle::decode(*part.state("driver/Model/1", "Model"));
  CHECK(v["w"].tensor().equals(large));
  CHECK(v["step"].as<int>() == 3);
}

TEST_CASE("a damaged or short part is refused naming the file", "[checkpoint]") {
  TempDir d;
  const fs::path file = d.path / "p.part";
  const auto written = write_part(file, {Value::map({{"x", 1}})});
  CHECK_THROWS_WITH(ck::Part::read(file, std::string(64, '0')),
                    Catch::Contains("p.part: its sha256 is not the manifest's"));
  fs::resize_file(file, 12);
  CHECK_THROWS_WITH(ck::Part::read(file, written.sha256), Catch::Contains("too short"));
  CHECK_THROWS_WITH(ck::Part::read(d.path / "missing.part", written.sha256),
                    Catch::Contains("cannot open"));
}

TEST_CASE("a part whose checksum fits but whose tensor does not is refused", "[checkpoint]") {
  // A hostile part: a valid sha256 over a record whose shape's product overflows to match
  // its 8 bytes of data.
  TempDir d;
  std::string bytes = "TWKPART1";
  auto put = [&](const auto& v) { bytes.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(std::uint32_t{1});
  put(std::uint32_t{0});
  for (std::string str : {"driver/Model/0", "Model"}) {
    put(static_cast<std::uint32_t>(str.size()));
    bytes += str;
  }
  const twinkle::EncodedValue e =
      twinkle::encode(Value::map({{"t", Tensor::from(std::vector<double>{1})}}));
  put(static_cast<std::uint64_t>(e.msgpack.size()));
  bytes += e.msgpack;
  put(std::uint32_t{1});
  put(std::int32_t{1});  // f64
  put(std::int32_t{2});
  put(std::int64_t{1} << 62);
  put(std::int64_t{4});  // 2^64 elements: 0 after overflow, times 8 bytes
  put(std::uint64_t{8});
  bytes.append((64 - bytes.size() % 64) % 64, '\0');
  put(1.0);
  const fs::path file = d.path / "hostile.part";
  std::ofstream(file, std::ios::binary) << bytes;
  // libsodium's sha256 (core/job/digest.hpp), not the OpenSSL module the part reader uses.
  CHECK_THROWS_WITH(ck::Part::read(file, twinkle::core::sha256_hex(bytes.data(), bytes.size())),
                    Catch::Contains("tensor 0 of driver/Model/0 has a bad shape"));
}

TEST_CASE("a part writer refuses to overwrite and counts its states", "[checkpoint]") {
  TempDir d;
  const fs::path file = d.path / "p.part";
  write_part(file, {});
  CHECK_THROWS_WITH(ck::PartWriter(file, 0, 1), Catch::Contains("cannot create"));
  ck::PartWriter w(d.path / "q.part", 2, 1);
  twinkle::EncodedValue e = twinkle::encode(Value(1));
  w.add("k", "C", *e.view());
  CHECK_THROWS_WITH(w.finish(), Catch::Contains("1 of 2 states were written"));
}

TEST_CASE("publishing makes the newest checkpoint; older ones beyond keep go", "[checkpoint]") {
  TempDir d;
  const fs::path root = d.path / "ck";
  CHECK_FALSE(ck::newest(root));
  for (int step = 1; step <= 5; ++step) publish(root, step);
  auto all = ck::list(root);
  REQUIRE(all.size() == 3);
  CHECK(all[0].manifest.step == 5);
  CHECK(all[2].manifest.step == 3);
  CHECK(all[0].manifest.seq == 5);
  CHECK(all[0].manifest.meta["loss"].as<double>() == 0.5);
  CHECK(all[0].manifest.groups[0].mesh[0].second == 2);
  CHECK(all[0].dir.filename() == "step-0000000005");

  // Newest is the last published, not the highest step: a run that starts over at step 1.
  publish(root, 1);
  CHECK(ck::newest(root)->manifest.step == 1);
  // The same step again replaces it.
  const fs::path again = publish(root, 1);
  CHECK(ck::newest(root)->dir == again);
  CHECK(ck::list(root).size() == 3);
}

TEST_CASE("what an interrupted writer leaves is never a checkpoint", "[checkpoint]") {
  TempDir d;
  const fs::path root = d.path / "ck";
  publish(root, 1);
  // A temporary folder with every part and even a manifest, never renamed.
  const fs::path tmp = ck::begin(root, 2, "r");
  std::ofstream(tmp / "manifest.json") << "{}";
  CHECK(ck::newest(root)->manifest.step == 1);
  // A step folder whose manifest is missing or torn.
  fs::create_directories(root / "step-0000000009");
  std::ofstream(root / "step-0000000009" / "manifest.json") << "{\"format\": 1, \"se";
  CHECK(ck::newest(root)->manifest.step == 1);
  CHECK(ck::list(root).size() == 1);

  // A temporary folder of a writer that is gone (no such pid) is removed by the next begin.
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  std::string host = name;
  std::replace(host.begin(), host.end(), '.', '_');  // as the names carry it
  const fs::path stale = root / (".step-3.999999999@" + host + ".dead.tmp");
  // Another host's: its writer may be alive there, so it stays.
  const fs::path elsewhere = root / ".step-3.999999999@elsewhere.x.tmp";
  fs::create_directories(elsewhere);
  fs::create_directories(stale);
  // A checkpoint moved aside to be replaced (where RENAME_EXCHANGE is missing) by a writer that
  // died before the new one was in place goes back: it is the newest.
  const fs::path seven = publish(root, 7);
  const fs::path aside = root / (".step-7.999999999@" + host + ".dead.tmp.old");
  fs::rename(seven, aside);
  CHECK(ck::newest(root)->manifest.step == 1);
  ck::begin(root, 4, "r");
  CHECK_FALSE(fs::exists(stale));
  CHECK(fs::exists(elsewhere));
  CHECK_FALSE(fs::exists(aside));
  REQUIRE(ck::newest(root));
  CHECK(ck::newest(root)->manifest.step == 7);
}

TEST_CASE("a manifest keeps plain meta only", "[checkpoint]") {
  CHECK_NOTHROW(ck::check_meta(Value::map({{"a", Value::list({1, 2.5, "x", nullptr, true})}})));
  CHECK_THROWS_WITH(ck::check_meta(Value::map({{"t", Tensor::from(std::vector<float>{1})}})),
                    Catch::Contains("checkpoint meta.t: tensor values cannot be kept"));
  CHECK_THROWS_WITH(ck::begin("/tmp", -1, "r"), Catch::Contains("negative"));
}

TEST_CASE("a checkpoint fits a job with the same groups and meshes", "[checkpoint]") {
  const twinkle::core::Job job = twinkle::core::parse_job(R"(
[job]
plugin = "p.so"
[[group]]
name = "model"
ranks = 4
mesh = { dp = 2, tp = 2 }
[[group]]
name = "sampler"
ranks = 1
)",
                                                          "j.toml");
  const auto shapes = ck::shapes_of(job);
  CHECK(ck::differences(shapes, shapes).empty());
  auto other = shapes;
  other[0].workers = 2;
  other[1].name = "actor";
  const auto diffs = ck::differences(other, shapes);
  REQUIRE(diffs.size() == 3);
  CHECK(diffs[0] == "group model has 2 workers in the checkpoint, 4 in the job");
  CHECK(diffs[1] == "group actor is in the checkpoint, not in the job");
  CHECK(diffs[2] == "group sampler is in the job, not in the checkpoint");
  auto mesh = shapes;
  mesh[0].mesh = {{"dp", 4}, {"tp", 1}};
  CHECK(ck::differences(mesh, shapes) ==
        std::vector<std::string>{
            "group model has mesh dp=4 tp=1 in the checkpoint, dp=2 tp=2 in the job"});
}
