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

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/job/digest.hpp"
#include "core/job/job.hpp"
#include "core/job/unix_time.hpp"
#include "core/jobs/archive.hpp"
#include "core/jobs/demand.hpp"
#include "core/jobs/supervisor.hpp"
#include "transports/zmq/curve.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::core::jobs {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::size_t kLogPiece = 1 << 20;       // bytes of log per answer
constexpr std::int64_t kArchivePiece = 4 << 20;  // bytes of a working directory per archive_part
constexpr int kSummaryLines = 20;
// After a head restart, an interactive run that no agent reports within this is gone.
constexpr auto kAdoptionGrace = std::chrono::seconds(10);
// A driver on a node whose agent says nothing of it for this long (it reports every 0.5 s) is
// taken for lost.
constexpr auto kDriverSilence = std::chrono::seconds(20);
// An archive no job uses, or a piece of an upload that stopped, is removed once it is this old: a
// client that died between its upload and its submit (or mid-upload) leaves nothing for good.
constexpr auto kUploadGrace = std::chrono::hours(1);
constexpr auto kSweepEvery = std::chrono::minutes(10);

bool ended(const std::string& state) {
  return state != "QUEUED" && state != "RUNNING" && state != "PREEMPTED";
}
// How far back a restarted head reads the history for the teams' shares: use older than ten
// half-lives counts for less than a thousandth.
constexpr double kShareMemory = 10;

std::vector<proto::GroupDemandEntry> demand_of(const JobRecord& j) {
  std::vector<proto::GroupDemandEntry> demand;
  for (const auto& g : nlohmann::json::parse(j.demand)) {
    demand.push_back(proto::GroupDemandEntry{
        g["name"], g["workers"], g["gpus_per_worker"], g["strategy"],
        g["labels"].get<std::map<std::string, std::string>>(), g.value("memory", std::int64_t{0})});
  }
  return demand;
}

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
  e.team = j.team;
  e.priority = j.priority;
  e.preemptible = j.preemptible;
  e.preemptions = j.preemptions;
  e.preempted_by = j.preempted_by;
  e.restarts = j.restarts;
  e.driver_node = j.driver_node;
  return e;
}

