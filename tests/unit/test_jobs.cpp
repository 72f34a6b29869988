// The job service's parts (docs/ARCHITECTURE.md, Job service): the SQLite history, working
// directory archives and the supervisor of a submitted driver.
#include <archive.h>
#include <archive_entry.h>
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <set>

#include "core/job/digest.hpp"
#include "core/jobs/archive.hpp"
#include "core/jobs/service.hpp"
#include "core/jobs/store.hpp"
#include "core/jobs/supervisor.hpp"
#include "tests/unit/fixtures.hpp"
#include "twinkle/errors.hpp"

using namespace twinkle;
using namespace twinkle::core::jobs;
namespace fs = std::filesystem;

namespace {

void write_file(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

JobRecord job(const std::string& name, const std::string& user, const std::string& state) {
  JobRecord j;
  j.name = name;
  j.user = user;
  j.state = state;
  j.overrides = "[]";
  j.demand = "[]";
  return j;
}

// All of a job folder's log, across rotation.
std::string whole_log(const fs::path& dir, std::int64_t* first = nullptr) {
  std::string out;
  std::int64_t at = 0;
  bool start = true;
  for (;;) {
    auto p = read_log(dir, at, 1000);
    if (start && first) *first = p.offset;
    start = false;
    if (p.bytes.empty()) return out;
    out += p.bytes;
    at = p.offset + static_cast<std::int64_t>(p.bytes.size());
  }
}

}  // namespace

TEST_CASE("the job history keeps jobs and audit records across a reopen", "[jobs]") {
  test::TempDir tmp;
  const fs::path db = tmp.path / "jobs.db";
  std::int64_t a = 0, b = 0;
  {
    Store s(db);
    a = s.add(job("first", "alice", "QUEUED"));
    b = s.add(job("second", "bob", "RUNNING"));
    CHECK(b > a);
    auto j = *s.get(a);
    j.state = "SUCCEEDED";
    j.exit_code = 0;
    j.placement = R"([{"group":"model","rank":0,"node":"n1","gpus":[0]}])";
    j.driver_labels = R"({"role":"driver"})";
    j.driver_node = "d1";
    s.update(j);
    s.audit(AuditRecord{a, 100, "alice", "submit", "laptop", "first"});
    s.audit(AuditRecord{a, 101, "bob", "stop refused", "desk", "not the owner"});
  }
  Store s(db);  // as a restarted head opens it
  const auto j = s.get(a);
  REQUIRE(j);
  CHECK(j->name == "first");
  CHECK(j->state == "SUCCEEDED");
  REQUIRE(j->exit_code);
  CHECK(*j->exit_code == 0);
  CHECK(j->placement.find("\"n1\"") != std::string::npos);
  CHECK(j->driver_labels == R"({"role":"driver"})");
  CHECK(j->driver_node == "d1");
  CHECK(s.get(b)->driver_labels == "{}");  // the driver on the head's machine
  CHECK(s.get(b)->driver_node.empty());
  CHECK_FALSE(s.get(b)->exit_code);
  const auto audit = s.audit_of(a);
  REQUIRE(audit.size() == 2);
  CHECK(audit[0].action == "submit");
  CHECK(audit[1].user == "bob");
  CHECK(s.in_state("RUNNING").size() == 1);
  CHECK_FALSE(s.get(9999));
}

TEST_CASE("the job list puts active jobs first, filters, and keeps the newest ended", "[jobs]") {
  test::TempDir tmp;
  Store s(tmp.path / "jobs.db");
  for (int i = 0; i < 30; ++i) s.add(job("old", i % 2 ? "alice" : "bob", "SUCCEEDED"));
  const auto q = s.add(job("waiting", "alice", "QUEUED"));
  JobFilter f;
  auto l = s.list(f);
  REQUIRE(l.size() == 21);  // the active one and the newest 20 others
  CHECK(l[0].id == q);
  CHECK(l[1].id == q - 1);
  f.all = true;
  CHECK(s.list(f).size() == 31);
  f.user = "alice";
  CHECK(s.list(f).size() == 16);
  f.state = "QUEUED";
  CHECK(s.list(f).size() == 1);

  SECTION("pruning removes the oldest ended jobs only, and ids are not reused") {
    auto old = *s.get(1);
    old.sha256 = "aa";
    s.update(old);
    CHECK(s.uses("aa"));
    const auto gone = s.prune(5);
    CHECK(gone.size() == 25);
    CHECK(gone.back() == std::pair<std::int64_t, std::string>{1, "aa"});
    CHECK_FALSE(s.uses("aa"));
    CHECK(s.count() == 6);
    CHECK(s.get(q));
    CHECK_FALSE(s.get(1));
    CHECK(s.add(job("new", "alice", "QUEUED")) == q + 1);
  }
}

TEST_CASE("a working directory packs to the same bytes, without what .twinkleignore names",
          "[jobs]") {
  test::TempDir tmp;
  const fs::path dir = tmp.path / "work";
  write_file(dir / "job.toml", "[job]\n");
  write_file(dir / "data" / "train.bin", std::string(1000, 'x'));
  write_file(dir / "checkpoints" / "step-1" / "part", "big");
  write_file(dir / "notes.log", "log");
  write_file(dir / "sub" / "keep.log.txt", "kept");
  write_file(dir / ".twinkleignore", "# comment\ncheckpoints/\n*.log\n/data/*.tmp\n/top\n");
  write_file(dir / "data" / "x.tmp", "tmp");
  write_file(dir / "top", "anchored: left out");
  write_file(dir / "sub" / "top", "not the top one: kept");
  fs::create_symlink("data/train.bin", dir / "link");

  const auto a = pack_dir(dir, 1 << 20);
  const auto b = pack_dir(dir, 1 << 20);
  CHECK(a.sha256 == b.sha256);
  CHECK(a.bytes == b.bytes);
  CHECK(a.sha256 == core::sha256_hex(a.bytes.data(), a.bytes.size()));
  const std::set<std::string> ignored(a.ignored.begin(), a.ignored.end());
  CHECK(ignored == std::set<std::string>{"checkpoints/", "data/x.tmp", "notes.log", "top"});

  const fs::path into = tmp.path / "copy";
  write_file(tmp.path / "a.tar", std::string(a.bytes.begin(), a.bytes.end()));
  unpack(tmp.path / "a.tar", into);
  CHECK(read_file(into / "job.toml") == "[job]\n");
  CHECK(read_file(into / "data" / "train.bin") == std::string(1000, 'x'));
  CHECK(read_file(into / "sub" / "keep.log.txt") == "kept");
  CHECK(read_file(into / "sub" / "top") == "not the top one: kept");
  CHECK(fs::is_symlink(into / "link"));
  CHECK(read_file(into / "link") == std::string(1000, 'x'));
  CHECK_FALSE(fs::exists(into / "checkpoints"));
  CHECK_FALSE(fs::exists(into / "notes.log"));

  SECTION("a change of content changes the sha256") {
    write_file(dir / "job.toml", "[job]\nname = \"x\"\n");
    CHECK(pack_dir(dir, 1 << 20).sha256 != a.sha256);
  }
  SECTION("a folder over the limit is refused, naming the limit and the fix") {
    try {
      pack_dir(dir, 500);
      FAIL("no error");
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      CHECK(m.find("upload limit of 500 B") != std::string::npos);
      CHECK(m.find(".twinkleignore") != std::string::npos);
    }
  }
}

TEST_CASE("unpacking refuses entries that lead out of the working directory", "[jobs]") {
  test::TempDir tmp;
  auto make = [&](const std::string& name, const char* link) {
    const fs::path file = tmp.path / "evil.tar";
    archive* a = archive_write_new();
    archive_write_set_format_pax_restricted(a);
    archive_write_open_filename(a, file.c_str());
    archive_entry* e = archive_entry_new();
    archive_entry_set_pathname(e, name.c_str());
    if (link) {
      archive_entry_set_filetype(e, AE_IFLNK);
      archive_entry_set_symlink(e, link);
    } else {
      archive_entry_set_filetype(e, AE_IFREG);
      archive_entry_set_size(e, 1);
    }
    archive_entry_set_perm(e, 0644);
    archive_write_header(a, e);
    if (!link) archive_write_data(a, "x", 1);
    archive_entry_free(e);
    archive_write_close(a);
    archive_write_free(a);
    return file;
  };
  const fs::path into = tmp.path / "into";
  CHECK_THROWS_WITH(unpack(make("../outside", nullptr), into),
                    Catch::Contains("\"../outside\" leads out"));
  CHECK_THROWS_WITH(unpack(make("/etc/evil", nullptr), into), Catch::Contains("leads out"));
  CHECK_THROWS_WITH(unpack(make("up", "../../etc"), into), Catch::Contains("leads out"));
  CHECK_THROWS_WITH(unpack(make("abs", "/etc/passwd"), into), Catch::Contains("leads out"));
  CHECK_FALSE(fs::exists(tmp.path / "outside"));
  // A name with dots that stays inside is fine.
  unpack(make("a..b", nullptr), into);
  CHECK(read_file(into / "a..b") == "x");
}

TEST_CASE("the supervisor keeps the driver's output, rotated, and says how it ended", "[jobs]") {
  test::TempDir tmp;
  SuperviseOptions o;
  o.job_dir = tmp.path;
  o.work_dir = tmp.path;
  o.log_cap = 16384;  // halves of 8 KiB

  SECTION("the whole output reads back as one stream until rotation drops the oldest") {
    o.argv = {"/bin/sh", "-c", "i=0; while [ $i -lt 2000 ]; do echo line $i; i=$((i+1)); done"};
    CHECK(supervise(o) == 0);
    const auto e = read_exit(tmp.path);
    REQUIRE(e);
    CHECK(e->code == 0);
    CHECK(e->retries == 0);
    std::int64_t first = 0;
    const std::string log = whole_log(tmp.path, &first);
    CHECK(first > 0);  // the oldest part was rotated away
    CHECK(log.size() <= 16384 + 200);
    CHECK(log.find("line 1999\n") != std::string::npos);
    CHECK(log.find("exited with code 0") != std::string::npos);
    // What is kept is contiguous: consecutive numbers up to the end.
    const auto a = log.find("line 1990\n"), b = log.find("line 1991\n");
    CHECK(a != std::string::npos);
    CHECK(b == a + 10);
  }
  SECTION("a failing driver runs again up to max_retries, resuming when asked") {
    o.argv = {"/bin/sh", "-c", "echo attempt $TWINKLE_JOB_ATTEMPT args $0 \"$@\"; exit 4", "sh"};
    o.max_retries = 2;
    o.resume_on_retry = true;
    CHECK(supervise(o) == 4);
    const auto e = read_exit(tmp.path);
    REQUIRE(e);
    CHECK(e->code == 4);
    CHECK(e->retries == 2);
    const std::string log = whole_log(tmp.path);
    CHECK(log.find("attempt 0 args sh\n") != std::string::npos);
    CHECK(log.find("attempt 2 args sh --set job.resume=auto\n") != std::string::npos);
    CHECK(log.find("starting it again (2 of 2 retries, resuming from its newest checkpoint)") !=
          std::string::npos);
    CHECK(read_attempt(tmp.path)->attempt == 2);
  }
  SECTION("a driver killed by a signal ends with 128 + the signal; 75, 2 and 3 are not retried") {
    o.argv = {"/bin/sh", "-c", "kill -9 $$"};
    CHECK(supervise(o) == 137);
    o.max_retries = 3;
    for (int code : {75, 2, 3}) {
      o.argv = {"/bin/sh", "-c", "exit " + std::to_string(code)};
      CHECK(supervise(o) == code);
      CHECK(read_exit(tmp.path)->retries == 0);
    }
  }
}

TEST_CASE("a process is named by its pid and start time", "[jobs]") {
  const auto self = process_start(getpid());
  CHECK(self > 0);
  CHECK(process_start(getpid()) == self);
  CHECK(process_start(0) == 0);
  CHECK(process_start(1 << 30) == 0);
}

TEST_CASE("a head removes archives no job was submitted with, once they are an hour old",
          "[jobs]") {
  test::TempDir tmp;
  const fs::path uploads = tmp.path / "uploads";
  const std::string used(64, 'a'), stale(64, 'b'), fresh(64, 'c');
  write_file(uploads / (used + ".tar"), "used");
  write_file(uploads / (stale + ".tar"), "never submitted");
  write_file(uploads / (fresh + ".tar"), "about to be submitted");
  write_file(uploads / (stale + ".0123456789abcdef.part"), "a client that died mid-upload");
  const auto two_hours_ago = fs::file_time_type::clock::now() - std::chrono::hours(2);
  for (const auto& name : {used + ".tar", stale + ".tar", stale + ".0123456789abcdef.part"})
    fs::last_write_time(uploads / name, two_hours_ago);
  {
    Store store(tmp.path / "jobs.db");
    auto j = job("digits", "alice", "SUCCEEDED");
    j.sha256 = used;
    store.add(j);
  }
  ServiceOptions o;
  o.state_dir = tmp.path;
  JobService service(o, ClusterView{});
  CHECK(fs::exists(uploads / (used + ".tar")));   // a job of the history has it
  CHECK(fs::exists(uploads / (fresh + ".tar")));  // not an hour old
  CHECK_FALSE(fs::exists(uploads / (stale + ".tar")));
  CHECK_FALSE(fs::exists(uploads / (stale + ".0123456789abcdef.part")));
}
