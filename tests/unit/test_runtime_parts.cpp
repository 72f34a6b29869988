#include <catch2/catch.hpp>

#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>

#include "core/job/job.hpp"
#include "core/job/values.hpp"
#include "core/runtime/communicators.hpp"
#include "core/runtime/failure_report.hpp"
#include "core/runtime/host_abi.hpp"
#include "core/runtime/run_dir.hpp"
#include "tests/unit/fixtures.hpp"
#include "transports/zmq/kv.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

using namespace twinkle::core;
using twinkle::Fd;
using twinkle::TransportError;
using twinkle::Value;
namespace fs = std::filesystem;

namespace {

using twinkle::test::TempDir;

// Sets an environment variable for the scope, restoring the old value (or its absence) after.
struct ScopedEnv {
  std::string key;
  std::optional<std::string> old;
  ScopedEnv(std::string k, const std::string& value) : key(std::move(k)) {
    if (const char* v = std::getenv(key.c_str())) old = v;
    ::setenv(key.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old) {
      ::setenv(key.c_str(), old->c_str(), 1);
    } else {
      ::unsetenv(key.c_str());
    }
  }
};

// The pid of a process that ran and was reaped: no process has it now (until the kernel reuses
// it, which the start time in the folder's name tells apart anyway).
pid_t dead_pid() {
  pid_t pid = 0;
  char arg0[] = "/bin/true";
  char* argv[] = {arg0, nullptr};
  REQUIRE(::posix_spawn(&pid, arg0, nullptr, nullptr, argv, environ) == 0);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return pid;
}

// "PID.START" of a run folder made by this process, read from its name
// (twinkle-run.ID.PID.START.XXXXXX).
std::string owner_part(const RunDir& dir, const std::string& run_id) {
  const std::string name = dir.path().filename().string();
  const std::string head = "twinkle-run." + run_id + ".";
  REQUIRE(name.starts_with(head));
  return name.substr(head.size(), name.size() - head.size() - std::string(".XXXXXX").size());
}

int open_null() {
  const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  return fd;
}

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }
bool is_closed(int fd) { return ::fcntl(fd, F_GETFD) == -1 && errno == EBADF; }

LostWorker lost_model_2() {
  LostWorker l;
  l.peer = 2;
  l.text = "worker model:2 (host h, pid 42) exited with code 3";
  l.calls = {"Model.step (driver caller: train.cpp:42)",
             "Model.eval (driver caller: train.cpp:50)"};
  return l;
}

}  // namespace

TEST_CASE("failure summary: root cause first, then what the driver was waiting on", "[runtime]") {
  FailureFacts f;
  f.job = "digits";
  f.run_id = "1a2b3c4d";
  f.lost = lost_model_2();
  // The driver's error repeats the loss: not shown again.
  f.error =
      "[twinkle driver caller: train.cpp:42] Model.step failed: worker model:2 (host h, pid 42) "
      "exited with code 3";
  const std::string head =
      "twinkle: job \"digits\" failed (run 1a2b3c4d)\n"
      "  root cause: worker model:2 (host h, pid 42) exited with code 3\n"
      "  the driver was waiting on: Model.step (driver caller: train.cpp:42)\n"
      "  the driver was waiting on: Model.eval (driver caller: train.cpp:50)\n";
  CHECK(failure_summary(f) == head);
  CHECK(root_cause(f) == "worker model:2 (host h, pid 42) exited with code 3");

  SECTION("a driver error that says something else follows the root cause") {
    f.error = "cannot write checkpoint /ckpt/3: No space left on device";
    CHECK(failure_summary(f) ==
          head + "  then the driver: cannot write checkpoint /ckpt/3: No space left on device\n");
    CHECK(root_cause(f) == "worker model:2 (host h, pid 42) exited with code 3");
  }
  SECTION("a multi-line loss is matched on its first line") {
    f.lost->text += "; its last stderr lines:\n  | Segmentation fault";
    f.lost->calls.clear();
    f.error = "[twinkle driver caller: train.cpp:42] Model.step failed: " + f.lost->text;
    CHECK(failure_summary(f) ==
          "twinkle: job \"digits\" failed (run 1a2b3c4d)\n"
          "  root cause: worker model:2 (host h, pid 42) exited with code 3; its last stderr "
          "lines:\n  | Segmentation fault\n");
  }
}

