#include "core/jobs/service.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <fstream>
#include <random>
#include <regex>
#include <set>

extern char** environ;

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/job/digest.hpp"
#include "core/job/job.hpp"
#include "core/job/unix_time.hpp"
#include "core/jobs/archive.hpp"
#include "core/jobs/demand.hpp"
#include "core/jobs/supervisor.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::core::jobs {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::size_t kLogPiece = 1 << 20;  // bytes of log per answer
constexpr int kSummaryLines = 20;
// After a head restart, an interactive run that no agent reports within this is gone.
constexpr auto kAdoptionGrace = std::chrono::seconds(10);
// An archive no job uses, or a piece of an upload that stopped, is removed once it is this old: a
// client that died between its upload and its submit (or mid-upload) leaves nothing for good.
constexpr auto kUploadGrace = std::chrono::hours(1);
constexpr auto kSweepEvery = std::chrono::minutes(10);

bool ended(const std::string& state) { return state != "QUEUED" && state != "RUNNING"; }

// Lines of `text` that pass the filter. `rank` is "GROUP:N"; `driver` keeps the lines that are
// not a worker's ("[GROUP:N] ...").
struct LineFilter {
  std::string rank;
  bool driver = false;
  std::optional<std::regex> grep;

  bool pass(const std::string& line) const {
    if (!rank.empty() && line.rfind("[" + rank + "] ", 0) != 0) return false;
    if (driver) {
      static const std::regex worker(R"(^\[[^\] ]+:[0-9]+\] )");
      if (std::regex_search(line, worker)) return false;
    }
    return !grep || std::regex_search(line, *grep);
  }
};

// Calls `f` with each complete line of `bytes` (without its newline); returns how many bytes
// those lines took.
template <class F>
std::size_t each_line(const std::string& bytes, F&& f) {
  std::size_t used = 0;
  for (std::size_t nl; (nl = bytes.find('\n', used)) != std::string::npos; used = nl + 1)
    f(bytes.substr(used, nl - used));
  return used;
}

proto::JobEntry to_entry(const JobRecord& j) {
  proto::JobEntry e;
  e.id = j.id;
  e.name = j.name;
  e.user = j.user;
  e.kind = j.kind;
  e.state = j.state;
  e.reason = j.reason;
  e.submitted = j.submitted;
  e.started = j.started;
  e.ended = j.ended;
  e.retries = j.retries;
  e.max_retries = j.max_retries;
  e.exit_code = j.exit_code;
  e.gpus = j.gpus;
  e.cpus = j.cpus;
  e.nodes = j.nodes;
  e.gpu_seconds = j.gpu_seconds;
  e.run = j.run;
  e.from = j.from;
  e.stopped_by = j.stopped_by;
  e.job_file = j.job_file;
  if (!j.overrides.empty())
    e.overrides = nlohmann::json::parse(j.overrides).get<std::vector<std::string>>();
  if (j.after_job) e.after = proto::AfterEntry{j.after_job, j.after_condition};
  return e;
}

}  // namespace

struct JobService::State {
  ServiceOptions o;
  ClusterView cluster;
  std::unique_ptr<Store> store;
  std::map<std::string, std::int64_t> interactive;  // run -> job id
  Clock::time_point started = Clock::now();
  Clock::time_point swept = Clock::now();
  // Uploads in progress: upload_key (the sha256 and the sender) -> bytes so far.
  std::map<std::string, std::int64_t> uploading;

  void log(const std::string& line) const {
    if (o.log) o.log(line);
  }

  fs::path job_dir(std::int64_t id) const { return o.state_dir / "jobs" / std::to_string(id); }
  fs::path upload(const std::string& sha) const { return o.state_dir / "uploads" / (sha + ".tar"); }

  // ----- messages -----------------------------------------------------------------------------

  static bool hex_sha(const std::string& s) {
    return s.size() == 64 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
  }

  // An upload in progress is the sender's: two clients sending the same folder at once each
  // write their own part file.
  static std::string upload_key(const std::string& from, const std::string& sha) {
    return sha + "." + sha256_hex(from.data(), from.size()).substr(0, 16);
  }

