#include <catch2/catch.hpp>

#include "core/job/job.hpp"
#include "twinkle/errors.hpp"

using namespace twinkle::core;
using twinkle::ConfigError;

namespace {

Job parse(const std::string& text, const std::vector<Override>& overrides = {}) {
  return parse_job(text, "jobs/job.toml", overrides);
}

// The message of the ConfigError that parsing `text` raises.
std::string error_of(const std::string& text, const std::vector<Override>& overrides = {}) {
  try {
    parse(text, overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  FAIL("no ConfigError for:\n" << text);
  return {};
}

const std::string kJob = "[job]\nname = \"t\"\nplugin = \"libt.so\"\n";

}  // namespace

TEST_CASE("a complete job file", "[job]") {
  Job job = parse(R"([job]
name    = "digits"
mode    = "local"
plugin  = "libdigits.so"
driver  = "train"
seed    = 42
timeout_s = 30

[[group]]
name   = "model"
ranks  = 4
device = "cuda"
gpus_per_worker = 2
mesh   = { dp = 2, tp = 2 }

[[group]]
name   = "processor"
ranks  = [8, 9]
device = "cpu"

[[group]]
name   = "tail"
ranks  = 2

[args]
epochs = 5
lr = 0.1

[notify]
webhook = "http://127.0.0.1:9/hook"
kind = "dingtalk"
secret = "s"
)");
  CHECK(job.name == "digits");
  CHECK(job.mode == Mode::local);
  CHECK(job.plugin_path == "jobs/libdigits.so");
  CHECK(job.driver == "train");
  CHECK(job.seed == 42);
  CHECK(job.timeout_s == 30);
  REQUIRE(job.groups.size() == 3);
  CHECK(job.groups[0].ranks == std::vector<int>{0, 1, 2, 3});
  CHECK(job.groups[0].device == DeviceType::cuda);
  CHECK(job.groups[0].gpus_per_worker == 2);
  CHECK(job.groups[0].mesh.dimensions_text() == "dp=2 × tp=2");
  CHECK(job.groups[1].ranks == std::vector<int>{8, 9});
  CHECK(job.groups[1].mesh.dimensions_text() == "dp=2");
  // Integer ranks continue after the highest rank so far.
  CHECK(job.groups[2].ranks == std::vector<int>{10, 11});
  CHECK(job.world_size() == 12);
  CHECK(job.args["epochs"].as<int>() == 5);
  REQUIRE(job.notify);
  CHECK(job.notify->kind == "dingtalk");
  CHECK(job.find_group("processor") == &job.groups[1]);
  CHECK(job.find_group("nope") == nullptr);
}

TEST_CASE("defaults", "[job]") {
  Job job = parse("[job]\nplugin = \"/abs/libx.so\"\n[[group]]\nname = \"g\"\nranks = 3\n");
  CHECK(job.name == "job");  // the file's stem
  CHECK(job.driver == "main");
  CHECK(job.timeout_s == 600);
  CHECK(job.plugin_path == "/abs/libx.so");
  CHECK(job.groups[0].device == DeviceType::cpu);
  CHECK(job.groups[0].mesh.dims().size() == 1);
  CHECK(job.groups[0].mesh.size("dp") == 3);
  CHECK_FALSE(job.notify);
  CHECK(job.driver_labels.empty());
}

TEST_CASE("driver_labels choose the node of a submitted job's driver", "[job]") {
  const std::string group = "[[group]]\nname = \"g\"\nranks = 1\n";
  Job job = parse(kJob + "driver_labels = { role = \"driver\", zone = \"a\" }\n" + group);
  CHECK(job.driver_labels == std::map<std::string, std::string>{{"role", "driver"}, {"zone", "a"}});
  CHECK_THAT(error_of(kJob + "driver_labels = \"role=driver\"\n" + group),
             Catch::StartsWith("jobs/job.toml:4:"));
  CHECK_THAT(error_of(kJob + "driver_labels = { role = 1 }\n" + group),
             Catch::Contains("job.driver_labels.role"));
}

TEST_CASE("checkpoint keys", "[job]") {
  const std::string group = "[[group]]\nname = \"g\"\nranks = 1\n";
  Job none = parse(kJob + group);
  CHECK(none.checkpoint_dir.empty());
  CHECK(none.checkpoint_keep == 3);
  CHECK_FALSE(none.resume_auto);
  CHECK(none.stop_grace_s == 30);
  Job job = parse(kJob +
                  "checkpoint_dir = \"ck/run1\"\ncheckpoint_keep = 5\nresume = \"auto\"\n"
                  "stop_grace_s = 2.5\n" +
                  group);
  CHECK(job.checkpoint_dir == "jobs/ck/run1");  // beside the job file
  CHECK(job.checkpoint_keep == 5);
  CHECK(job.resume_auto);
  CHECK(job.stop_grace_s == 2.5);
  CHECK(parse(kJob + "checkpoint_dir = \"/abs/ck\"\n" + group).checkpoint_dir == "/abs/ck");
  CHECK(parse(kJob + group, {{"job.checkpoint_dir", "x"}}).checkpoint_dir == "jobs/x");
  CHECK(error_of(kJob + "resume = \"auto\"\n" + group) ==
        "jobs/job.toml:4:10: job.resume = \"auto\" needs job.checkpoint_dir: the folder to resume "
        "from");
  CHECK_THAT(error_of(kJob + "checkpoint_dir = \"c\"\nresume = \"nevr\"\n" + group),
             Catch::Contains("did you mean \"never\"?"));
  CHECK_THAT(error_of(kJob + "checkpoint_keep = 0\n" + group),
             Catch::StartsWith("jobs/job.toml:4:"));
  CHECK_THAT(error_of(kJob + "checkpoint_keep = 1001\n" + group),
             Catch::Contains("job.checkpoint_keep must be 1 to 1000, not 1001"));
  CHECK_THAT(error_of(kJob + "checkpoint_dir = \"\"\n" + group),
             Catch::Contains("job.checkpoint_dir must name a folder"));
  CHECK_THAT(error_of(kJob + "stop_grace_s = -1\n" + group),
             Catch::Contains("job.stop_grace_s must be at least 0"));
}

TEST_CASE("restart keys", "[job]") {
  const std::string g = "[[group]]\nname = \"g\"\nranks = 2\n";
  Job none = parse(kJob + g);
  CHECK(none.groups[0].max_restarts == 0);
  CHECK(none.groups[0].restart == "worker");
  CHECK(none.groups[0].restart_window_s == 600);
  CHECK(none.groups[0].recover == "peer");  // two data-parallel replicas: a live copy
  // One worker (no replica): the checkpoint when there are checkpoints, else a fresh start.
  const std::string one = "[[group]]\nname = \"g\"\nranks = 1\n";
  CHECK(parse(kJob + one).groups[0].recover == "none");
  CHECK(parse(kJob + "checkpoint_dir = \"c\"\n" + one).groups[0].recover == "checkpoint");
  // tp only: no replica either.
  CHECK(parse(kJob + g + "mesh = { tp = 2 }\n").groups[0].recover == "none");
  Job ck = parse(kJob + "checkpoint_dir = \"c\"\n" + g +
                 "max_restarts = 3\nrestart = \"group\"\nrestart_window_s = 60\n");
  CHECK(ck.groups[0].max_restarts == 3);
  CHECK(ck.groups[0].restart == "group");
  CHECK(ck.groups[0].restart_window_s == 60);
  CHECK(ck.groups[0].recover == "checkpoint");  // the group's default with a checkpoint_dir
  CHECK(parse(kJob + "checkpoint_dir = \"c\"\n" + g + "recover = \"none\"\n").groups[0].recover ==
        "none");
  CHECK(parse(kJob + g + "restart = \"group\"\n").groups[0].recover == "none");
  CHECK(parse(kJob + "checkpoint_dir = \"c\"\n" + g + "recover = \"checkpoint\"\n")
            .groups[0]
            .recover == "checkpoint");
  CHECK_THAT(error_of(kJob + g + "recover = \"checkpoint\"\n"),
             Catch::Contains("recover = \"checkpoint\" needs job.checkpoint_dir"));
  CHECK_THAT(error_of(kJob + g + "restart = \"grup\"\n"),
             Catch::Contains("did you mean \"group\"?"));
  CHECK_THAT(error_of(kJob + g + "restart = \"group\"\nrecover = \"peer\"\n"),
             Catch::Contains("restart = \"group\" replaces every worker of the group; use "
                             "restart = \"worker\", or recover = \"checkpoint\""));
  CHECK_THAT(error_of(kJob + g + "mesh = { tp = 2 }\nrecover = \"peer\"\n"),
             Catch::Contains("the group's mesh has no dp dimension of 2 or more (tp=2)"));
  CHECK_THAT(error_of(kJob + g + "recover = \"pear\"\n"),
             Catch::Contains("did you mean \"peer\"?"));
  CHECK_THAT(error_of(kJob + g + "max_restarts = -1\n"),
             Catch::Contains("max_restarts must be 0 to 1000, not -1"));
  CHECK_THAT(error_of(kJob + g + "restart_window_s = 0\n"),
             Catch::Contains("restart_window_s must be more than 0"));
}

TEST_CASE("mesh order overrides the layout", "[job]") {
  Job job = parse(
      kJob +
      "[[group]]\nname = \"m\"\nranks = 4\nmesh = { dp = 2, tp = 2, order = [\"tp\", \"dp\"] }\n");
  CHECK(job.groups[0].mesh.dims()[0].name == "tp");
  CHECK(job.groups[0].mesh.groups("dp") == std::vector<std::vector<int>>{{0, 1}, {2, 3}});
}

TEST_CASE("syntax errors carry file:line:column", "[job]") {
  CHECK_THAT(error_of("[job]\nplugin = \"x.so\"\nseed = = 3\n"),
             Catch::StartsWith("jobs/job.toml:3:"));
}

TEST_CASE("unknown keys get a did-you-mean hint", "[job]") {
  CHECK(error_of("[job]\nplugin = \"x.so\"\nsed = 3\n[[group]]\nname = \"g\"\nranks = 1\n") ==
        "jobs/job.toml:3:7: unknown key \"sed\" in job; did you mean \"seed\"?");
  CHECK(error_of(kJob + "[[group]]\nname = \"g\"\nrank = 1\n") ==
        "jobs/job.toml:6:8: unknown key \"rank\" in [[group]]; did you mean \"ranks\"?");
  CHECK(error_of(kJob + "[[group]]\nname = \"g\"\nranks = 4\nmesh = { dp = 2, tpp = 2 }\n") ==
        "jobs/job.toml:7:24: unknown key \"tpp\" in mesh; did you mean \"tp\"?");
  CHECK(error_of(kJob + "[[grup]]\nname = \"g\"\n") ==
        "jobs/job.toml:4:1: unknown section or key \"grup\"; did you mean \"group\"?");
  CHECK_THAT(error_of(kJob + "[[group]]\nname = \"g\"\nranks = 1\nzzzzzzzz = 1\n"),
             Catch::Contains("allowed: name, ranks, device, gpus_per_worker, mesh"));
}

TEST_CASE("missing sections and keys say what to add", "[job]") {
  CHECK(error_of("[[group]]\nname = \"g\"\nranks = 1\n") ==
        "jobs/job.toml: missing [job] section; add one with at least plugin = \"libNAME.so\"");
  CHECK(error_of("[job]\nname = \"x\"\n[[group]]\nname = \"g\"\nranks = 1\n") ==
        "jobs/job.toml: [job] has no plugin; add plugin = \"libNAME.so\" (a path relative to the "
        "job file)");
  CHECK_THAT(error_of(kJob), Catch::Contains("no [[group]] defined"));
  CHECK_THAT(error_of(kJob + "[[group]]\nranks = 1\n"), Catch::Contains("[[group]] has no name"));
  CHECK_THAT(error_of(kJob + "[[group]]\nname = \"g\"\n"),
             Catch::Contains("group \"g\" has no ranks; add ranks = N"));
}

TEST_CASE("wrong types and values", "[job]") {
  CHECK(
      error_of("[job]\nplugin = \"x.so\"\nseed = \"abc\"\n[[group]]\nname = \"g\"\nranks = 1\n") ==
      "jobs/job.toml:3:8: job.seed must be an integer, not a string");
  CHECK(error_of(
            "[job]\nplugin = \"x.so\"\nmode = \"lokal\"\n[[group]]\nname = \"g\"\nranks = 1\n") ==
        "jobs/job.toml:3:8: job.mode must be \"local\" or \"remote\", not \"lokal\"; did you mean "
        "\"local\"?");
  CHECK(error_of("[job]\nplugin = \"x.so\"\ntimeout_s = 0\n[[group]]\nname = \"g\"\nranks = 1\n") ==
        "jobs/job.toml:3:13: job.timeout_s must be more than 0 and at most 604800 (7 days), not 0");
  CHECK(error_of(kJob + "[[group]]\nname = \"g\"\nranks = 1\ndevice = \"gpu\"\n") ==
        "jobs/job.toml:7:10: group \"g\": device must be \"cpu\" or \"cuda\", not \"gpu\"; did you "
        "mean \"cpu\"?");
  CHECK_THAT(error_of(kJob + "[[group]]\nname = \"g\"\nranks = 1\ndevice = \"npu\"\n"),
             Catch::Contains("device \"npu\" is reserved"));
  CHECK(error_of(kJob + "[[group]]\nname = \"g\"\nranks = 0\n") ==
        "jobs/job.toml:6:9: group.g.ranks must be a positive integer, not 0");
  CHECK(error_of(kJob + "[[group]]\nname = \"g\"\nranks = [1, 1]\n") ==
        "jobs/job.toml:6:13: group \"g\": rank 1 is listed twice");
  CHECK(error_of(kJob + "[[group]]\nname = \"g\"\nranks = 2\ngpus_per_worker = 2\n") ==
        "jobs/job.toml:7:19: group \"g\": gpus_per_worker applies to cuda groups only; set device "
        "= \"cuda\" or "
        "remove it");
  CHECK_THAT(error_of(kJob + "[[group]]\nname = \"a b\"\nranks = 1\n"),
             Catch::Contains("group name \"a b\" is not allowed: use 1 to 64 letters, digits, "
                             "'_', '.' or '-'"));
  CHECK_THAT(error_of("[job]\nplugin = \"x.so\"\naddress = \"head:7100\"\n[[group]]\nname = "
                      "\"g\"\nranks = 1\n"),
             Catch::Contains("job.address must look like tcp://HOST:PORT"));
}

TEST_CASE("limits: nesting, ranks, timeouts, names", "[job]") {
  std::string deep_key;
  for (int i = 0; i < 5000; ++i) deep_key += i ? ".k" : "k";
  CHECK(error_of(kJob + "[[group]]\nname = \"g\"\nranks = 1\n[args]\n" + deep_key + " = 1\n") ==
        "jobs/job.toml:8:512: a key nests deeper than 256 levels; TOML tables and values may nest "
        "at most 256 deep");
  // Dots inside strings and values are no keys.
  CHECK_NOTHROW(parse_job(kJob + "[[group]]\nname = \"g\"\nranks = 1\n[args]\n\"" + deep_key +
                              "\" = \"" + deep_key + "\"\n",
                          "j.toml"));
  CHECK(error_of(kJob + "[[group]]\nname = \"g\"\nranks = [2147483648]\n") ==
        "jobs/job.toml:6:10: group \"g\": rank 2147483648 is out of range; ranks go from 0 to "
        "65535");
  CHECK(error_of(kJob + "[[group]]\nname = \"g\"\nranks = [9223372036854775807]\n") ==
        "jobs/job.toml:6:10: group \"g\": rank 9223372036854775807 is out of range; ranks go from "
        "0 to 65535");
  CHECK(error_of(kJob + "[[group]]\nname = \"a\"\nranks = [65535]\n[[group]]\nname = "
                        "\"b\"\nranks = 1\n") ==
        "jobs/job.toml:9:9: group \"b\": ranks 65536 to 65536 go past the highest rank, 65535; a "
        "job has at most 65536 ranks");
  CHECK(error_of(kJob + "[[group]]\nname = \"g\"\nranks = 2\nmesh = { dp = 65536, tp = 65536, "
                        "pp = 65536 }\n") ==
        "jobs/job.toml:7:8: group \"g\": mesh pp=65536 × dp=65536 × tp=65536 has 1099511627776 "
        "ranks but the group has 2 workers; make the sizes multiply to 2");
  for (const char* t : {"1e10", "inf", "nan", "-inf"}) {
    CHECK_THAT(error_of(std::string("[job]\nplugin = \"x.so\"\ntimeout_s = ") + t +
                        "\n[[group]]\nname = \"g\"\nranks = 1\n"),
               Catch::StartsWith("jobs/job.toml:3:13: job.timeout_s must be more than 0 and at "
                                 "most 604800 (7 days), not "));
  }
  CHECK(error_of(kJob + "[[group]]\nname = \"a\\u0000\\n\\u001b[31m\"\nranks = 1\n") ==
        "jobs/job.toml:5:8: group name \"a\\x00\\x0a\\x1b[31m\" is not allowed: use 1 to 64 "
        "letters, digits, '_', '.' or '-'");
  CHECK_NOTHROW(parse_job(kJob + "[[group]]\nname = \"Model_1.v-2\"\nranks = 1\n", "j.toml"));
}

TEST_CASE("load_job reads regular files only", "[job]") {
  CHECK_THROWS_WITH(load_job("/dev/zero"),
                    "/dev/zero: is a character device, not a regular file; give the path of a "
                    "TOML job file");
  CHECK_THROWS_WITH(load_job("/"),
                    "/: is a directory, not a regular file; give the path of a "
                    "TOML job file");
}

TEST_CASE("overlapping ranks and duplicate groups", "[job]") {
  CHECK(error_of(kJob + "[[group]]\nname = \"sampler\"\nranks = [2, 3]\n"
                        "[[group]]\nname = \"model\"\nranks = [0, 1, 2, 3]\n") ==
        "jobs/job.toml:9:9: group \"model\": ranks overlap group \"sampler\" (rank 2); give each "
        "group its own "
        "ranks");
  CHECK(
      error_of(kJob + "[[group]]\nname = \"a\"\nranks = 1\n[[group]]\nname = \"a\"\nranks = 1\n") ==
      "jobs/job.toml:7:1: group \"a\" is defined twice; give each [[group]] a unique name");
}

TEST_CASE("mesh errors", "[job]") {
  CHECK(error_of(kJob + "[[group]]\nname = \"m\"\nranks = 4\nmesh = { dp = 2, tp = 3 }\n") ==
        "jobs/job.toml:7:8: group \"m\": mesh dp=2 × tp=3 has 6 ranks but the group has 4 workers; "
        "make the sizes "
        "multiply to 4");
  CHECK(
      error_of(kJob + "[[group]]\nname = \"m\"\nranks = 6\nmesh = { dp = 3, tp = 2, ep = 2 }\n") ==
      "jobs/job.toml:7:31: group \"m\": ep=2 must divide dp x fsdp = 3");
  CHECK(error_of(
            kJob +
            "[[group]]\nname = \"m\"\nranks = 4\nmesh = { dp = 2, tp = 2, order = [\"dp\"] }\n") ==
        "jobs/job.toml:7:34: group \"m\": mesh order must name every dimension of the mesh exactly "
        "once");
  CHECK_THAT(
      error_of(kJob +
               "[[group]]\nname = \"m\"\nranks = 4\nmesh = { dp = 4, order = [\"dp\", \"pp\"] }\n"),
      Catch::Contains("mesh order names \"pp\", which is not a dimension of this mesh"));
  CHECK_THAT(error_of(kJob + "[[group]]\nname = \"m\"\nranks = 4\nmesh = { ep = 1 }\n"),
             Catch::Contains("mesh has no dimensions"));
  CHECK_THAT(error_of(kJob + "[[group]]\nname = \"m\"\nranks = 4\nmesh = { dp = 0, tp = 4 }\n"),
             Catch::Contains("group.m.mesh.dp must be a positive integer, not 0"));
}

TEST_CASE("notify errors", "[job]") {
  const std::string g = "[[group]]\nname = \"g\"\nranks = 1\n";
  CHECK_THAT(error_of(kJob + g + "[notify]\nkind = \"json\"\n"),
             Catch::Contains("[notify] has no webhook"));
  CHECK_THAT(error_of(kJob + g + "[notify]\nwebhook = \"ftp://x\"\n"),
             Catch::Contains("must be an http:// or https:// URL"));
  CHECK_THAT(error_of(kJob + g + "[notify]\nwebhook = \"http://x\"\nkind = \"slack\"\n"),
             Catch::Contains("notify.kind must be \"json\" or \"dingtalk\", not \"slack\""));
  CHECK_THAT(error_of(kJob + g + "[notify]\nwebhook = \"http://x\"\nsecret = \"s\"\n"),
             Catch::Contains("notify.secret signs DingTalk requests"));
}

TEST_CASE("--set overrides apply after the file and are validated", "[job]") {
  const std::string text =
      kJob + "seed = 1\n[[group]]\nname = \"model\"\nranks = 2\n[args]\nlr = 0.1\n";
  Job job = parse(
      text, {parse_override("job.seed=7"), parse_override("args.lr=0.5"),
             parse_override("args.tag=hello world"), parse_override("group.model.ranks=4"),
             parse_override("group.model.mesh.tp=2"), parse_override("group.model.mesh.dp=2")});
  CHECK(job.seed == 7);
  CHECK(job.args["lr"].as<double>() == 0.5);
  CHECK(job.args["tag"].as<std::string>() == "hello world");
  CHECK(job.groups[0].workers() == 4);
  CHECK(job.groups[0].mesh.dimensions_text() == "dp=2 × tp=2");

  CHECK(error_of(text, {parse_override("job.seed=abc")}) ==
        "--set job.seed: job.seed must be an integer, not a string");
  CHECK(error_of(text, {parse_override("group.model.devce=gpu")}) ==
        "--set group.model.devce: unknown key \"devce\" in [[group]]; did you mean \"device\"?");
  CHECK(parse(text, {parse_override("args.quote=say \"hi\"\\")}).args["quote"].as<std::string>() ==
        "say \"hi\"\\");
  CHECK(error_of(text, {parse_override("job.sed=1")}) ==
        "--set job.sed: unknown key \"sed\" in job; did you mean \"seed\"?");
  CHECK(error_of(text, {parse_override("group.modle.ranks=1")}) ==
        "--set group.modle.ranks: jobs/job.toml has no group \"modle\"; did you mean \"model\"?");
  CHECK_THROWS_WITH(parse_override("job.seed"),
                    Catch::StartsWith("--set job.seed: expected SECTION.KEY=VALUE"));
  CHECK_THAT(error_of(text, {parse_override("seed=1")}), Catch::Contains("expected SECTION.KEY"));
}

TEST_CASE("load_job names a missing file", "[job]") {
  CHECK_THROWS_WITH(load_job("/nonexistent/job.toml"),
                    "/nonexistent/job.toml: no such job file; check the path");
}

TEST_CASE("closest_match", "[job]") {
  CHECK(closest_match("sed", {"seed", "name"}) == "seed");
  CHECK(closest_match("qqqqqq", {"seed", "name"}) == std::nullopt);
}

TEST_CASE("the collectives backend comes from the job file, TWINKLE_COLLECTIVES overrides it",
          "[job]") {
  const std::string group = "[[group]]\nname = \"g\"\nranks = 2\n";
  Job job = parse(kJob + group);
  CHECK(job.collectives == "auto");
  CHECK(collectives_backend(job, nullptr) == "auto");
  job = parse(kJob + "collectives = \"gloo\"\n" + group);
  CHECK(collectives_backend(job, nullptr) == "gloo");
  CHECK(collectives_backend(job, "shm") == "shm");
  CHECK(parse(kJob + group, {parse_override("job.collectives=shm")}).collectives == "shm");
  CHECK(error_of(kJob + "collectives = \"shmem\"\n" + group) ==
        "jobs/job.toml:4:15: job.collectives must be \"auto\", \"shm\" or \"gloo\", not \"shmem\"; "
        "did you mean \"shm\"?");
  CHECK_THROWS_WITH(collectives_backend(job, "mpi"),
                    "TWINKLE_COLLECTIVES must be \"auto\", \"shm\" or \"gloo\", not \"mpi\"; unset "
                    "it to use job.collectives (\"gloo\")");
}