TEST_CASE("failure summary without a lost worker: the driver's error is the root cause",
          "[runtime]") {
  FailureFacts f;
  f.job = "digits";
  f.run_id = "ff";
  f.error = "no remote method stpe (class Model has: step); declare it with TWINKLE_METHOD";
  CHECK(failure_summary(f) ==
        "twinkle: job \"digits\" failed (run ff)\n"
        "  root cause: no remote method stpe (class Model has: step); declare it with "
        "TWINKLE_METHOD\n");
  f.error.clear();
  CHECK(root_cause(f) == "the driver entry failed without a message");
  CHECK(failure_summary(f) ==
        "twinkle: job \"digits\" failed (run ff)\n"
        "  root cause: the driver entry failed without a message\n");
}

TEST_CASE("run folder: private, under TMPDIR, removed with its owner", "[runtime]") {
  TempDir tmp;
  ScopedEnv env("TMPDIR", tmp.path.string());
  fs::path path;
  {
    RunDir dir("abcd1234");
    path = dir.path();
    CHECK(path.parent_path() == tmp.path);
    CHECK(path.filename().string().starts_with("twinkle-run.abcd1234."));
    REQUIRE(fs::is_directory(path));
    CHECK(fs::status(path).permissions() == fs::perms::owner_all);
    CHECK(dir.socket("ctl") == path / "ctl");
    CHECK(dir.socket("ctl").string().size() <= 107);
    // The name names this process, and the folder holds nothing until the run puts its sockets.
    CHECK(owner_part(dir, "abcd1234").starts_with(std::to_string(::getpid()) + "."));
    CHECK(fs::is_empty(path));
  }
  CHECK_FALSE(fs::exists(path));
}

TEST_CASE("run folder: a TMPDIR too long for a socket path falls back to /tmp", "[runtime]") {
  TempDir tmp;
  // An existing folder, so that only its length can be the reason.
  const fs::path longer = tmp.path / std::string(80, 'd');
  fs::create_directory(longer);
  ScopedEnv env("TMPDIR", longer.string());
  RunDir dir("abcd1234");
  CHECK(dir.path().parent_path() == "/tmp");
  CHECK(dir.socket("ctl").string().size() <= 107);
}

TEST_CASE("run folder: remove_stale removes folders of dead drivers only", "[runtime]") {
  TempDir tmp;
  ScopedEnv env("TMPDIR", tmp.path.string());
  RunDir live("live");  // our pid and our real start time
  const std::string us = owner_part(live, "live");
  // What a driver SIGKILLed right after mkdtemp leaves: the folder, empty.
  const fs::path half_made =
      tmp.path / ("twinkle-run.early." + std::to_string(dead_pid()) + ".12345.aaaaaa");
  // A dead driver's folder with its sockets in.
  const fs::path dead =
      tmp.path / ("twinkle-run.dead." + std::to_string(dead_pid()) + ".12345.bbbbbb");
  // A live pid (ours) with another start time: a driver that died and whose pid was reused.
  const fs::path reused =
      tmp.path / ("twinkle-run.reused." + std::to_string(::getpid()) + ".1.cccccc");
  // A live driver's folder that it has just made (empty): kept, like its full one.
  const fs::path starting = tmp.path / ("twinkle-run.starting." + us + ".dddddd");
  // Names that name no driver: not a run's folder (or one from before names carried the owner).
  const fs::path unowned = tmp.path / "twinkle-run.0badc0de.eeeeee";
  const fs::path not_numbers = tmp.path / "twinkle-run.x.12a.34.ffffff";
  const fs::path other = tmp.path / ("not-twinkle." + std::to_string(dead_pid()) + ".1.gggggg");
  for (const auto& dir : {half_made, dead, reused, starting, unowned, not_numbers, other})
    fs::create_directory(dir);
  std::ofstream(dead / "ctl") << "a socket\n";

  CHECK(RunDir::remove_stale(tmp.path) == 3);
  CHECK_FALSE(fs::exists(half_made));
  CHECK_FALSE(fs::exists(dead));
  CHECK_FALSE(fs::exists(reused));
  CHECK(fs::exists(starting));
  CHECK(fs::exists(unowned));
  CHECK(fs::exists(not_numbers));
  CHECK(fs::exists(other));
  CHECK(fs::exists(live.path()));
  CHECK(RunDir::remove_stale(tmp.path) == 0);
}