  proto::UploadState on_check(const std::string& from, const proto::UploadCheck& c) {
    proto::UploadState st;
    if (!hex_sha(c.sha256)) {
      st.error = "not a sha256 (64 lowercase hex digits)";
      return st;
    }
    if (c.size < 0 || static_cast<std::uint64_t>(c.size) > o.max_upload) {
      st.error = fmt::format(
          "the working directory's archive ({} bytes) is over the {} bytes "
          "this head accepts",
          c.size, o.max_upload);
      return st;
    }
    std::error_code ec;
    st.have = fs::exists(upload(c.sha256), ec);
    if (st.have) {
      // Fresh again: the sweep leaves it to the submit that follows.
      fs::last_write_time(upload(c.sha256), fs::file_time_type::clock::now(), ec);
    } else {
      const std::string key = upload_key(from, c.sha256);
      fs::remove(o.state_dir / "uploads" / (key + ".part"), ec);
      uploading[key] = 0;
    }
    return st;
  }

  proto::UploadState on_part(const std::string& from, const proto::UploadPart& p) {
    proto::UploadState st;
    const std::string key = upload_key(from, p.sha256);
    auto u = uploading.find(key);
    if (u == uploading.end()) {
      st.error = "no upload of this sha256 is under way: send upload_check first";
      return st;
    }
    if (p.offset != u->second) {
      st.error = fmt::format("a piece at offset {} where {} was next", p.offset, u->second);
      st.received = u->second;
      return st;
    }
    const std::string part = (o.state_dir / "uploads" / (key + ".part")).string();
    if (u->second + static_cast<std::int64_t>(p.bytes.data.size()) >
        static_cast<std::int64_t>(o.max_upload)) {
      uploading.erase(u);
      std::error_code ec;
      fs::remove(part, ec);
      st.error = fmt::format("the upload is over the {} bytes this head accepts", o.max_upload);
      return st;
    }
    {
      std::ofstream out(part, std::ios::binary | std::ios::app);
      out.write(reinterpret_cast<const char*>(p.bytes.data.data()),
                static_cast<std::streamsize>(p.bytes.data.size()));
      if (!out) {
        st.error = fmt::format("the head cannot write {}: is its disk full?", part);
        return st;
      }
    }
    u->second += static_cast<std::int64_t>(p.bytes.data.size());
    st.received = u->second;
    if (p.last) {
      uploading.erase(u);
      const std::string got = sha256_file(part);
      std::error_code ec;
      if (got != p.sha256) {
        fs::remove(part, ec);
        st.error = fmt::format(
            "the upload's sha256 is {}, not {}: damaged on the way; submit "
            "again",
            got, p.sha256);
        return st;
      }
      fs::rename(part, upload(p.sha256), ec);
      st.have = true;
    }
    return st;
  }