Labels labels_of(const JobRecord& j) {
  return nlohmann::json::parse(j.driver_labels).get<Labels>();
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
  ShareMeter shares;
  std::map<std::int64_t, std::string> driver_keys;  // job -> its driver's admitted public key
  // Drivers on nodes: the signal each one's supervisor is to get with the next driver_ack
  // (SIGTERM, SIGUSR2), and when the agent last said how each goes.
  std::map<std::int64_t, int> driver_signals;
  std::map<std::int64_t, Clock::time_point> driver_heard;  // its node's agent's last word

  std::optional<JobRecord> job_of_run(const std::string& run) const;

  void log(const std::string& line) const {
    if (o.log) o.log(line);
  }

  fs::path job_dir(std::int64_t id) const { return o.state_dir / "jobs" / std::to_string(id); }

  // The state folder is the head's alone. With --run-as, each account must reach its jobs'
  // folders: the state folder and jobs/ may be passed (mode 0711) but not listed, and what is in
  // them is private.
  void private_state() {
    const fs::path& d = o.state_dir;
    std::error_code ec;
    if (!o.run_as.enabled()) {
      fs::permissions(d, fs::perms::owner_all, ec);
      return;
    }
    if (auto closed = closed_to_others(fs::absolute(d).parent_path())) {
      throw ConfigError(fmt::format(
          "--run-as: the members' accounts cannot reach their jobs' folders in --state-dir {}: "
          "{} is closed to others; give a --state-dir they can pass through (e.g. "
          "/var/lib/twinkle)",
          d.string(), closed->string()));
    }
    const auto pass = fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec;
    fs::permissions(d, pass, ec);
    fs::permissions(d / "jobs", pass, ec);
    fs::permissions(d / "uploads", fs::perms::owner_all, ec);
    for (const char* f : {"jobs.db", "jobs.db-wal", "jobs.db-shm", "jobs.db-journal"})
      if (fs::exists(d / f, ec))
        fs::permissions(d / f, fs::perms::owner_read | fs::perms::owner_write, ec);
  }
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
    if (o.run_as.enabled()) {
      try {
        o.run_as.account_for(user);
      } catch (const Error& e) {
        a.error = fmt::format("{} (the head runs each member's jobs as its account)", e.what());
        return a;
      }
    }
    const TeamQuota quota = o.quotas.of(who.team);
    if (s.priority < -quota.max_priority || s.priority > quota.max_priority) {
      a.error = fmt::format("--priority {}: team {} may give -{} to {} (max_priority{})",
                            s.priority, quota.name, quota.max_priority, quota.max_priority,
                            o.quotas.file.empty() ? "; no quotas file sets another"
                                                  : " in " + o.quotas.file.string());
      return a;
    }
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
      // Nobody else's to read, from the first byte (the state folder may be passed through).
      fs::create_directories(incoming);
      fs::permissions(incoming, fs::perms::owner_all);
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
                          {"labels", g.labels},
                          {"memory", g.memory}});
        j.gpus += g.workers * g.gpus_per_worker;
        j.cpus += g.workers;
      }
      j.demand = demand.dump();
      j.resume_on_retry = !job.checkpoint_dir.empty();
      j.stop_grace_s = job.stop_grace_s;
      j.preemptible = job.preemptible;
      j.driver_labels = nlohmann::json(job.driver_labels).dump();
      if (auto why = never_fits(quota, Resources{j.gpus, j.cpus}, j.preemptible, o.quotas.file))
        throw ConfigError(*why);
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
    j.team = who.team;
    j.priority = s.priority;
    j.kind = "submitted";
    j.state = "QUEUED";
    j.reason = "waiting for its turn";
    j.submitted = unix_now();
    j.max_retries = s.max_retries;
    j.retry_budget = s.max_retries;
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
    log(fmt::format("job {} ({}) submitted by {} (team {}) from {}", j.id, j.name, user, j.team,
                    s.from));
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

  // `twinkle resume`: a STOPPED or FAILED job of the caller's (any, for an admin) back in the
  // queue; its driver starts with job.resume=auto in the job's own folder, so it continues
  // from its newest checkpoint there (or in its absolute checkpoint_dir).
  proto::JobAnswer on_resume(const Caller& who, const proto::JobResume& r) {
    proto::JobAnswer a;
    a.job = r.job;
    const std::string user = who.user.empty() ? r.user : who.user;
    auto j = store->get(r.job);
    if (!j) {
      a.error = fmt::format("no job {} in this cluster's history", r.job);
      return a;
    }
    if (j->user != user && !who.admin) {
      a.error = fmt::format(
          "job {} is {}'s; you ({}) may resume only your own jobs (an admin may resume any)", r.job,
          j->user, user);
      store->audit(AuditRecord{j->id, unix_now(), user, "resume refused", r.from, "not the owner"});
      return a;
    }
    if (j->kind != "submitted") {
      a.error = fmt::format(
          "job {} is an interactive run (twinkle run --address): run it again with "
          "`twinkle run --resume` where it ran",
          r.job);
      return a;
    }
    if (j->state != "STOPPED" && j->state != "FAILED") {
      a.error = fmt::format("job {} is {}: only a STOPPED or FAILED job resumes", r.job, j->state);
      return a;
    }
    if (!j->resume_on_retry) {
      a.error = fmt::format(
          "job {} has no checkpoint_dir, so it has nothing to resume from; submit it again to "
          "start over",
          r.job);
      return a;
    }
    std::error_code ec;
    if (!fs::exists(job_dir(j->id) / "work" / j->job_file, ec)) {
      a.error = fmt::format("the head no longer holds job {}'s working directory", r.job);
      return a;
    }
    const std::string was = j->state;
    j->state = "QUEUED";
    j->reason = fmt::format("resumed by {}: waiting for its turn", user);
    j->ended = 0;
    j->exit_code.reset();
    j->stop_requested = 0;
    j->stopped_by = "";
    // Its --max-retries count afresh.
    j->max_retries = j->retries + j->retry_budget;
    j->retry_base = j->retries;
    store->update(*j);
    store->audit(AuditRecord{j->id, unix_now(), user, "resume", r.from, "it was " + was});
    log(fmt::format("job {} ({}) resumed by {} (it was {})", j->id, j->name, user, was));
    a.text = fmt::format(
        "job {} is queued again; its driver resumes from its newest checkpoint (`twinkle logs {} "
        "-f` follows it)",
        r.job, r.job);
    return a;
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
    if (j->state == "PREEMPTED") {
      finish(*j, "STOPPED", fmt::format("stopped by {} while it waited to resume", user));
      a.text = fmt::format("job {} stopped (it was preempted and waited to resume)", s.job);
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
    signal_driver(*j, s.now ? SIGUSR2 : SIGTERM);
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

  // Sends `sig` to the supervisor of `j`'s driver: here, or with the next driver_ack to the
  // agent of its node (SIGUSR2, kill now, outranks SIGTERM).
  void signal_driver(const JobRecord& j, int sig) {
    if (!j.driver_node.empty()) {
      int& pending = driver_signals[j.id];
      if (pending != SIGUSR2) pending = sig;
    } else if (supervisor_alive(j)) {
      ::kill(j.supervisor_pid, sig);
    }
  }

  // Adds the GPU-seconds of `j`'s latest start until `until` (a preempted job runs more than once).
  static void count_span(JobRecord& j, std::int64_t until) {
    if (j.started)
      j.gpu_seconds += static_cast<double>(j.gpus) * static_cast<double>(until - j.started);
  }

  void finish(JobRecord& j, const std::string& state, const std::string& reason) {
    j.state = state;
    j.reason = reason;
    j.ended = unix_now();
    count_span(j, j.ended);
    store->update(j);
    cluster.unhold(j.id);
    forget_driver(j.id);
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
    if (!exit && !j.driver_node.empty()) {
      // On a node: its agent writes what the supervisor's files say (driver_status). A node
      // that is not live (declared DEAD, or not back within the grace after a head restart)
      // took the driver with it.
      if (cluster.node_alive && !cluster.node_alive(j.driver_node) &&
          Clock::now() - started > kAdoptionGrace) {
        return driver_lost(j, fmt::format("the node {} of its driver was lost", j.driver_node));
      }
      // A live node whose agent says nothing of the driver (it never got driver_start, a head
      // restart between them) does not hold the job for ever.
      auto heard = driver_heard.find(j.id);
      const auto last = heard == driver_heard.end() ? started : std::max(started, heard->second);
      if (Clock::now() - last > kDriverSilence) {
        return driver_lost(
            j, fmt::format("the agent of node {} has said nothing of its driver for {} s",
                           j.driver_node, kDriverSilence.count()));
      }
    } else if (!exit && !supervisor_alive(j)) {
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
      if (auto at = read_attempt(dir); at && j.retry_base + at->attempt != j.retries) {
        j.retries = j.retry_base + at->attempt;
        store->update(j);
        store->audit(
            AuditRecord{j.id, unix_now(), "head", "retry", "",
                        fmt::format("attempt {} of {}", at->attempt + 1, j.max_retries + 1)});
      }
      return;
    }
    j.retries = j.retry_base + exit->retries;
    j.exit_code = exit->code;
    if (exit->code != 0 && j.preempted_by && j.stop_requested && j.stopped_by.empty()) {
      requeue(j, exit->code);
    } else if (exit->code == 0) {
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

  // A preempted job's driver ended (after its checkpoint, exit 75): back in the queue, to resume
  // when capacity returns.
  void requeue(JobRecord& j, int code) {
    const auto now = unix_now();
    count_span(j, now);  // `started` is the next start's: a waiting job runs no clock
    j.started = 0;
    ++j.preemptions;
    j.state = "PREEMPTED";
    j.retry_base = j.retries;
    j.stop_requested = 0;
    j.reason = preempted_note(j) + fmt::format(" (its driver exited {}{})", code,
                                               code == 75 ? " after its checkpoint" : "");
    store->update(j);
    cluster.unhold(j.id);
    forget_driver(j.id);
    // Its workers go now, not when the lease of a driver that was killed runs out: what they
    // hold is what the lender waits for.
    if (!j.run.empty() && cluster.run_known(j.run)) cluster.release_run(j.run);
    store->audit(AuditRecord{j.id, now, "head", "preempted", "",
                             fmt::format("for job {}; driver exit code {}", j.preempted_by, code)});
    log(fmt::format("job {} ({}) PREEMPTED for job {}: driver exit code {}", j.id, j.name,
                    j.preempted_by, code));
  }

  // What a PREEMPTED job says before why it waits now.
  static std::string preempted_note(const JobRecord& j) {
    return fmt::format(
        "preempted by job {}, whose team took back the capacity this job "
        "borrowed; it resumes {} when capacity returns",
        j.preempted_by,
        j.resume_on_retry ? "from its newest checkpoint"
                          : "from the start (it has no checkpoint_dir)");
  }

  // Asks `v`'s driver to stop (a checkpoint first, exit 75) so that job `l` gets its team's quota
  // back.
  void preempt(JobRecord& v, const JobRecord& l) {
    v.stop_requested = unix_now();
    v.preempted_by = l.id;
    v.reason =
        fmt::format("being preempted for job {} of team {}: asked to stop{}", l.id, l.team,
                    v.resume_on_retry ? " after a checkpoint" : " (it has no checkpoint_dir)");
    store->update(v);
    store->audit(
        AuditRecord{v.id, unix_now(), "head", "preempt", "",
                    fmt::format("for job {} of team {}, within its quota; team {} had borrowed",
                                l.id, l.team, v.team)});
    signal_driver(v, SIGTERM);
    log(fmt::format("job {} ({}, team {}) preempted for job {} (team {}): asked to stop", v.id,
                    v.name, v.team, l.id, l.team));
  }

  // The key of job `id`'s driver is admitted no more.
  void forget_driver(std::int64_t id) {
    auto k = driver_keys.find(id);
    if (k == driver_keys.end()) return;
    if (cluster.revoke_driver) cluster.revoke_driver(k->second);
    driver_keys.erase(k);
  }

  // The head admits the key of job `id`'s driver (its file in the job's folder).
  void admit_driver(std::int64_t id, const std::string& public_key) {
    forget_driver(id);
    if (cluster.admit_driver) cluster.admit_driver(id, public_key);
    driver_keys[id] = public_key;
  }

  // Starts the supervisor of `j`, detached: its own session, not this process's child. With
  // --run-as, the job's working directory and driver key are given to its user's account (the
  // job's folder, whose files the head reads, stays this process's), and the supervisor starts
  // the driver as that account.
  void start(JobRecord& j) {
    if (!j.driver_node.empty()) return start_on_node(j);
    const fs::path dir = job_dir(j.id);
    std::optional<Account> account;
    if (o.run_as.enabled()) account = o.run_as.account_for(j.user);
    // A key of the driver's own: what it may do at the head is what this job may. Its public
    // half is kept where the account cannot change it, for a restarted head to admit again.
    if (!o.head_public.empty()) {
      const auto keys = transport::generate_keypair();
      // A new folder each start: one the account had may hold its links, which this process
      // must not write through.
      std::error_code ec;
      fs::remove_all(dir / "driver", ec);
      transport::write_keypair(dir / "driver", keys, fmt::format("the driver of job {}", j.id),
                               false);
      if (!write_atomic(dir / "driver.pub", keys.public_key + "\n"))
        throw Error(fmt::format("cannot write {}", (dir / "driver.pub").string()));
      if (account) give_tree(dir / "driver", *account);
      admit_driver(j.id, keys.public_key);
    }
    if (account) {
      // Once, while the tree is still this process's alone (the account cannot change it
      // under the walk); a preempted job that starts again has it already.
      struct stat st {};
      if (::lstat((dir / "work").c_str(), &st) == 0 && st.st_uid != account->uid)
        give_tree(dir / "work", *account);
      fs::permissions(dir, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
    }
    const auto argv = supervise_command(
        DriverCommand{o.exe.string(), dir, j.job_file, j.max_retries - j.retry_base, o.log_cap,
                      j.stop_grace_s, j.resume_on_retry, account ? account->name : "",
                      o.head_address, driver_sets(j), o.head_public});
    std::error_code ec;
    fs::remove(dir / "exit", ec);
    fs::remove(dir / "attempt", ec);
    const pid_t pid = start_supervisor(argv, j.id, j.user, j.name);
    j.supervisor_pid = pid;
    j.supervisor_start = process_start(pid);
    j.state = "RUNNING";
    j.stop_requested = 0;
    j.exit_code.reset();  // a preempted attempt's
    j.reason = "";
    j.started = unix_now();
    store->update(j);
    log(fmt::format("job {} ({}) of {} started: supervisor pid {}", j.id, j.name, j.user, pid));
  }

  // What the driver of `j` runs with: `--set` each of these (its overrides, remote mode, and
  // for a job that ran before (preempted, retried elsewhere or resumed), its resume).
  static std::vector<std::string> driver_sets(const JobRecord& j) {
    std::vector<std::string> sets = {"job.mode=remote"};
    for (const auto& x : nlohmann::json::parse(j.overrides)) sets.push_back(x.get<std::string>());
    if (!j.run.empty() && j.resume_on_retry) sets.push_back("job.resume=auto");
    return sets;
  }

  // Starts `j`'s driver on its node (driver_labels): the node's agent fetches the working
  // directory (archive_part), runs the supervisor there, and sends its log and its end
  // (driver_status). The driver has a key of its own, as on the head.
  void start_on_node(JobRecord& j) {
    const fs::path dir = job_dir(j.id);
    proto::DriverStart d;
    d.job = j.id;
    d.name = j.name;
    d.user = j.user;
    d.sha256 = j.sha256;
    std::error_code ec;
    d.size = static_cast<std::int64_t>(fs::file_size(upload(j.sha256), ec));
    if (ec)
      throw Error(fmt::format("the head no longer holds its working directory ({})", ec.message()));
    d.job_file = j.job_file;
    d.sets = driver_sets(j);
    d.max_retries = std::max(0, j.max_retries - j.retry_base);
    d.resume_on_retry = j.resume_on_retry;
    d.log_cap = static_cast<std::int64_t>(o.log_cap);
    d.stop_grace_s = j.stop_grace_s;
    // This start's token (kept where a supervisor on the head keeps its start time): messages
    // of an earlier start of the job, on this node or another, are not this one's.
    const std::int64_t token = j.supervisor_start + 1;
    d.token = token;
    if (!o.head_public.empty()) {
      const auto keys = transport::generate_keypair();
      if (!write_atomic(dir / "driver.pub", keys.public_key + "\n"))
        throw Error(fmt::format("cannot write {}", (dir / "driver.pub").string()));
      admit_driver(j.id, keys.public_key);
      d.keys = proto::RunKeys{keys.public_key, keys.secret_key, o.head_public};
    }
    for (const char* f : {"exit", "attempt", "log.remote"}) fs::remove(dir / f, ec);
    if (!cluster.send_node || !cluster.send_node(j.driver_node, Message{0, std::move(d)}))
      throw Error(fmt::format("node {}, chosen for its driver, is not live", j.driver_node));
    driver_signals.erase(j.id);
    driver_heard[j.id] = Clock::now();
    j.supervisor_pid = 0;
    j.supervisor_start = token;
    j.state = "RUNNING";
    j.stop_requested = 0;
    j.exit_code.reset();
    j.reason = "";
    j.started = unix_now();
    store->update(j);
    log(fmt::format("job {} ({}) of {} started: its driver on node {}", j.id, j.name, j.user,
                    j.driver_node));
  }

  // The driver of `j` went with its node: the job goes back to the queue while it has retries
  // (to resume from its newest checkpoint on another node), else it fails. Its key is revoked
  // first, so that a driver the node may still run can do nothing more at the head.
  void driver_lost(JobRecord& j, const std::string& why) {
    forget_driver(j.id);
    driver_signals.erase(j.id);
    driver_heard.erase(j.id);
    if (!j.run.empty() && cluster.run_known(j.run)) cluster.release_run(j.run);
    if (j.retries >= j.max_retries || j.stop_requested) {
      finish(j, "FAILED",
             fmt::format("{}{}", why,
                         j.max_retries ? fmt::format(" after {} retr{}", j.retries,
                                                     j.retries == 1 ? "y" : "ies")
                                       : std::string("; submit with --max-retries N to start "
                                                     "it again elsewhere")));
      return;
    }
    const auto now = unix_now();
    count_span(j, now);
    j.started = 0;
    ++j.retries;
    j.retry_base = j.retries;
    j.state = "QUEUED";
    j.reason = fmt::format("{}; retry {} of {}, {}", why, j.retries, j.max_retries,
                           j.resume_on_retry ? "resuming from its newest checkpoint"
                                             : "from the start (it has no checkpoint_dir)");
    store->update(j);
    cluster.unhold(j.id);
    store->audit(
        AuditRecord{j.id, now, "head", "retry", "",
                    fmt::format("attempt {} of {}: {}", j.retries + 1, j.max_retries + 1, why)});
    log(fmt::format("job {} ({}): {}; queued again (retry {} of {})", j.id, j.name, why, j.retries,
                    j.max_retries));
  }

  // The jobs that hold devices now, as the teams' policy sees them.
  std::vector<Holding> holding(std::map<std::int64_t, JobRecord>* running = nullptr) const {
    std::vector<Holding> out;
    for (auto& j : store->in_state("RUNNING")) {
      out.push_back(Holding{j.id, j.team, Resources{j.gpus, j.cpus}, j.started,
                            j.kind == "submitted" && j.preemptible, j.stop_requested != 0});
      if (running) (*running)[j.id] = std::move(j);
    }
    return out;
  }

  // Why a queued job waits for the job `dep` it runs after, or "" when it may start; a job whose
  // condition can no longer hold is dropped (false).
  bool check_after(JobRecord& j, std::string& reason) {
    if (!j.after_job) return true;
    const auto dep = store->get(j.after_job);
    if (!dep) {
      finish(j, "DROPPED",
             fmt::format("job {}, which it runs after, is gone from the history", j.after_job));
      return false;
    }
    const std::string& st = dep->state;
    if (!ended(st)) {
      reason = fmt::format("waiting for job {} to end (--after {}:{})", j.after_job, j.after_job,
                           j.after_condition);
      return true;
    }
    const bool ok = st == "SUCCEEDED";
    const bool satisfied = j.after_condition == "any" || (j.after_condition == "ok" ? ok : !ok);
    if (!satisfied) {
      finish(j, "DROPPED",
             fmt::format("job {} ended {}, and this job runs only after it {} (--after {}:{})",
                         j.after_job, st,
                         j.after_condition == "ok" ? "succeeds" : "fails or is stopped",
                         j.after_job, j.after_condition));
      return false;
    }
    return true;
  }

  // Tries the queue in its order (docs/ARCHITECTURE.md, Teams and quotas): a job within its
  // team's quota, then fair share, then priority, then submit time. Two rounds over that order:
  // first the jobs its team's quota covers now (as jobs start in this pass, a team's next job
  // may no longer be covered), then those that would borrow. A job that waits for devices holds
  // back those after it (no job is passed by a later one that would take its devices); a job
  // that waits for its own team's jobs, or fits the live nodes not even when they are idle,
  // does not.
  void schedule_queue() {
    std::map<std::int64_t, JobRecord> running;
    std::vector<Holding> held = holding(&running);
    auto use = use_by_team(held);
    shares.advance(unix_seconds(), use);  // what they held since the last pass
    std::map<std::int64_t, JobRecord> queued;
    std::vector<Waiting> queue;
    for (const char* state : {"QUEUED", "PREEMPTED"}) {
      for (auto& j : store->in_state(state)) {
        std::string reason;
        // A job that ran already (preempted, retried after its driver's node was lost, resumed):
        // what it ran after no longer matters, even once that is gone from the history.
        if (j.state == "QUEUED" && j.run.empty() && !check_after(j, reason)) continue;
        if (!reason.empty()) {
          if (reason != j.reason) {
            j.reason = reason;
            store->update(j);
          }
          continue;
        }
        queue.push_back(Waiting{j.id, j.team, Resources{j.gpus, j.cpus}, j.priority, j.submitted,
                                j.preemptible});
        queued[j.id] = std::move(j);
      }
    }
    mark_borrowing(held, running);
    if (queue.empty()) return;
    const bool teams =
        !o.quotas.file.empty() || std::any_of(o.member_teams.begin(), o.member_teams.end(),
                                              [](const auto& m) { return m.second != "default"; });
    std::int64_t first_waiting = 0;
    std::set<std::int64_t> done;
    const auto order = queue_order(std::move(queue), o.quotas, shares, use);
    for (const bool borrowing : {false, true}) {
      for (const Waiting& w : order) {
        if (done.count(w.id)) continue;
        JobRecord& j = queued.at(w.id);
        const TeamQuota quota = o.quotas.of(j.team);
        std::vector<std::int64_t> team_jobs;
        for (const auto& h : held)
          if (h.team == j.team) team_jobs.push_back(h.id);
        const Verdict verdict = admit(w, quota, use[j.team], team_jobs);
        if (!borrowing && verdict.admission == Admission::borrow) continue;  // the next round's
        done.insert(w.id);
        std::string reason;
        if (verdict.admission == Admission::wait) {
          reason = verdict.reason;
        } else if (first_waiting) {
          reason = fmt::format("waiting behind job {}, which goes first ({})", first_waiting,
                               teams ? "within its team's quota, then fair share, priority and "
                                       "submit time"
                                     : "first come, first served, priority aside");
        } else {
          const auto demand = demand_of(j);
          std::string driver_node;
          if (auto refusal = cluster.hold(j.id, demand, labels_of(j), &driver_node)) {
            if (!refusal->never) first_waiting = j.id;
            reason = verdict.admission == Admission::borrow
                         ? fmt::format("waiting: {} ({})", verdict.reason, refusal->why)
                         : "waiting for devices: " + refusal->why;
            if (verdict.admission == Admission::quota && !refusal->never)
              reason = reclaim(j, w, demand, held, running).value_or(reason);
          } else {
            try {
              j.driver_node = driver_node;
              start(j);
              if (verdict.admission == Admission::borrow) {
                j.reason = fmt::format(
                    "borrowing beyond team {}'s quota: it is preempted when the lending teams "
                    "need their capacity back",
                    j.team);
                store->update(j);
              }
              held.push_back(Holding{j.id, j.team, w.need, j.started, j.preemptible, false});
              use[j.team] += w.need;
              running[j.id] = j;
            } catch (const std::exception& e) {
              finish(j, "FAILED", e.what());
            }
            continue;
          }
        }
        if (j.state == "PREEMPTED") reason = preempted_note(j) + "; now " + reason;
        if (reason != j.reason) {
          j.reason = reason;
          store->update(j);
        }
      }
    }
  }

  // A running submitted job's reason says whether it runs on borrowed capacity now (a team's
  // older jobs that end bring its newer ones back within its quota).
  void mark_borrowing(const std::vector<Holding>& held,
                      std::map<std::int64_t, JobRecord>& running) {
    std::set<std::int64_t> borrowing;
    for (const auto& h : borrowing_jobs(held, o.quotas)) borrowing.insert(h.id);
    for (auto& [id, j] : running) {
      if (j.kind != "submitted" || j.stop_requested) continue;  // a stopping job says why
      const std::string reason =
          borrowing.count(id)
              ? fmt::format(
                    "borrowing beyond team {}'s quota: it is preempted when the lending "
                    "teams need their capacity back",
                    j.team)
              : std::string();
      if (reason != j.reason) {
        j.reason = reason;
        store->update(j);
      }
    }
  }

  // `j`, within its team's quota, does not fit: preempts the newest jobs of other teams that run
  // on borrowed capacity, as few as make room. Returns why `j` waits now, or nullopt when
  // preempting would not make room either.
  std::optional<std::string> reclaim(const JobRecord& j, const Waiting& w,
                                     const std::vector<proto::GroupDemandEntry>& demand,
                                     const std::vector<Holding>& held,
                                     std::map<std::int64_t, JobRecord>& running) {
    auto fits = [&](const std::vector<std::int64_t>& gone) {
      std::vector<std::string> runs;
      for (auto id : gone)
        if (auto r = running.find(id); r != running.end() && !r->second.run.empty())
          runs.push_back(r->second.run);
      return cluster.fits_without && cluster.fits_without(demand, labels_of(j), gone, runs);
    };
    const auto victims = preemption_victims(w, held, o.quotas, fits);
    if (!victims) return std::nullopt;
    if (victims->empty()) {
      std::vector<std::int64_t> stopping;
      for (const auto& h : held)
        if (h.stopping) stopping.push_back(h.id);
      return fmt::format("waiting for {} to stop and free their devices", job_list(stopping));
    }
    for (auto id : *victims)
      if (auto r = running.find(id); r != running.end()) preempt(r->second, j);
    return fmt::format(
        "waiting for {} to stop: preempted (newest first) because they run on "
        "capacity they borrowed, and team {} needs it back for this job",
        job_list(*victims), j.team);
  }

  proto::QuotasInfo on_quotas(const Caller& who, const proto::QuotasQuery& q) {
    proto::QuotasInfo info;
    if (q.reload) {
      if (!who.user.empty() && !who.admin) {
        info.error = fmt::format(
            "you ({}) may not reload the quotas: only an admin (marked "
            "`admin` in the head's allow-list) may",
            who.user);
        return info;
      }
      try {
        info.text = reload();
        store->audit(AuditRecord{0, unix_now(), who.user.empty() ? q.user : who.user,
                                 "quotas reload", q.from, info.text});
      } catch (const std::exception& e) {
        info.error = e.what();
        return info;
      }
    }
    info.file = o.quotas.file.string();
    info.half_life_s = o.quotas.half_life_s;
    std::map<std::int64_t, JobRecord> running;
    const auto held = holding(&running);
    const auto use = use_by_team(held);
    std::set<std::string> names;
    for (const auto& [name, t] : o.quotas.teams) names.insert(name);
    for (const auto& [member, team] : o.member_teams) names.insert(team);
    for (const auto& [team, r] : use) names.insert(team);
    std::map<std::string, int> waiting_jobs;
    for (const char* state : {"QUEUED", "PREEMPTED"})
      for (const auto& j : store->in_state(state)) {
        ++waiting_jobs[j.team];
        names.insert(j.team);
      }
    for (const auto& name : names) {
      const TeamQuota t = o.quotas.of(name);
      proto::TeamEntry e;
      e.name = name;
      e.listed = t.listed;
      e.gpus = t.gpus;
      e.cpus = t.cpus;
      e.borrow_gpus = t.borrow_gpus;
      e.borrow_cpus = t.borrow_cpus;
      e.weight = t.weight;
      e.max_priority = t.max_priority;
      if (auto u = use.find(name); u != use.end()) {
        e.used_gpus = u->second.gpus;
        e.used_cpus = u->second.cpus;
      }
      if (t.gpus) e.borrowed_gpus = std::max(0, e.used_gpus - *t.gpus);
      if (t.cpus) e.borrowed_cpus = std::max(0, e.used_cpus - *t.cpus);
      const auto share = shares.of(name);
      e.gpu_seconds = share.gpu_seconds;
      e.cpu_seconds = share.cpu_seconds;
      for (const auto& h : held) e.running += h.team == name;
      e.waiting = waiting_jobs[name];
      for (const auto& [member, team] : o.member_teams)
        if (team == name) e.members.push_back(member);
      info.teams.push_back(std::move(e));
    }
    return info;
  }

  // Members whose team the quotas file does not list: said once per start or reload.
  void warn_unlisted() const {
    if (o.quotas.file.empty()) return;
    for (const auto& [member, team] : o.member_teams) {
      if (!o.quotas.teams.count(team))
        log(
            fmt::format("quotas: team \"{}\" (of {}) is not in {}; it gets the default team's "
                        "numbers",
                        team, member, o.quotas.file.string()));
    }
  }

  std::string reload() {
    if (o.quotas.file.empty())
      throw ConfigError(
          "this head has no quotas file to read again: start it with `twinkle node start --head "
          "--quotas FILE`");
    Quotas q = load_quotas(o.quotas.file);
    o.quotas = std::move(q);
    shares.set_half_life(o.quotas.half_life_s);
    warn_unlisted();
    std::vector<std::string> names;
    for (const auto& [name, t] : o.quotas.teams) names.push_back(name);
    const std::string text =
        fmt::format("read {} again: {} team{} ({})", o.quotas.file.string(), names.size(),
                    names.size() == 1 ? "" : "s", fmt::join(names, ", "));
    log(text);
    return text;
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
  s_->store = std::make_unique<Store>(s_->o.state_dir / "jobs.db");
  s_->private_state();
  // Leftovers of a head killed mid-submit.
  for (const auto& e : fs::directory_iterator(s_->o.state_dir / "jobs", ec)) {
    if (e.path().filename().string().rfind(".incoming-", 0) == 0) fs::remove_all(e.path(), ec);
  }
  for (const auto& e : fs::directory_iterator(s_->o.state_dir / "uploads", ec)) {
    if (e.path().extension() == ".part") fs::remove(e.path(), ec);
  }
  s_->sweep_uploads();
  s_->warn_unlisted();
  // The teams' shares of the past, from the history.
  s_->shares.set_half_life(s_->o.quotas.half_life_s);
  const double now = unix_seconds();
  for (const auto& j : s_->store->started_since(
           static_cast<std::int64_t>(now - kShareMemory * s_->o.quotas.half_life_s))) {
    const double end = j.ended ? static_cast<double>(j.ended) : now;
    s_->shares.add_span(j.team, Resources{j.gpus, j.cpus}, static_cast<double>(j.started), end,
                        now);
  }
  int running = 0;
  for (auto& j : s_->store->in_state("RUNNING")) {
    ++running;
    if (j.kind == "interactive") s_->interactive[j.run] = j.id;
    // A stop asked for (a preemption among them) whose signal a killed head may not have sent:
    // again (a supervisor that has it already ignores it).
    if (j.kind == "submitted" && j.stop_requested) s_->signal_driver(j, SIGTERM);
    // Its driver, which lives on, connects again with its key.
    if (j.kind == "submitted" && !s_->o.head_public.empty()) {
      try {
        std::ifstream in(s_->job_dir(j.id) / "driver.pub");
        std::string key;
        if (!(in >> key) || !transport::is_z85_key(key)) throw Error("no driver.pub in its folder");
        s_->admit_driver(j.id, key);
      } catch (const Error& e) {
        s_->log(fmt::format("job {}: its driver cannot connect again: {}", j.id, e.what()));
      }
    }
  }
  s_->log(fmt::format("job history {} ({} jobs, {} running)",
                      (s_->o.state_dir / "jobs.db").string(), s_->store->count(), running));
}

JobService::~JobService() = default;

std::string driver_name(std::int64_t job) { return fmt::format("job/{}", job); }

std::optional<std::int64_t> driver_job(const std::string& name) {
  if (name.rfind("job/", 0) != 0 || name.size() == 4) return std::nullopt;
  std::int64_t id = 0;
  for (std::size_t i = 4; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || id > (INT64_MAX - 9) / 10) return std::nullopt;
    id = id * 10 + (name[i] - '0');
  }
  return id;
}

// The job that runs as `run`: an interactive one, or a submitted one that is RUNNING.
std::optional<JobRecord> JobService::State::job_of_run(const std::string& run) const {
  if (auto i = interactive.find(run); i != interactive.end()) return store->get(i->second);
  for (auto& r : store->in_state("RUNNING")) {
    if (r.run == run) return std::move(r);
  }
  return std::nullopt;
}

void JobService::restarted(const std::string& run, int count) {
  State& s = *s_;
  try {
    std::optional<JobRecord> j = s.job_of_run(run);
    if (!j || count <= j->run_restarts) return;
    j->restarts += count - j->run_restarts;
    j->run_restarts = count;
    s.store->update(*j);
    s.store->audit(AuditRecord{j->id, unix_now(), "head", "restart", "",
                               fmt::format("a group of run {} restarted after a lost worker "
                                           "(restart {} of the run)",
                                           run, count)});
  } catch (const std::exception& e) {
    s.log(fmt::format("job service: {}", e.what()));
  }
}

void JobService::moved(const std::string& run, const std::vector<proto::RankPlace>& places) {
  State& s = *s_;
  try {
    std::optional<JobRecord> j = s.job_of_run(run);
    if (!j) return;
    nlohmann::json placement = nlohmann::json::parse(j->placement, nullptr, false);
    if (!placement.is_array()) placement = nlohmann::json::array();
    std::vector<std::string> moved;
    for (const auto& p : places) {
      for (auto& e : placement) {
        if (e.value("group", "") != p.group || e.value("rank", -1) != p.rank) continue;
        moved.push_back(
            fmt::format("{}:{} from {} to {}", p.group, p.rank, e.value("node", "?"), p.node));
        e["node"] = p.node;
        e["gpus"] = p.gpus;
      }
    }
    std::set<std::string> nodes;
    for (const auto& e : placement) nodes.insert(e.value("node", ""));
    j->placement = placement.dump();
    j->nodes = static_cast<int>(nodes.size());
    s.store->update(*j);
    s.store->audit(AuditRecord{
        j->id, unix_now(), "head", "move", "",
        fmt::format("ranks of run {} moved off a DEAD node: {}", run, fmt::join(moved, ", "))});
  } catch (const std::exception& e) {
    s.log(fmt::format("job service: {}", e.what()));
  }
}

std::optional<std::string> JobService::user_of(std::int64_t id) const {
  if (auto j = s_->store->get(id)) return j->user;
  return std::nullopt;
}

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
          } else if constexpr (std::is_same_v<T, proto::JobResume>) {
            Message answer{request, s.on_resume(caller, b)};
            s.schedule_queue();  // it starts now when it fits
            return answer;
          } else if constexpr (std::is_same_v<T, proto::QuotasQuery>) {
            return Message{request, s.on_quotas(caller, b)};
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
          } else if constexpr (std::is_same_v<T, proto::QuotasQuery>) {
            proto::QuotasInfo q;
            q.error = a.error;
            return Message{request, q};
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
        // again after a head restart
        if (s.cluster.hold_driver) s.cluster.hold_driver(j.id, j.driver_node);
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
                          const std::string& name, const std::string& user, const std::string& team,
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
      r.team = team;
      r.kind = "interactive";
      r.state = "RUNNING";
      r.submitted = r.started = unix_now();
      r.overrides = "[]";
      r.demand = "[]";
      r.id = s.store->add(r);
      s.interactive[run] = r.id;
      j = r;
    }
    if (j->run != run) j->run_restarts = 0;
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

proto::DriverAck JobService::driver_status(const std::string& node, const proto::DriverStatus& st) {
  State& s = *s_;
  proto::DriverAck ack;
  ack.job = st.job;
  ack.done = true;  // unless it is this node's running job: the agent forgets it
  try {
    ack.token = st.token;
    auto j = s.store->get(st.job);
    if (!j || j->kind != "submitted" || j->state != "RUNNING" || j->driver_node != node ||
        j->supervisor_start != st.token)
      return ack;
    const fs::path dir = s.job_dir(j->id);
    s.driver_heard[j->id] = Clock::now();
    // The log in the node's offsets: what is here already is not written twice (an answer lost,
    // a restarted head).
    std::int64_t have = 0;
    {
      std::ifstream in(dir / "log.remote");
      in >> have;
    }
    const auto size = static_cast<std::int64_t>(st.log.data.size());
    if (size > 0 && st.offset + size > have) {
      const auto skip = static_cast<std::size_t>(std::max<std::int64_t>(0, have - st.offset));
      append_log(dir, s.o.log_cap,
                 std::string_view(reinterpret_cast<const char*>(st.log.data.data()) + skip,
                                  st.log.data.size() - skip));
      have = st.offset + size;
      write_atomic(dir / "log.remote", fmt::format("{}\n", have));
    }
    ack.log_end = have;
    if (st.attempt >= 0) {
      auto at = read_attempt(dir);
      if (!at || at->attempt != st.attempt)
        write_atomic(dir / "attempt", fmt::format("{} 0\n", st.attempt));
    }
    if (st.error) {
      s.finish(*j, "FAILED",
               fmt::format("its driver could not start on node {}: {}", node, *st.error));
    } else if (st.lost) {
      s.finish(*j, "FAILED",
               fmt::format("its supervisor on node {} ended without a word; the last lines are in "
                           "`twinkle logs {}`",
                           node, j->id));
    } else if (st.exit) {
      // Sent once the whole log is here: the end is recorded as the supervisor's own.
      write_atomic(dir / "exit", fmt::format("{} {}\n", *st.exit, st.retries));
      s.watch(*j);
    } else {
      ack.done = false;  // (tick's watch counts its retries from `attempt`)
      if (auto sig = s.driver_signals.find(j->id); sig != s.driver_signals.end())
        ack.signal = sig->second;
    }
    if (ack.done) {
      s.driver_signals.erase(j->id);
      s.driver_heard.erase(j->id);
    }
  } catch (const std::exception& e) {
    ack.done = false;
    ack.log_end = -1;  // the agent keeps its place and tries again at its next beat
    s.log(fmt::format("job service: driver of job {} on node {}: {}", st.job, node, e.what()));
  }
  return ack;
}

proto::ArchivePart JobService::archive_part(const std::string& node,
                                            const proto::NeedArchive& need) {
  State& s = *s_;
  proto::ArchivePart p;
  p.job = need.job;
  p.sha256 = need.sha256;
  p.offset = need.offset;
  p.token = need.token;
  const auto j = s.store->get(need.job);
  if (!j || j->state != "RUNNING" || j->driver_node != node || j->sha256 != need.sha256 ||
      j->supervisor_start != need.token) {
    p.error = fmt::format("job {} has no driver to start on node {}", need.job, node);
    return p;
  }
  std::ifstream in(s.upload(j->sha256), std::ios::binary);
  std::error_code ec;
  const auto size = static_cast<std::int64_t>(fs::file_size(s.upload(j->sha256), ec));
  if (!in || ec || need.offset < 0 || need.offset > size) {
    p.error = fmt::format("the head cannot read job {}'s working directory", need.job);
    return p;
  }
  in.seekg(need.offset);
  p.bytes.data.resize(
      static_cast<std::size_t>(std::min<std::int64_t>(kArchivePiece, size - need.offset)));
  in.read(reinterpret_cast<char*>(p.bytes.data.data()),
          static_cast<std::streamsize>(p.bytes.data.size()));
  if (!in) {
    p.error = fmt::format("the head cannot read job {}'s working directory", need.job);
    p.bytes.data.clear();
    return p;
  }
  p.last = need.offset + static_cast<std::int64_t>(p.bytes.data.size()) == size;
  return p;
}

std::string JobService::reload_quotas() {
  const std::string text = s_->reload();
  s_->store->audit(AuditRecord{0, unix_now(), "head", "quotas reload", "", "SIGHUP: " + text});
  return text;
}

}  // namespace twinkle::core::jobs