TEST_CASE("a job survives job_to_value and job_from_value field by field", "[runtime]") {
  const Job job = parse_job(R"([job]
name    = "digits"
mode    = "remote"
plugin  = "libdigits.so"
driver  = "train"
seed    = 42
timeout_s = 30.5
address = "tcp://head:7100"
nproc_per_node = 2

[[group]]
name   = "model"
ranks  = 4
device = "cuda"
gpus_per_worker = 1
mesh   = { dp = 2, tp = 2 }

[[group]]
name   = "processor"
ranks  = [8, 9]
device = "cpu"

[args]
epochs = 5
lr = 0.1
layers = [64, 32]
data = { path = "/data/x", shuffle = true }

[notify]
webhook = "http://127.0.0.1:9/hook"
kind = "dingtalk"
secret = "s"
)",
                            "jobs/digits.toml");
  // Through the wire form too: what a head receives.
  const twinkle::EncodedValue wire = twinkle::encode(job_to_value(job));
  const Job back = job_from_value(twinkle::decode(wire.msgpack.data(), wire.msgpack.size(), {}));

  CHECK(back.file == job.file);
  CHECK(back.name == "digits");
  CHECK(back.mode == Mode::remote);
  CHECK(back.plugin == job.plugin);
  CHECK(back.plugin_path == job.plugin_path);
  CHECK(back.plugin_where.text == job.plugin_where.text);
  CHECK_FALSE(back.plugin_where.text.empty());
  CHECK(back.driver == "train");
  CHECK(back.seed == 42);
  CHECK(back.timeout_s == 30.5);
  CHECK(back.address == "tcp://head:7100");
  CHECK(back.nproc_per_node == 2);
  REQUIRE(back.groups.size() == job.groups.size());
  for (std::size_t i = 0; i < job.groups.size(); ++i) {
    const GroupSpec& a = job.groups[i];
    const GroupSpec& b = back.groups[i];
    INFO("group " << a.name);
    CHECK(b.name == a.name);
    CHECK(b.ranks == a.ranks);
    CHECK(b.device == a.device);
    CHECK(b.gpus_per_worker == a.gpus_per_worker);
    CHECK(b.mesh.dims().size() == a.mesh.dims().size());
    for (std::size_t d = 0; d < a.mesh.dims().size() && d < b.mesh.dims().size(); ++d) {
      CHECK(b.mesh.dims()[d].name == a.mesh.dims()[d].name);
      CHECK(b.mesh.dims()[d].size == a.mesh.dims()[d].size);
    }
    CHECK(b.mesh.ep() == a.mesh.ep());
    CHECK(b.where.text == a.where.text);
    CHECK(b.ranks_where.text == a.ranks_where.text);
  }
  CHECK(back.groups[0].device == DeviceType::cuda);
  CHECK(back.groups[0].mesh.size("tp") == 2);
  CHECK(back.groups[1].ranks == std::vector<int>{8, 9});
  CHECK(back.args == job.args);
  CHECK(back.args["data"]["shuffle"] == Value(true));
  REQUIRE(back.notify);
  CHECK(back.notify->webhook == "http://127.0.0.1:9/hook");
  CHECK(back.notify->kind == "dingtalk");
  CHECK(back.notify->secret == "s");

  Job quiet = job;
  quiet.notify.reset();
  CHECK_FALSE(job_from_value(job_to_value(quiet)).notify);
}

TEST_CASE("a malformed job description is a TransportError naming what is wrong", "[runtime]") {
  const Job job = parse_job(
      "[job]\nname = \"t\"\nplugin = \"libt.so\"\n[[group]]\nname = \"g\"\nranks = 2\n", "t.toml");
  const Value good = job_to_value(job);

  Value v = good;
  v["mode"] = "cloud";
  CHECK_THROWS_AS(job_from_value(v), TransportError);
  CHECK_THROWS_WITH(job_from_value(v), "malformed job description: mode cloud");

  v = good;
  v["groups"][0]["device"] = "tpu";
  CHECK_THROWS_WITH(job_from_value(v), "malformed job description: device tpu");

  v = good;
  v.map_items().erase("seed");
  CHECK_THROWS_WITH(job_from_value(v), "malformed job description: map has no key \"seed\"");

  v = good;
  v["groups"][0]["mesh"]["dims"] = Value::list({Value::list({"dp", "two"})});
  CHECK_THROWS_AS(job_from_value(v), TransportError);
  CHECK_THROWS_WITH(job_from_value(v),
                    Catch::StartsWith("malformed job description: malformed mesh description: "));

  CHECK_THROWS_AS(job_from_value(Value("a job")), TransportError);
}