  proto::JobAnswer on_submit(const Caller& who, proto::Submit& s) {
    proto::JobAnswer a;
    const std::string user = who.user.empty() ? s.user : who.user;
    std::error_code ec;
    if (!hex_sha(s.sha256) || !fs::exists(upload(s.sha256), ec)) {
      a.error = "the head does not hold this working directory: upload it first";
      return a;
    }
    const fs::path rel = fs::path(s.job_file).lexically_normal();
    if (rel.empty() || rel.is_absolute() || *rel.begin() == "..") {
      a.error = fmt::format("the job file \"{}\" is not inside its working directory", s.job_file);
      return a;
    }
    if (s.max_retries < 0 || s.max_retries > 100) {
      a.error = fmt::format("--max-retries {}: give 0 to 100", s.max_retries);
      return a;
    }
    if (s.after) {
      const auto dep = store->get(s.after->job);
      if (!dep) {
        a.error = fmt::format("--after {}: no such job in this cluster's history", s.after->job);
        return a;
      }
      if (s.after->condition != "ok" && s.after->condition != "notok" &&
          s.after->condition != "any") {
        a.error = fmt::format("--after {}:{}: the condition is ok, notok or any", s.after->job,
                              s.after->condition);
        return a;
      }
    }
    // Unpacked into a folder of its own, checked, and only then queued.
    const fs::path incoming =
        o.state_dir / "jobs" / fmt::format(".incoming-{}", std::random_device{}());
    JobRecord j;
    try {
      unpack(upload(s.sha256), incoming / "work");
      std::vector<Override> overrides;
      for (const auto& x : s.overrides) overrides.push_back(parse_override(x));
      overrides.push_back(Override{"job.mode", "remote"});
      const Job job = load_job(incoming / "work" / rel, overrides);
      j.name = s.name.empty() ? job.name : s.name;
      j.demand = nlohmann::json::array().dump();
      nlohmann::json demand = nlohmann::json::array();
      for (const auto& g : group_demands(job)) {
        demand.push_back({{"name", g.name},
                          {"workers", g.workers},
                          {"gpus_per_worker", g.gpus_per_worker},
                          {"strategy", g.strategy},
                          {"labels", g.labels}});
        j.gpus += g.workers * g.gpus_per_worker;
        j.cpus += g.workers;
      }
      j.demand = demand.dump();
      j.resume_on_retry = !job.checkpoint_dir.empty();
      j.stop_grace_s = job.stop_grace_s;
    } catch (const std::exception& e) {
      fs::remove_all(incoming, ec);
      std::string what = e.what();
      // Name the file as the submitter knows it, not the head's copy.
      const std::string copy = (incoming / "work").string() + "/";
      for (auto at = what.find(copy); at != std::string::npos; at = what.find(copy))
        what.erase(at, copy.size());
      a.error = what;
      return a;
    }
    j.user = user;
    j.kind = "submitted";
    j.state = "QUEUED";
    j.reason = "waiting for its turn";
    j.submitted = unix_now();
    j.max_retries = s.max_retries;
    j.from = s.from;
    j.job_file = rel.string();
    j.sha256 = s.sha256;
    j.overrides = nlohmann::json(s.overrides).dump();
    if (s.after) {
      j.after_job = s.after->job;
      j.after_condition = s.after->condition;
    }
    j.id = store->add(j);
    fs::rename(incoming, job_dir(j.id), ec);
    if (ec) {
      j.state = "FAILED";
      j.reason =
          fmt::format("the head cannot move its working directory into place: {}", ec.message());
      j.ended = unix_now();
      store->update(j);
    }
    store->audit(
        AuditRecord{j.id, unix_now(), user, "submit", s.from,
                    fmt::format("{} ({}, sha256 {})", j.name, j.job_file, s.sha256.substr(0, 12))});
    log(fmt::format("job {} ({}) submitted by {} from {}", j.id, j.name, user, s.from));
    a.job = j.id;
    a.text = fmt::format("submitted job {} ({})", j.id, j.name);
    return a;
  }

  std::vector<std::string> summary(std::int64_t id) const {
    const fs::path dir = job_dir(id);
    std::int64_t end = read_log(dir, 0, 0).end;
    const auto piece = read_log(dir, std::max<std::int64_t>(0, end - 16384), 16384);
    std::deque<std::string> lines;
    auto keep = [&](std::string line) {
      lines.push_back(std::move(line));
      if (lines.size() > kSummaryLines) lines.pop_front();
    };
    const std::size_t used = each_line(piece.bytes, keep);
    if (used < piece.bytes.size()) keep(piece.bytes.substr(used));  // the last, unfinished one
    return {lines.begin(), lines.end()};
  }

  proto::JobsInfo on_query(const Caller& who, const proto::JobsQuery& q) {
    proto::JobsInfo info;
    if (q.job) {
      const auto j = store->get(*q.job);
      if (!j) {
        info.error = fmt::format(
            "no job {} in this cluster's history (`twinkle jobs --all` "
            "lists them)",
            *q.job);
        return info;
      }
      proto::JobEntry e = to_entry(*j);
      if (!j->placement.empty()) {
        for (const auto& p : nlohmann::json::parse(j->placement)) {
          e.placement.push_back(proto::RankPlace{p["group"], p["rank"], p["node"],
                                                 p["gpus"].get<std::vector<int>>()});
        }
      }
      e.summary = summary(j->id);
      if (j->kind == "submitted") {
        std::ifstream in(job_dir(j->id) / "work" / j->job_file);
        if (in) e.job_text = std::string(std::istreambuf_iterator<char>(in), {});
        // The archive's name lets a submit use it: only its owner (or an admin) learns it.
        std::error_code ec;
        if ((who.admin || (!who.user.empty() && who.user == j->user)) && !j->sha256.empty() &&
            fs::exists(upload(j->sha256), ec))
          e.sha256 = j->sha256;
      }
      for (const auto& a : store->audit_of(j->id))
        e.audit.push_back(proto::AuditEntry{a.time, a.user, a.action, a.from, a.detail});
      info.jobs.push_back(std::move(e));
      return info;
    }
    JobFilter f;
    f.all = q.all;
    f.user = q.user;
    f.state = q.state;
    for (const auto& j : store->list(f)) info.jobs.push_back(to_entry(j));
    return info;
  }

