#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

struct sqlite3;

// The head's job history (docs/ARCHITECTURE.md, Job service): every job, queued, running or
// ended, and the audit records of who submitted and stopped what, in one SQLite file. Every
// change is a transaction on disk before it is answered, so a head killed at any moment starts
// again with all of it.
namespace twinkle::core::jobs {

struct JobRecord {
  std::int64_t id = 0;  // assigned by add
  std::string name, user;
  std::string kind = "submitted";  // "submitted" | "interactive"
  // QUEUED RUNNING PREEMPTED (waiting to resume) SUCCEEDED FAILED STOPPED DROPPED ENDED
  std::string state = "QUEUED";
  std::string reason;
  std::int64_t submitted = 0, started = 0, ended = 0;  // unix seconds
  int retries = 0, max_retries = 0;
  std::optional<int> exit_code;
  int gpus = 0, cpus = 0, nodes = 0;
  double gpu_seconds = 0;
  std::string run;  // its driver's run id (latest attempt)
  std::string from, stopped_by;
  std::string job_file;   // inside its working directory
  std::string sha256;     // its working directory's archive
  std::string overrides;  // JSON list of "SECTION.KEY=VALUE"
  std::int64_t after_job = 0;
  std::string after_condition;   // "ok" | "notok" | "any" ("" none)
  std::string demand;            // JSON: what its groups ask for (GroupDemandEntry list)
  std::string placement;         // JSON: [{group, rank, node, gpus}]
  bool resume_on_retry = false;  // its job has a checkpoint_dir
  double stop_grace_s = 0;
  int supervisor_pid = 0;
  // The supervisor's start time (/proc/PID/stat), for pid reuse; for a driver on a node, the
  // number of its latest start (driver_start.token).
  std::int64_t supervisor_start = 0;
  std::int64_t stop_requested = 0;  // unix seconds of a graceful stop, 0 none
  // Teams (docs/ARCHITECTURE.md, Teams and quotas).
  std::string team = "default";  // its submitter's team when it was submitted
  int priority = 0;              // within its team
  bool preemptible = true;       // [job] preemptible: false never borrows
  int preemptions = 0;
  int restarts = 0;               // its groups' restarts after a lost worker, over all its runs
  int run_restarts = 0;           // those of its latest run (what that run's driver last said)
  std::int64_t preempted_by = 0;  // the job whose team reclaimed its devices last (0 none)
  int retry_base = 0;             // driver retries before its latest start (after preemptions)
  // Drivers on nodes (docs/ARCHITECTURE.md, Drivers on nodes): [job] driver_labels as a JSON
  // object ("{}": the driver runs on the head's machine), and the node its latest start is on.
  std::string driver_labels = "{}";
  std::string driver_node;
  int retry_budget = 0;  // --max-retries as submitted: what each `twinkle resume` gives again
};

struct AuditRecord {
  std::int64_t job = 0;
  std::int64_t time = 0;
  std::string user, action, from, detail;
};

struct JobFilter {
  bool all = false;  // ended jobs too beyond the newest `recent`
  int recent = 20;
  std::string user, state;
};

class Store {
 public:
  // Opens (creating) the database at `file`. Throws Error naming the file and SQLite's reason.
  explicit Store(const std::filesystem::path& file);
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;
  ~Store();

  // Adds `job` and returns its id (ids grow and are never reused, even after pruning).
  std::int64_t add(const JobRecord& job);
  void update(const JobRecord& job);
  std::optional<JobRecord> get(std::int64_t id) const;
  // Active jobs (QUEUED, RUNNING, PREEMPTED) first by id, then ended ones newest first (the newest
  // `recent` of them unless `all`), after the user and state filters.
  std::vector<JobRecord> list(const JobFilter& filter) const;
  // Jobs in `state`, by id.
  std::vector<JobRecord> in_state(const std::string& state) const;

  void audit(const AuditRecord& record);
  std::vector<AuditRecord> audit_of(std::int64_t job) const;

  // Removes the oldest ended jobs (and their audit records) beyond the newest `keep` ended ones;
  // returns their ids and working directory sha256s.
  std::vector<std::pair<std::int64_t, std::string>> prune(int keep);
  // Jobs that started and are running or ended at `since` or later (unix seconds), by id.
  std::vector<JobRecord> started_since(std::int64_t since) const;
  // True when a job in the history has the working directory `sha256`.
  bool uses(const std::string& sha256) const;
  std::int64_t count() const;

 private:
  sqlite3* db_ = nullptr;
  std::string file_;
};

}  // namespace twinkle::core::jobs