TEST_CASE("Fd: a moved-from owner does not close; the last owner does", "[fd]") {
  const int raw = open_null();
  Fd last;
  {
    Fd first(raw);
    Fd second(std::move(first));
    CHECK_FALSE(first);
    CHECK(first.get() == -1);
    last = std::move(second);
    CHECK_FALSE(second);
  }
  CHECK(is_open(raw));
  CHECK(last.get() == raw);

  const int other = open_null();
  last = Fd(other);  // a move assignment closes what the target held
  CHECK(is_closed(raw));
  CHECK(last.get() == other);
  { Fd end(std::move(last)); }
  CHECK(is_closed(other));
}

TEST_CASE("Fd: reset closes the old descriptor and owns the new one", "[fd]") {
  const int first = open_null();
  const int second = open_null();
  Fd fd(first);
  CHECK(fd);
  fd.reset(second);
  CHECK(is_closed(first));
  CHECK(fd.get() == second);
  CHECK(is_open(second));
  fd.reset();
  CHECK(is_closed(second));
  CHECK_FALSE(fd);
  fd.reset();  // empty: nothing to close
  CHECK(fd.get() == -1);
}

TEST_CASE("Fd: release gives ownership up without closing", "[fd]") {
  const int raw = open_null();
  {
    Fd fd(raw);
    CHECK(fd.release() == raw);
    CHECK_FALSE(fd);
  }
  CHECK(is_open(raw));
  Fd owner(raw);  // the test's own, closed at the end
}

namespace {

// The host operations of a worker as far as its collectives need them: its communicators.
struct CollectiveOps : HostOps {
  Communicators* comms = nullptr;
  Communicators* communicators() override { return comms; }
  void log(std::int32_t, std::string_view) override {}
  std::uint64_t create(std::string_view, std::string_view, const twk_value_v1&) override {
    throw twinkle::Error("not in this test");
  }
  std::uint64_t call(std::uint64_t, std::string_view, const twk_value_v1&,
                     const std::string&) override {
    throw twinkle::Error("not in this test");
  }
  twinkle::EncodedValue wait(std::uint64_t) override { throw twinkle::Error("not in this test"); }
  void release(std::uint64_t) noexcept override {}
  void comm_create(std::string_view, const Value&, double) override {}
  void attach(std::string_view, std::string_view, std::uint64_t) override {}
};

}  // namespace

TEST_CASE(
    "worker collectives: checked arguments, and errors that name the collective, the "
    "group and the rank",
    "[runtime]") {
  TempDir dir;
  zmq::context_t context;
  twinkle::transport::KvServer kv(context, "ipc://" + (dir.path / "kv").string());
  CommunicatorSetup setup;
  setup.group = "model";
  setup.device = "cpu";
  setup.collectives = "shm";
  setup.timeout = std::chrono::seconds(10);
  setup.kv_endpoint = kv.endpoint();
  Communicators comms(context, setup);
  CollectiveOps ops;
  ops.comms = &comms;
  void* ctx = static_cast<HostOps*>(&ops);
  twk_host_v1 host{};
  set_collectives(host);
  float x = 2;
  SinkCapture err;
  twk_sink_v1 sink = err.sink();

  // A group of one: the sum is the value; the rank and size are the group's.
  CHECK(host.all_reduce(ctx, "", &x, 1, TWK_DTYPE_F32, TWK_REDUCE_SUM, &sink) == TWK_OK);
  CHECK(x == 2);
  std::int32_t rank = -1, size = -1;
  CHECK(host.comm_info(ctx, "", &rank, &size, &sink) == TWK_OK);
  CHECK((rank == 0 && size == 1));
  CHECK_FALSE(err.error);

  CHECK(host.all_reduce(ctx, "", &x, 1, 99, TWK_REDUCE_SUM, &sink) == TWK_ERROR);
  CHECK(err.error == "all_reduce over group model failed on rank 0: unknown dtype 99");
  CHECK(host.all_reduce(ctx, "", &x, 1, TWK_DTYPE_F32, 42, &sink) == TWK_ERROR);
  CHECK(err.error == "all_reduce over group model failed on rank 0: unknown reduce op 42");
  CHECK(host.barrier(ctx, "nope", &sink) == TWK_ERROR);
  REQUIRE(err.error);
  CHECK_THAT(*err.error, Catch::StartsWith("barrier over group model (dim nope) failed on rank 0: "
                                           "no mesh dimension \"nope\""));

  // Before the worker has communicators (before its welcome): an error, not a crash.
  ops.comms = nullptr;
  CHECK(host.broadcast(ctx, "", &x, 1, TWK_DTYPE_F32, 0, &sink) == TWK_ERROR);
  CHECK(err.error == "broadcast: collectives run in worker methods only");
}