  proto::LogsChunk on_logs(const proto::LogsQuery& q) {
    proto::LogsChunk c;
    const auto j = store->get(q.job);
    if (!j) {
      c.error = fmt::format("no job {} in this cluster's history", q.job);
      return c;
    }
    if (j->kind == "interactive") {
      c.error = fmt::format(
          "job {} is an interactive run (`twinkle run --address`): its log is "
          "in the terminal that started it",
          q.job);
      return c;
    }
    LineFilter f;
    f.rank = q.rank;
    f.driver = q.driver;
    if (!q.grep.empty()) {
      try {
        f.grep.emplace(q.grep, std::regex::ECMAScript);
      } catch (const std::regex_error& e) {
        c.error = fmt::format("--grep \"{}\": not a regular expression ({})", q.grep, e.what());
        return c;
      }
    }
    const bool done = ended(j->state);
    const fs::path dir = job_dir(q.job);
    if (q.tail > 0 && q.offset == 0) {
      // The last N matching lines of all of it.
      std::deque<std::string> keep;
      std::int64_t at = 0, end = 0;
      for (;;) {
        auto piece = read_log(dir, at, kLogPiece);
        end = piece.end;
        if (piece.bytes.empty()) break;
        std::size_t used = each_line(piece.bytes, [&](std::string line) {
          if (!f.pass(line)) return;
          keep.push_back(std::move(line));
          if (keep.size() > static_cast<std::size_t>(q.tail)) keep.pop_front();
        });
        if (used == 0) used = piece.bytes.size();  // a line longer than a piece
        at = piece.offset + static_cast<std::int64_t>(used);
      }
      for (const auto& l : keep) c.text += l + "\n";
      c.offset = at;
      c.ended = done && at >= end;
      return c;
    }
    auto piece = read_log(dir, q.offset, kLogPiece);
    std::size_t used = each_line(piece.bytes, [&](const std::string& line) {
      if (f.pass(line)) c.text += line + "\n";
    });
    // A last line without its newline waits for the rest, unless nothing more will come.
    if (used < piece.bytes.size() && (done || piece.bytes.size() >= kLogPiece)) {
      std::string line = piece.bytes.substr(used);
      if (f.pass(line)) c.text += line + "\n";
      used = piece.bytes.size();
    }
    c.offset = piece.offset + static_cast<std::int64_t>(used);
    c.more = c.offset < piece.end && used > 0;
    c.ended = done && c.offset >= piece.end;
    return c;
  }

