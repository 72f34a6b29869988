#include "core/jobs/store.hpp"

#include <sqlite3.h>

#include <set>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core::jobs {

namespace {

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS jobs (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  name TEXT NOT NULL, user TEXT NOT NULL, kind TEXT NOT NULL, state TEXT NOT NULL,
  reason TEXT NOT NULL, submitted INTEGER NOT NULL, started INTEGER NOT NULL,
  ended INTEGER NOT NULL, retries INTEGER NOT NULL, max_retries INTEGER NOT NULL,
  exit_code INTEGER, gpus INTEGER NOT NULL, cpus INTEGER NOT NULL, nodes INTEGER NOT NULL,
  gpu_seconds REAL NOT NULL, run TEXT NOT NULL, from_host TEXT NOT NULL,
  stopped_by TEXT NOT NULL, job_file TEXT NOT NULL, sha256 TEXT NOT NULL,
  overrides TEXT NOT NULL, after_job INTEGER NOT NULL, after_condition TEXT NOT NULL,
  demand TEXT NOT NULL, placement TEXT NOT NULL, resume_on_retry INTEGER NOT NULL,
  stop_grace_s REAL NOT NULL, supervisor_pid INTEGER NOT NULL,
  supervisor_start INTEGER NOT NULL, stop_requested INTEGER NOT NULL,
  team TEXT NOT NULL DEFAULT 'default', priority INTEGER NOT NULL DEFAULT 0,
  preemptible INTEGER NOT NULL DEFAULT 1, preemptions INTEGER NOT NULL DEFAULT 0,
  preempted_by INTEGER NOT NULL DEFAULT 0, retry_base INTEGER NOT NULL DEFAULT 0,
  restarts INTEGER NOT NULL DEFAULT 0, run_restarts INTEGER NOT NULL DEFAULT 0,
  driver_labels TEXT NOT NULL DEFAULT '{}', driver_node TEXT NOT NULL DEFAULT '',
  retry_budget INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE TABLE IF NOT EXISTS audit (
  id INTEGER PRIMARY KEY AUTOINCREMENT, job INTEGER NOT NULL, time INTEGER NOT NULL,
  user TEXT NOT NULL, action TEXT NOT NULL, from_host TEXT NOT NULL, detail TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_job ON audit(job);
)sql";

constexpr const char* kColumns =
    "id, name, user, kind, state, reason, submitted, started, ended, retries, max_retries, "
    "exit_code, gpus, cpus, nodes, gpu_seconds, run, from_host, stopped_by, job_file, sha256, "
    "overrides, after_job, after_condition, demand, placement, resume_on_retry, stop_grace_s, "
    "supervisor_pid, supervisor_start, stop_requested, team, priority, preemptible, preemptions, "
    "preempted_by, retry_base, restarts, run_restarts, driver_labels, driver_node, retry_budget";

// Columns a history written before teams (issue 24), remote restarts and drivers on nodes
// lacks, added when it is opened.
constexpr const char* kAddedColumns[][2] = {
    {"team", "TEXT NOT NULL DEFAULT 'default'"},     {"priority", "INTEGER NOT NULL DEFAULT 0"},
    {"preemptible", "INTEGER NOT NULL DEFAULT 1"},   {"preemptions", "INTEGER NOT NULL DEFAULT 0"},
    {"preempted_by", "INTEGER NOT NULL DEFAULT 0"},  {"retry_base", "INTEGER NOT NULL DEFAULT 0"},
    {"restarts", "INTEGER NOT NULL DEFAULT 0"},      {"run_restarts", "INTEGER NOT NULL DEFAULT 0"},
    {"driver_labels", "TEXT NOT NULL DEFAULT '{}'"}, {"driver_node", "TEXT NOT NULL DEFAULT ''"},
    {"retry_budget", "INTEGER NOT NULL DEFAULT 0"}};

// The states of jobs that have not ended, as SQL.
constexpr const char* kActive = "('QUEUED','RUNNING','PREEMPTED')";

// One prepared statement; binds by position from 1, reads columns from 0.
class Statement {
 public:
  Statement(sqlite3* db, const std::string& sql, const std::string& file) : db_(db), file_(file) {
    if (sqlite3_prepare_v2(db, sql.c_str(), -1, &st_, nullptr) != SQLITE_OK) fail("prepare");
  }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;
  ~Statement() { sqlite3_finalize(st_); }

  Statement& bind(int i, std::int64_t v) {
    sqlite3_bind_int64(st_, i, v);
    return *this;
  }
  Statement& bind(int i, int v) { return bind(i, static_cast<std::int64_t>(v)); }
  Statement& bind(int i, bool v) { return bind(i, static_cast<std::int64_t>(v)); }
  Statement& bind(int i, double v) {
    sqlite3_bind_double(st_, i, v);
    return *this;
  }
  Statement& bind(int i, const std::string& v) {
    sqlite3_bind_text(st_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Statement& bind(int i, const std::optional<int>& v) {
    if (v) return bind(i, *v);
    sqlite3_bind_null(st_, i);
    return *this;
  }

  // True while there is a row.
  bool step() {
    const int rc = sqlite3_step(st_);
    if (rc == SQLITE_ROW) return true;
    if (rc != SQLITE_DONE) fail("step");
    return false;
  }

  std::int64_t i64(int c) const { return sqlite3_column_int64(st_, c); }
  double f64(int c) const { return sqlite3_column_double(st_, c); }
  bool null(int c) const { return sqlite3_column_type(st_, c) == SQLITE_NULL; }
  std::string text(int c) const {
    const auto* p = sqlite3_column_text(st_, c);
    return p ? std::string(reinterpret_cast<const char*>(p),
                           static_cast<std::size_t>(sqlite3_column_bytes(st_, c)))
             : std::string();
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw Error(fmt::format("{}: the job history cannot {} a statement: {}", file_, what,
                            sqlite3_errmsg(db_)));
  }

  sqlite3* db_;
  sqlite3_stmt* st_ = nullptr;
  const std::string& file_;
};

JobRecord read_job(const Statement& s) {
  JobRecord j;
  int c = 0;
  j.id = s.i64(c++);
  j.name = s.text(c++);
  j.user = s.text(c++);
  j.kind = s.text(c++);
  j.state = s.text(c++);
  j.reason = s.text(c++);
  j.submitted = s.i64(c++);
  j.started = s.i64(c++);
  j.ended = s.i64(c++);
  j.retries = static_cast<int>(s.i64(c++));
  j.max_retries = static_cast<int>(s.i64(c++));
  if (!s.null(c)) j.exit_code = static_cast<int>(s.i64(c));
  ++c;
  j.gpus = static_cast<int>(s.i64(c++));
  j.cpus = static_cast<int>(s.i64(c++));
  j.nodes = static_cast<int>(s.i64(c++));
  j.gpu_seconds = s.f64(c++);
  j.run = s.text(c++);
  j.from = s.text(c++);
  j.stopped_by = s.text(c++);
  j.job_file = s.text(c++);
  j.sha256 = s.text(c++);
  j.overrides = s.text(c++);
  j.after_job = s.i64(c++);
  j.after_condition = s.text(c++);
  j.demand = s.text(c++);
  j.placement = s.text(c++);
  j.resume_on_retry = s.i64(c++) != 0;
  j.stop_grace_s = s.f64(c++);
  j.supervisor_pid = static_cast<int>(s.i64(c++));
  j.supervisor_start = s.i64(c++);
  j.stop_requested = s.i64(c++);
  j.team = s.text(c++);
  j.priority = static_cast<int>(s.i64(c++));
  j.preemptible = s.i64(c++) != 0;
  j.preemptions = static_cast<int>(s.i64(c++));
  j.preempted_by = s.i64(c++);
  j.retry_base = static_cast<int>(s.i64(c++));
  j.restarts = static_cast<int>(s.i64(c++));
  j.run_restarts = static_cast<int>(s.i64(c++));
  j.driver_labels = s.text(c++);
  j.driver_node = s.text(c++);
  j.retry_budget = static_cast<int>(s.i64(c++));
  return j;
}

template <class... T>
void bind_all(Statement& s, int first, const T&... values) {
  int i = first;
  (s.bind(i++, values), ...);  // a fold over the comma: in order
}

// Binds every column but id, from position `first`.
void bind_job(Statement& s, const JobRecord& j, int first) {
  bind_all(s, first, j.name, j.user, j.kind, j.state, j.reason, j.submitted, j.started, j.ended,
           j.retries, j.max_retries, j.exit_code, j.gpus, j.cpus, j.nodes, j.gpu_seconds, j.run,
           j.from, j.stopped_by, j.job_file, j.sha256, j.overrides, j.after_job, j.after_condition,
           j.demand, j.placement, j.resume_on_retry, j.stop_grace_s, j.supervisor_pid,
           j.supervisor_start, j.stop_requested, j.team, j.priority, j.preemptible, j.preemptions,
           j.preempted_by, j.retry_base, j.restarts, j.run_restarts, j.driver_labels, j.driver_node,
           j.retry_budget);
}

constexpr int kBound = 41;  // columns but id

}  // namespace

Store::Store(const std::filesystem::path& file) : file_(file.string()) {
  if (sqlite3_open_v2(file_.c_str(), &db_,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    const std::string why = db_ ? sqlite3_errmsg(db_) : "out of memory";
    sqlite3_close(db_);
    throw Error(fmt::format("{}: cannot open the job history: {}; check --state-dir", file_, why));
  }
  sqlite3_busy_timeout(db_, 5000);
  // WAL: a reader never waits for the writer, and a committed change survives the process
  // being killed (synchronous NORMAL loses at most the last commits on a power cut).
  char* err = nullptr;
  const std::string setup =
      std::string("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;") + kSchema;
  if (sqlite3_exec(db_, setup.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
    const std::string why = err ? err : "unknown";
    sqlite3_free(err);
    sqlite3_close(db_);
    db_ = nullptr;
    throw Error(
        fmt::format("{}: not a job history this head can use: {}; move it away or "
                    "choose another --state-dir",
                    file_, why));
  }
  std::set<std::string> have;
  {
    Statement s(db_, "PRAGMA table_info(jobs)", file_);
    while (s.step()) have.insert(s.text(1));
  }
  for (const auto& [name, type] : kAddedColumns) {
    if (have.count(name)) continue;
    Statement(db_, fmt::format("ALTER TABLE jobs ADD COLUMN {} {}", name, type), file_).step();
  }
}

Store::~Store() { sqlite3_close(db_); }

std::int64_t Store::add(const JobRecord& job) {
  std::string marks;
  for (int i = 0; i < kBound; ++i) marks += ", ?";
  Statement s(db_, fmt::format("INSERT INTO jobs ({}) VALUES (NULL{})", kColumns, marks), file_);
  bind_job(s, job, 1);
  s.step();
  return sqlite3_last_insert_rowid(db_);
}

void Store::update(const JobRecord& job) {
  Statement s(db_,
              "UPDATE jobs SET name=?, user=?, kind=?, state=?, reason=?, submitted=?, started=?, "
              "ended=?, retries=?, max_retries=?, exit_code=?, gpus=?, cpus=?, nodes=?, "
              "gpu_seconds=?, run=?, from_host=?, stopped_by=?, job_file=?, sha256=?, "
              "overrides=?, after_job=?, after_condition=?, demand=?, placement=?, "
              "resume_on_retry=?, stop_grace_s=?, supervisor_pid=?, supervisor_start=?, "
              "stop_requested=?, team=?, priority=?, preemptible=?, preemptions=?, "
              "preempted_by=?, retry_base=?, restarts=?, run_restarts=?, driver_labels=?, "
              "driver_node=?, retry_budget=? WHERE id=?",
              file_);
  bind_job(s, job, 1);
  s.bind(kBound + 1, job.id);
  s.step();
}

std::optional<JobRecord> Store::get(std::int64_t id) const {
  Statement s(db_, fmt::format("SELECT {} FROM jobs WHERE id=?", kColumns), file_);
  s.bind(1, id);
  if (!s.step()) return std::nullopt;
  return read_job(s);
}

std::vector<JobRecord> Store::list(const JobFilter& f) const {
  std::vector<JobRecord> out;
  std::string where = "WHERE 1";
  if (!f.user.empty()) where += " AND user=?1";
  if (!f.state.empty()) where += " AND state=?2";
  {
    Statement s(
        db_,
        fmt::format("SELECT {} FROM jobs {} AND state IN {} ORDER BY id", kColumns, where, kActive),
        file_);
    if (!f.user.empty()) s.bind(1, f.user);
    if (!f.state.empty()) s.bind(2, f.state);
    while (s.step()) out.push_back(read_job(s));
  }
  Statement s(db_,
              fmt::format("SELECT {} FROM jobs {} AND state NOT IN {} ORDER BY id DESC{}", kColumns,
                          where, kActive, f.all ? "" : " LIMIT ?3"),
              file_);
  if (!f.user.empty()) s.bind(1, f.user);
  if (!f.state.empty()) s.bind(2, f.state);
  if (!f.all) s.bind(3, f.recent);
  while (s.step()) out.push_back(read_job(s));
  return out;
}

std::vector<JobRecord> Store::in_state(const std::string& state) const {
  std::vector<JobRecord> out;
  Statement s(db_, fmt::format("SELECT {} FROM jobs WHERE state=? ORDER BY id", kColumns), file_);
  s.bind(1, state);
  while (s.step()) out.push_back(read_job(s));
  return out;
}

void Store::audit(const AuditRecord& r) {
  Statement s(db_,
              "INSERT INTO audit (job, time, user, action, from_host, detail) VALUES (?, ?, ?, ?, "
              "?, ?)",
              file_);
  s.bind(1, r.job).bind(2, r.time).bind(3, r.user).bind(4, r.action).bind(5, r.from);
  s.bind(6, r.detail);
  s.step();
}

std::vector<AuditRecord> Store::audit_of(std::int64_t job) const {
  std::vector<AuditRecord> out;
  Statement s(db_,
              "SELECT job, time, user, action, from_host, detail FROM audit WHERE job=? ORDER BY "
              "id",
              file_);
  s.bind(1, job);
  while (s.step())
    out.push_back(AuditRecord{s.i64(0), s.i64(1), s.text(2), s.text(3), s.text(4), s.text(5)});
  return out;
}

std::vector<std::pair<std::int64_t, std::string>> Store::prune(int keep) {
  std::vector<std::pair<std::int64_t, std::string>> gone;
  {
    Statement s(db_,
                fmt::format("SELECT id, sha256 FROM jobs WHERE state NOT IN {} ORDER BY id DESC "
                            "LIMIT -1 OFFSET ?",
                            kActive),
                file_);
    s.bind(1, keep);
    while (s.step()) gone.emplace_back(s.i64(0), s.text(1));
  }
  if (gone.empty()) return gone;
  char* err = nullptr;
  sqlite3_exec(db_, "BEGIN", nullptr, nullptr, &err);
  for (const auto& [id, sha] : gone) {
    Statement a(db_, "DELETE FROM audit WHERE job=?", file_);
    a.bind(1, id);
    a.step();
    Statement j(db_, "DELETE FROM jobs WHERE id=?", file_);
    j.bind(1, id);
    j.step();
  }
  sqlite3_exec(db_, "COMMIT", nullptr, nullptr, &err);
  return gone;
}

std::vector<JobRecord> Store::started_since(std::int64_t since) const {
  std::vector<JobRecord> out;
  Statement s(db_,
              fmt::format("SELECT {} FROM jobs WHERE started > 0 AND (ended = 0 OR ended >= ?) "
                          "ORDER BY id",
                          kColumns),
              file_);
  s.bind(1, since);
  while (s.step()) out.push_back(read_job(s));
  return out;
}

bool Store::uses(const std::string& sha256) const {
  Statement s(db_, "SELECT 1 FROM jobs WHERE sha256=? LIMIT 1", file_);
  s.bind(1, sha256);
  return s.step();
}

std::int64_t Store::count() const {
  Statement s(db_, "SELECT COUNT(*) FROM jobs", file_);
  s.step();
  return s.i64(0);
}

}  // namespace twinkle::core::jobs
