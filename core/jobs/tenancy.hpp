#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

// Teams sharing a cluster (docs/ARCHITECTURE.md, Teams and quotas): each team's quota and
// borrowing limit from the head's quotas file, its fair share of the past, and the order in
// which the queue is tried. Pure: no head, no processes, no clock of its own, so that a test can
// run the policy over simulated time.
namespace twinkle::core::jobs {

// GPUs and CPUs (one CPU per worker) a job holds or asks for.
struct Resources {
  int gpus = 0, cpus = 0;
  Resources& operator+=(const Resources& o) {
    gpus += o.gpus;
    cpus += o.cpus;
    return *this;
  }
};

// One team's numbers from the quotas file. A missing `gpus` or `cpus` means no limit on it.
struct TeamQuota {
  std::string name;
  std::optional<int> gpus, cpus;  // the nominal quota
  int borrow_gpus = 0;            // how far beyond its quota it may run on idle capacity
  int borrow_cpus = 0;
  double weight = 1;      // its fair share, relative to the other teams'
  int max_priority = 10;  // `twinkle submit --priority` is -max_priority..max_priority
  bool listed = true;     // false: not in the file; the default team's numbers apply
};

struct Quotas {
  std::filesystem::path file;              // empty: no quotas file (no limits; every team weighs 1)
  double half_life_s = 86400;              // of the fair share's memory of past use
  std::map<std::string, TeamQuota> teams;  // always holds "default"

  // `team`'s numbers: its own, or, for a team the file does not list, the default team's under
  // its name (each such team has a quota of its own, of the default's size).
  TeamQuota of(const std::string& team) const;
};

// A quotas file's text. Throws ConfigError "FILE:LINE:COLUMN: ..." naming the key and the fix.
Quotas parse_quotas(std::string_view text, const std::filesystem::path& file);
// The same, read from `file` (a ConfigError naming it when it cannot be read).
Quotas load_quotas(const std::filesystem::path& file);
// No quotas file: one default team without limits.
Quotas no_quotas();

// Each team's use of the past, with older use counting less: a second of use `half_life_s` ago
// counts half. GPU-seconds order the teams; CPU-seconds break ties (a cluster without GPUs).
class ShareMeter {
 public:
  explicit ShareMeter(double half_life_s = 86400) : half_life_(half_life_s) {}
  void set_half_life(double half_life_s) { half_life_ = half_life_s; }

  // `held` was used by `team` from `start` to `end` (unix seconds, end <= now), as seen at `now`:
  // for the history a head reads when it starts.
  void add_span(const std::string& team, Resources held, double start, double end, double now);
  // Time moves on to `now`; `running` (per team) was held since the last call.
  void advance(double now, const std::map<std::string, Resources>& running);

  struct Share {
    double gpu_seconds = 0, cpu_seconds = 0;
  };
  // As of the last advance (or add_span).
  Share of(const std::string& team) const;

 private:
  double half_life_;
  double now_ = 0;
  std::map<std::string, Share> shares_;
};

// A job in the queue, as the policy sees it.
struct Waiting {
  std::int64_t id = 0;
  std::string team;
  Resources need;
  int priority = 0;
  std::int64_t submitted = 0;
  bool preemptible = true;
};

// A job that holds devices now.
struct Holding {
  std::int64_t id = 0;
  std::string team;
  Resources held;
  std::int64_t started = 0;
  bool preemptible = true;  // a submitted job (an interactive run is never preempted)
  bool stopping = false;    // asked to stop (preempted, or by its owner): its devices come back
};

// What each team holds now.
std::map<std::string, Resources> use_by_team(const std::vector<Holding>& holding);

// The order the queue is tried in: first the jobs that fit their team's quota, then by fair
// share (the team's decayed use divided by its weight, lowest first), then by priority (highest
// first), then by submit time and id.
std::vector<Waiting> queue_order(std::vector<Waiting> queue, const Quotas& quotas,
                                 const ShareMeter& shares,
                                 const std::map<std::string, Resources>& use);

// How a job may start given its team's use now.
enum class Admission {
  quota,   // within its team's quota
  borrow,  // beyond the quota but within the borrowing limit (on idle capacity, preemptible)
  wait,    // beyond what its team may hold now: it waits for its team's own jobs to end
};
struct Verdict {
  Admission admission = Admission::quota;
  std::string reason;  // why it waits (wait) or what it borrows (borrow)
};
// `team_jobs`: the ids of the team's jobs that hold devices now (named in the reason).
Verdict admit(const Waiting& job, const TeamQuota& quota, Resources use,
              const std::vector<std::int64_t>& team_jobs);

// The jobs that run on borrowed capacity: for each team, its jobs by start time, those that
// take it beyond its quota (the newest ones). Non-preemptible jobs and stopping ones are left
// out.
std::vector<Holding> borrowing_jobs(const std::vector<Holding>& holding, const Quotas& quotas);

// The jobs to preempt so that `job` (within its team's quota) can start: jobs of other teams on
// borrowed capacity, taken newest first until `fits` (would `job` fit were these jobs and those
// already stopping gone?) says yes, then each taken before the last dropped again when `job`
// fits without it. Empty: what is stopping already makes room; nullopt: preempting every
// borrowing job would not make it fit either.
std::optional<std::vector<std::int64_t>> preemption_victims(
    const Waiting& job, const std::vector<Holding>& holding, const Quotas& quotas,
    const std::function<bool(const std::vector<std::int64_t>&)>& fits);

// "job 12" / "jobs 12, 17": job ids for messages.
std::string job_list(const std::vector<std::int64_t>& ids);

// Why a job that needs `need` can never start in team `q` (more than its quota and, for a
// preemptible job, its borrowing limit allow with nothing else running), naming `file` for the
// fix; nullopt when it can.
std::optional<std::string> never_fits(const TeamQuota& q, Resources need, bool preemptible,
                                      const std::filesystem::path& file);

}  // namespace twinkle::core::jobs