  proto::JobAnswer on_stop(const Caller& who, const proto::JobStop& s) {
    proto::JobAnswer a;
    a.job = s.job;
    const std::string user = who.user.empty() ? s.user : who.user;
    auto j = store->get(s.job);
    if (!j) {
      a.error = fmt::format("no job {} in this cluster's history", s.job);
      return a;
    }
    if (j->user != user && !who.admin) {
      a.error = fmt::format(
          "job {} is {}'s; you ({}) may stop only your own jobs (an admin, "
          "marked `admin` in the head's allow-list, may stop any)",
          s.job, j->user, user);
      store->audit(AuditRecord{j->id, unix_now(), user, "stop refused", s.from, "not the owner"});
      return a;
    }
    if (ended(j->state)) {
      a.error = fmt::format("job {} has already ended ({})", s.job, j->state);
      return a;
    }
    store->audit(AuditRecord{j->id, unix_now(), user, s.now ? "stop --now" : "stop", s.from, ""});
    j->stopped_by = user;
    if (j->state == "QUEUED") {
      finish(*j, "STOPPED", fmt::format("stopped by {} before it started", user));
      a.text = fmt::format("job {} stopped (it had not started)", s.job);
      return a;
    }
    if (j->kind == "interactive") {
      const std::string run = j->run;
      finish(*j, "STOPPED",
             fmt::format("stopped by {}: its workers were stopped and its devices freed", user));
      interactive.erase(run);
      if (!run.empty()) cluster.release_run(run);
      a.text = fmt::format(
          "job {} stopped: its workers are stopped (the driver in its terminal "
          "fails)",
          s.job);
      return a;
    }
    j->stop_requested = unix_now();
    store->update(*j);
    if (supervisor_alive(*j)) ::kill(j->supervisor_pid, s.now ? SIGUSR2 : SIGTERM);
    if (s.now && !j->run.empty()) cluster.release_run(j->run);
    log(fmt::format("job {} stop{} requested by {}", j->id, s.now ? " --now" : "", user));
    a.text = s.now ? fmt::format("job {}: killed its driver and its workers", s.job)
                   : fmt::format(
                         "job {}: asked its driver to stop (SIGTERM; with a "
                         "checkpoint_dir it checkpoints first); it is killed if it has "
                         "not ended {:g} s from now",
                         s.job, j->stop_grace_s + 30);
    return a;
  }

  // ----- the queue and the drivers ----------------------------------------------------------

  static bool supervisor_alive(const JobRecord& j) {
    return j.supervisor_pid > 0 && process_start(j.supervisor_pid) == j.supervisor_start;
  }

  void finish(JobRecord& j, const std::string& state, const std::string& reason) {
    j.state = state;
    j.reason = reason;
    j.ended = unix_now();
    if (j.started)
      j.gpu_seconds = static_cast<double>(j.gpus) * static_cast<double>(j.ended - j.started);
    store->update(j);
    cluster.unhold(j.id);
    log(fmt::format("job {} ({}) {}: {}", j.id, j.name, state, reason));
    for (const auto& [id, sha] : store->prune(o.keep_jobs)) {
      std::error_code ec;
      fs::remove_all(job_dir(id), ec);
      // The working directory's archive goes with the last job that used it.
      if (!sha.empty() && !store->uses(sha)) fs::remove(upload(sha), ec);
    }
  }

  // Removes the archives no job uses and the pieces of stopped uploads, once kUploadGrace old.
  void sweep_uploads() {
    std::error_code ec;
    const auto now = fs::file_time_type::clock::now();
    for (const auto& e : fs::directory_iterator(o.state_dir / "uploads", ec)) {
      std::error_code age_ec;
      const auto written = e.last_write_time(age_ec);
      if (age_ec || now - written < kUploadGrace) continue;
      const std::string stem = e.path().stem().string();
      std::error_code rm;
      if (e.path().extension() == ".part") {
        uploading.erase(stem);
        fs::remove(e.path(), rm);
      } else if (e.path().extension() == ".tar" && !store->uses(stem)) {
        fs::remove(e.path(), rm);
        log(fmt::format("removed {}: no job was submitted with it", e.path().string()));
      }
    }
  }

  // A running submitted job: its supervisor's files say how it goes.
  void watch(JobRecord& j) {
    const fs::path dir = job_dir(j.id);
    auto exit = read_exit(dir);
    if (!exit && !supervisor_alive(j)) {
      exit = read_exit(dir);  // written just before it exited
      if (!exit) {
        finish(j, "FAILED",
               fmt::format("its supervisor (pid {}) ended without a word; the last lines are in "
                           "`twinkle logs {}`",
                           j.supervisor_pid, j.id));
        return;
      }
    }
    if (!exit) {
      if (auto at = read_attempt(dir); at && at->attempt != j.retries) {
        j.retries = at->attempt;
        store->update(j);
        store->audit(
            AuditRecord{j.id, unix_now(), "head", "retry", "",
                        fmt::format("attempt {} of {}", at->attempt + 1, j.max_retries + 1)});
      }
      return;
    }
    j.retries = exit->retries;
    j.exit_code = exit->code;
    if (exit->code == 0) {
      finish(j, "SUCCEEDED", "its driver exited with code 0");
    } else if (j.stop_requested || exit->code == 75) {
      finish(j, "STOPPED",
             fmt::format("{} (driver exit code {}{})",
                         j.stopped_by.empty() ? "stopped on request" : "stopped by " + j.stopped_by,
                         exit->code, exit->code == 75 ? ", after its checkpoint" : ""));
    } else {
      finish(j, "FAILED",
             fmt::format("its driver exited with code {}{}", exit->code,
                         j.retries ? fmt::format(" after {} retr{}", j.retries,
                                                 j.retries == 1 ? "y" : "ies")
                                   : ""));
    }
  }

  // Starts the supervisor of `j`, detached: its own session, not this process's child.
  void start(JobRecord& j) {
    const fs::path dir = job_dir(j.id);
    std::vector<std::string> argv = {o.exe.string(),  "supervise",
                                     "--job-dir",     dir.string(),
                                     "--work-dir",    (dir / "work").string(),
                                     "--max-retries", std::to_string(j.max_retries),
                                     "--log-cap",     std::to_string(o.log_cap),
                                     "--stop-grace",  fmt::format("{}", j.stop_grace_s)};
    if (j.resume_on_retry) argv.push_back("--resume-on-retry");
    // The job file by its full path: the driver's command line names the job's folder.
    argv.insert(argv.end(), {"--", o.exe.string(), "run", (dir / "work" / j.job_file).string(),
                             "--address", o.head_address, "--set", "job.mode=remote"});
    for (const auto& x : nlohmann::json::parse(j.overrides)) {
      argv.push_back("--set");
      argv.push_back(x.get<std::string>());
    }
    if (!o.key_file.empty()) {
      argv.insert(argv.end(), {"--key", o.key_file, "--head-key", o.head_public});
    }
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    // The environment is made here: between fork and exec only async-signal-safe calls.
    std::vector<std::string> env_text = {fmt::format("TWINKLE_JOB_ID={}", j.id),
                                         "TWINKLE_JOB_USER=" + j.user,
                                         "TWINKLE_JOB_NAME=" + j.name};
    for (char** e = environ; *e; ++e) {
      const std::string_view v(*e);
      if (v.rfind("TWINKLE_JOB_", 0) == 0 || v.rfind("TWINKLE_ADDRESS=", 0) == 0) continue;
      env_text.emplace_back(v);
    }
    std::vector<char*> envp;
    for (auto& e : env_text) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::error_code ec;
    fs::remove(dir / "exit", ec);
    fs::remove(dir / "attempt", ec);
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) throw Error("cannot create a pipe to start a job");
    Fd from(fds[0]);
    Fd to(fds[1]);
    const pid_t child = fork();
    if (child < 0) throw Error("cannot fork to start a job");
    if (child == 0) {
      setsid();
      const pid_t grandchild = fork();
      if (grandchild == 0) {
        const int null = ::open("/dev/null", O_RDWR);
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
        execve(args[0], args.data(), envp.data());
        _exit(127);
      }
      (void)!::write(to.get(), &grandchild, sizeof grandchild);
      _exit(0);
    }
    to.reset();
    pid_t pid = -1;
    (void)!::read(from.get(), &pid, sizeof pid);
    waitpid(child, nullptr, 0);
    if (pid <= 0) throw Error("cannot start a job's supervisor");
    j.supervisor_pid = pid;
    j.supervisor_start = process_start(pid);
    j.state = "RUNNING";
    j.reason = "";
    j.started = unix_now();
    store->update(j);
    log(fmt::format("job {} ({}) of {} started: supervisor pid {}", j.id, j.name, j.user, pid));
  }

  void schedule_queue() {
    bool blocked =
        false;  // an earlier job waits for devices: the queue is first come, first served
    std::int64_t first_waiting = 0;
    for (auto& j : store->in_state("QUEUED")) {
      std::string reason;
      if (j.after_job) {
        const auto dep = store->get(j.after_job);
        if (!dep) {
          finish(j, "DROPPED",
                 fmt::format("job {}, which it runs after, is gone from the history", j.after_job));
          continue;
        }
        const std::string& st = dep->state;
        if (!ended(st)) {
          reason = fmt::format("waiting for job {} to end (--after {}:{})", j.after_job,
                               j.after_job, j.after_condition);
        } else {
          const bool ok = st == "SUCCEEDED";
          const bool satisfied =
              j.after_condition == "any" || (j.after_condition == "ok" ? ok : !ok);
          if (!satisfied) {
            finish(j, "DROPPED",
                   fmt::format("job {} ended {}, and this job runs only after it {} (--after "
                               "{}:{})",
                               j.after_job, st,
                               j.after_condition == "ok" ? "succeeds" : "fails or is stopped",
                               j.after_job, j.after_condition));
            continue;
          }
        }
      }
      if (reason.empty() && blocked) {
        reason = fmt::format("waiting behind job {} (first come, first served)", first_waiting);
      }
      if (reason.empty()) {
        std::vector<proto::GroupDemandEntry> demand;
        for (const auto& g : nlohmann::json::parse(j.demand)) {
          demand.push_back(
              proto::GroupDemandEntry{g["name"], g["workers"], g["gpus_per_worker"], g["strategy"],
                                      g["labels"].get<std::map<std::string, std::string>>()});
        }
        if (auto why = cluster.hold(j.id, demand)) {
          reason = "waiting for devices: " + *why;
          blocked = true;
          first_waiting = j.id;
        } else {
          try {
            start(j);
          } catch (const std::exception& e) {
            finish(j, "FAILED", e.what());
          }
          continue;
        }
      }
      if (reason != j.reason) {
        j.reason = reason;
        store->update(j);
      }
    }
  }
};

JobService::JobService(ServiceOptions options, ClusterView cluster)
    : s_(std::make_unique<State>()) {
  s_->o = std::move(options);
  s_->cluster = std::move(cluster);
  std::error_code ec;
  for (const char* sub : {"uploads", "jobs"}) fs::create_directories(s_->o.state_dir / sub, ec);
  if (ec) {
    throw Error(fmt::format("--state-dir {}: cannot create it: {}", s_->o.state_dir.string(),
                            ec.message()));
  }
  fs::permissions(s_->o.state_dir, fs::perms::owner_all, ec);
  s_->store = std::make_unique<Store>(s_->o.state_dir / "jobs.db");
  // Leftovers of a head killed mid-submit.
  for (const auto& e : fs::directory_iterator(s_->o.state_dir / "jobs", ec)) {
    if (e.path().filename().string().rfind(".incoming-", 0) == 0) fs::remove_all(e.path(), ec);
  }
  for (const auto& e : fs::directory_iterator(s_->o.state_dir / "uploads", ec)) {
    if (e.path().extension() == ".part") fs::remove(e.path(), ec);
  }
  s_->sweep_uploads();
  int running = 0;
  for (auto& j : s_->store->in_state("RUNNING")) {
    ++running;
    if (j.kind == "interactive") s_->interactive[j.run] = j.id;
  }
  s_->log(fmt::format("job history {} ({} jobs, {} running)",
                      (s_->o.state_dir / "jobs.db").string(), s_->store->count(), running));
}

JobService::~JobService() = default;

Message JobService::handle(const Caller& caller, std::uint64_t request, Message& m) {
  State& s = *s_;
  return std::visit(
      [&](auto& b) -> Message {
        using T = std::decay_t<decltype(b)>;
        try {
          if constexpr (std::is_same_v<T, proto::UploadCheck>) {
            return Message{request, s.on_check(caller.identity, b)};
          } else if constexpr (std::is_same_v<T, proto::UploadPart>) {
            return Message{request, s.on_part(caller.identity, b)};
          } else if constexpr (std::is_same_v<T, proto::Submit>) {
            Message answer{request, s.on_submit(caller, b)};
            s.schedule_queue();  // a job that fits starts now, not at the next tick
            return answer;
          } else if constexpr (std::is_same_v<T, proto::JobsQuery>) {
            return Message{request, s.on_query(caller, b)};
          } else if constexpr (std::is_same_v<T, proto::LogsQuery>) {
            return Message{request, s.on_logs(b)};
          } else if constexpr (std::is_same_v<T, proto::JobStop>) {
            return Message{request, s.on_stop(caller, b)};
          } else {
            proto::JobAnswer a;
            a.error = fmt::format("a {} message is not for the job service",
                                  transport::to_string(T::kType));
            return Message{request, a};
          }
        } catch (const std::exception& e) {
          // The head's disk or history failed: the client hears why, the head goes on.
          s.log(fmt::format("job service: {}", e.what()));
          proto::JobAnswer a;
          a.error = fmt::format("the head could not do it: {}", e.what());
          if constexpr (std::is_same_v<T, proto::UploadCheck> ||
                        std::is_same_v<T, proto::UploadPart>) {
            proto::UploadState st;
            st.error = a.error;
            return Message{request, st};
          } else if constexpr (std::is_same_v<T, proto::JobsQuery>) {
            proto::JobsInfo i;
            i.error = a.error;
            return Message{request, i};
          } else if constexpr (std::is_same_v<T, proto::LogsQuery>) {
            proto::LogsChunk c;
            c.error = a.error;
            return Message{request, c};
          }
          return Message{request, a};
        }
      },
      m.body);
}

void JobService::tick() {
  State& s = *s_;
  try {
    for (auto& j : s.store->in_state("RUNNING")) {
      if (j.kind == "submitted") {
        if (s.cluster.hold_driver) s.cluster.hold_driver(j.id);  // again after a head restart
        s.watch(j);
      } else if (Clock::now() - s.started > kAdoptionGrace && !s.cluster.run_known(j.run)) {
        s.interactive.erase(j.run);
        s.finish(j, "ENDED", "its run was gone when the head came back");
      }
    }
    s.schedule_queue();
    if (Clock::now() - s.swept >= kSweepEvery) {
      s.swept = Clock::now();
      s.sweep_uploads();
    }
  } catch (const std::exception& e) {
    s.log(fmt::format("job service: {}", e.what()));
  }
}

void JobService::reserved(const std::string& run, std::optional<std::int64_t> job_id,
                          const std::string& name, const std::string& user,
                          const std::vector<proto::RankPlace>& placement, int gpus, int cpus,
                          int nodes) {
  State& s = *s_;
  try {
    nlohmann::json places = nlohmann::json::array();
    for (const auto& p : placement) {
      places.push_back({{"group", p.group}, {"rank", p.rank}, {"node", p.node}, {"gpus", p.gpus}});
    }
    std::optional<JobRecord> j;
    if (job_id) j = s.store->get(*job_id);
    // A submitted job's driver: the head gave it what was held for it (its driver's CPU stays
    // held until the job ends).
    if (!j || j->kind != "submitted") {
      if (s.interactive.count(run)) return;
      JobRecord r;
      r.name = name;
      r.user = user;
      r.kind = "interactive";
      r.state = "RUNNING";
      r.submitted = r.started = unix_now();
      r.overrides = "[]";
      r.demand = "[]";
      r.id = s.store->add(r);
      s.interactive[run] = r.id;
      j = r;
    }
    j->run = run;
    j->placement = places.dump();
    j->gpus = gpus;
    j->cpus = cpus;
    j->nodes = nodes;
    s.store->update(*j);
  } catch (const std::exception& e) {
    s.log(fmt::format("job service: {}", e.what()));
  }
}

void JobService::released(const std::string& run, bool lapsed,
                          const std::optional<std::string>& outcome) {
  State& s = *s_;
  auto it = s.interactive.find(run);
  if (it == s.interactive.end()) return;
  try {
    if (auto j = s.store->get(it->second); j && !ended(j->state)) {
      if (lapsed) {
        s.finish(*j, "FAILED", "its driver stopped renewing its lease (killed, or cut off)");
      } else if (outcome == "succeeded") {
        s.finish(*j, "SUCCEEDED", "its driver (in its terminal) ended it: succeeded");
      } else if (outcome == "failed") {
        s.finish(*j, "FAILED", "its driver (in its terminal) ended it: failed");
      } else if (outcome == "stopped") {
        s.finish(*j, "STOPPED", "its driver (in its terminal) was stopped or interrupted");
      } else {
        s.finish(*j, "ENDED", "its driver released its devices without saying how it ended");
      }
    }
  } catch (const std::exception& e) {
    s.log(fmt::format("job service: {}", e.what()));
  }
  s.interactive.erase(it);
}

}  // namespace twinkle::core::jobs
