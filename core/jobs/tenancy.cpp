#include "core/jobs/tenancy.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include "twinkle/errors.hpp"

namespace twinkle::core::jobs {

namespace {

constexpr int kMaxCount = 1 << 20;       // GPUs or CPUs a quota may name
constexpr int kMaxPriorityBound = 1000;  // max_priority
constexpr double kMaxHalfLife = 365 * 86400.0;

bool team_name_ok(std::string_view n) {
  return !n.empty() && n.size() <= 64 &&
         n.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_-") == std::string_view::npos;
}

class QuotasReader {
 public:
  explicit QuotasReader(std::string file) : file_(std::move(file)) {}

  Quotas read(const toml::table& root) const {
    Quotas q = no_quotas();
    for (const auto& [k, v] : root) {
      if (k == "half_life_s") {
        const auto d = v.value<double>();
        if (!d || !(*d > 0 && *d <= kMaxHalfLife))
          fail(v, fmt::format("half_life_s must be a number of seconds above 0 and at most {:g} "
                              "(a year), e.g. 86400 for a day",
                              kMaxHalfLife));
        q.half_life_s = *d;
      } else if (k == "team") {
        const toml::table* teams = v.as_table();
        if (!teams) fail(v, "team must be a table of teams: [team.NAME]");
        for (const auto& [name, t] : *teams) {
          const std::string n(name.str());
          if (!team_name_ok(n))
            fail(t, fmt::format("team \"{}\": a team's name is 1 to 64 of a-z, 0-9, _ and -", n));
          const toml::table* tt = t.as_table();
          if (!tt) fail(t, fmt::format("team.{} must be a table ([team.{}])", n, n));
          q.teams[n] = read_team(n, *tt);
        }
      } else {
        fail(v, fmt::format("unknown key \"{}\"; a quotas file has half_life_s and [team.NAME] "
                            "tables (gpus, cpus, borrow_gpus, borrow_cpus, weight, max_priority)",
                            std::string(k.str())));
      }
    }
    return q;
  }

 private:
  [[noreturn]] void fail(const toml::node& n, const std::string& msg) const {
    const auto& src = n.source();
    throw ConfigError(fmt::format("{}:{}:{}: {}", file_, src.begin.line, src.begin.column, msg));
  }

  int count(const toml::node& n, const std::string& path, int max) const {
    const auto v = n.value<std::int64_t>();
    if (!n.is_integer() || !v || *v < 0 || *v > max)
      fail(n, fmt::format("{} must be a whole number from 0 to {}", path, max));
    return static_cast<int>(*v);
  }

  TeamQuota read_team(const std::string& name, const toml::table& t) const {
    TeamQuota q;
    q.name = name;
    for (const auto& [k, v] : t) {
      const std::string key(k.str());
      const std::string path = fmt::format("team.{}.{}", name, key);
      if (key == "gpus") {
        q.gpus = count(v, path, kMaxCount);
      } else if (key == "cpus") {
        q.cpus = count(v, path, kMaxCount);
      } else if (key == "borrow_gpus") {
        q.borrow_gpus = count(v, path, kMaxCount);
      } else if (key == "borrow_cpus") {
        q.borrow_cpus = count(v, path, kMaxCount);
      } else if (key == "max_priority") {
        q.max_priority = count(v, path, kMaxPriorityBound);
      } else if (key == "weight") {
        const auto d = v.value<double>();
        if (!d || !(*d > 0 && *d <= 1e6))
          fail(v, fmt::format("{} must be a number above 0 (a team of weight 2 gets twice the "
                              "share of one of weight 1)",
                              path));
        q.weight = *d;
      } else {
        fail(v, fmt::format("{}: unknown key; a team has gpus, cpus, borrow_gpus, borrow_cpus, "
                            "weight and max_priority",
                            path));
      }
    }
    return q;
  }

  std::string file_;
};

bool within(const std::optional<int>& limit, int extra, int value) {
  return !limit || value <= *limit + extra;
}

double ratio(double used, double weight) { return used / weight; }

}  // namespace

std::string job_list(const std::vector<std::int64_t>& ids) {
  std::vector<std::string> parts;
  for (auto id : ids) parts.push_back(std::to_string(id));
  return fmt::format("job{} {}", ids.size() == 1 ? "" : "s", fmt::join(parts, ", "));
}

TeamQuota Quotas::of(const std::string& team) const {
  if (auto t = teams.find(team); t != teams.end()) return t->second;
  TeamQuota q = teams.count("default") ? teams.at("default") : TeamQuota{};
  q.name = team;
  q.listed = false;
  return q;
}

Quotas parse_quotas(std::string_view text, const std::filesystem::path& file) {
  toml::table root;
  try {
    root = toml::parse(text, file.string());
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("{}:{}:{}: {}", file.string(), e.source().begin.line,
                                  e.source().begin.column, e.description()));
  }
  Quotas q = QuotasReader(file.string()).read(root);
  q.file = file;
  return q;
}

Quotas load_quotas(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    throw ConfigError(
        fmt::format("--quotas {}: cannot read it; give a TOML file of [team.NAME] "
                    "tables (twinkle-quotas(1))",
                    file.string()));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return parse_quotas(text.str(), std::filesystem::absolute(file));
}

Quotas no_quotas() {
  Quotas q;
  TeamQuota d;
  d.name = "default";
  q.teams["default"] = d;
  return q;
}

// ----- fair share ---------------------------------------------------------------------------

void ShareMeter::add_span(const std::string& team, Resources held, double start, double end,
                          double now) {
  if (now_ == 0) now_ = now;
  if (end <= start) return;
  // The integral of held * 2^(-(now - t) / h) over [start, end].
  const double h = half_life_;
  const double k =
      h / std::log(2.0) * (std::exp2(-(now_ - end) / h) - std::exp2(-(now_ - start) / h));
  Share& s = shares_[team];
  s.gpu_seconds += held.gpus * k;
  s.cpu_seconds += held.cpus * k;
}

void ShareMeter::advance(double now, const std::map<std::string, Resources>& running) {
  if (now_ == 0) now_ = now;
  const double dt = now - now_;
  if (dt <= 0) return;
  now_ = now;
  const double decay = std::exp2(-dt / half_life_);
  for (auto& [team, s] : shares_) {
    s.gpu_seconds *= decay;
    s.cpu_seconds *= decay;
  }
  // What was held during dt, each moment decayed to now.
  const double k = half_life_ / std::log(2.0) * (1 - decay);
  for (const auto& [team, r] : running) {
    Share& s = shares_[team];
    s.gpu_seconds += r.gpus * k;
    s.cpu_seconds += r.cpus * k;
  }
}

ShareMeter::Share ShareMeter::of(const std::string& team) const {
  auto s = shares_.find(team);
  return s == shares_.end() ? Share{} : s->second;
}

// ----- the queue ----------------------------------------------------------------------------

std::map<std::string, Resources> use_by_team(const std::vector<Holding>& holding) {
  std::map<std::string, Resources> use;
  for (const auto& h : holding) use[h.team] += h.held;
  return use;
}

std::vector<Waiting> queue_order(std::vector<Waiting> queue, const Quotas& quotas,
                                 const ShareMeter& shares,
                                 const std::map<std::string, Resources>& use) {
  struct Key {
    int outside;  // 0: fits its team's quota
    double gpu_share, cpu_share;
    int neg_priority;
    std::int64_t submitted, id;
    bool operator<(const Key& o) const {
      return std::tie(outside, gpu_share, cpu_share, neg_priority, submitted, id) <
             std::tie(o.outside, o.gpu_share, o.cpu_share, o.neg_priority, o.submitted, o.id);
    }
  };
  std::vector<std::pair<Key, Waiting>> keyed;
  for (auto& w : queue) {
    const TeamQuota q = quotas.of(w.team);
    Resources after = w.need;
    if (auto u = use.find(w.team); u != use.end()) after += u->second;
    const auto s = shares.of(w.team);
    Key k{within(q.gpus, 0, after.gpus) && within(q.cpus, 0, after.cpus) ? 0 : 1,
          ratio(s.gpu_seconds, q.weight),
          ratio(s.cpu_seconds, q.weight),
          -w.priority,
          w.submitted,
          w.id};
    keyed.emplace_back(k, std::move(w));
  }
  std::stable_sort(keyed.begin(), keyed.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<Waiting> out;
  for (auto& [k, w] : keyed) out.push_back(std::move(w));
  return out;
}

std::optional<std::string> never_fits(const TeamQuota& q, Resources need, bool preemptible,
                                      const std::filesystem::path& file) {
  auto check = [&](const char* what, const char* key, const std::optional<int>& limit, int borrow,
                   int n) -> std::optional<std::string> {
    if (!limit) return std::nullopt;
    const int most = *limit + (preemptible ? borrow : 0);
    if (n <= most) return std::nullopt;
    return fmt::format(
        "the job needs {} {}s, and team {} may hold at most {} (a quota of {}{}{}): ask for "
        "fewer, or have an admin raise the team's {}s or borrow_{}s in {}",
        n, what, q.name, most, *limit,
        preemptible ? fmt::format(" and {} to borrow", borrow) : std::string(),
        !preemptible && borrow > 0 ? "; it asks preemptible = false, so it does not borrow" : "",
        key, key, file.string());
  };
  if (auto why = check("GPU", "gpu", q.gpus, q.borrow_gpus, need.gpus)) return why;
  return check("CPU", "cpu", q.cpus, q.borrow_cpus, need.cpus);
}

Verdict admit(const Waiting& job, const TeamQuota& q, Resources use,
              const std::vector<std::int64_t>& team_jobs) {
  Resources after = use;
  after += job.need;
  Verdict v;
  if (within(q.gpus, 0, after.gpus) && within(q.cpus, 0, after.cpus)) return v;
  // The resource that is over: GPUs before CPUs.
  const bool gpus_over = !within(q.gpus, 0, after.gpus);
  const char* what = gpus_over ? "GPU" : "CPU";
  const int quota = gpus_over ? *q.gpus : *q.cpus;
  const int used = gpus_over ? use.gpus : use.cpus;
  const int need = gpus_over ? job.need.gpus : job.need.cpus;
  const int borrow = gpus_over ? q.borrow_gpus : q.borrow_cpus;
  const std::string holders =
      team_jobs.empty() ? std::string() : fmt::format(" ({})", job_list(team_jobs));
  const std::string state =
      fmt::format("team {} uses {} of its {} {}s{}", q.name, used, quota, what, holders);
  const bool may_borrow =
      within(q.gpus, q.borrow_gpus, after.gpus) && within(q.cpus, q.borrow_cpus, after.cpus);
  if (may_borrow && job.preemptible) {
    v.admission = Admission::borrow;
    v.reason = fmt::format("{}; it may borrow {} more when the cluster has them free", state,
                           borrow - std::max(0, used - quota));
    return v;
  }
  v.admission = Admission::wait;
  const int most = quota + (job.preemptible ? borrow : 0);
  if (need > most) {
    v.reason = fmt::format(
        "waiting: team {} may hold at most {} {}s (a quota of {}{}) and this "
        "job needs {}: it starts only once an admin raises the team's quota",
        q.name, most, what, quota, job.preemptible ? fmt::format(" and {} to borrow", borrow) : "",
        need);
  } else if (may_borrow) {
    v.reason = fmt::format(
        "waiting: {}, and this job asks preemptible = false, so it does not "
        "borrow beyond the quota; it starts when the team's jobs end",
        state);
  } else if (borrow > 0) {
    v.reason = fmt::format(
        "waiting: {}; this job needs {} more and the team may borrow at most "
        "{} beyond its quota; it starts when the team's jobs end",
        state, need, borrow);
  } else {
    v.reason = fmt::format(
        "waiting: {}; this job needs {} more; it starts when the team's jobs "
        "end",
        state, need);
  }
  return v;
}

std::vector<Holding> borrowing_jobs(const std::vector<Holding>& holding, const Quotas& quotas) {
  std::map<std::string, std::vector<const Holding*>> by_team;
  for (const auto& h : holding) by_team[h.team].push_back(&h);
  std::vector<Holding> out;
  for (auto& [team, jobs] : by_team) {
    std::sort(jobs.begin(), jobs.end(), [](const Holding* a, const Holding* b) {
      return std::tie(a->started, a->id) < std::tie(b->started, b->id);
    });
    const TeamQuota q = quotas.of(team);
    Resources cum;
    for (const Holding* h : jobs) {
      cum += h->held;
      const bool beyond = !within(q.gpus, 0, cum.gpus) || !within(q.cpus, 0, cum.cpus);
      if (beyond && h->preemptible && !h->stopping) out.push_back(*h);
    }
  }
  return out;
}

std::optional<std::vector<std::int64_t>> preemption_victims(
    const Waiting& job, const std::vector<Holding>& holding, const Quotas& quotas,
    const std::function<bool(const std::vector<std::int64_t>&)>& fits) {
  std::vector<std::int64_t> gone;
  for (const auto& h : holding)
    if (h.stopping) gone.push_back(h.id);
  if (fits(gone)) return std::vector<std::int64_t>{};
  std::vector<Holding> candidates;
  for (auto& h : borrowing_jobs(holding, quotas))
    if (h.team != job.team) candidates.push_back(std::move(h));
  std::sort(candidates.begin(), candidates.end(), [](const Holding& a, const Holding& b) {
    return std::tie(a.started, a.id) > std::tie(b.started, b.id);  // newest first
  });
  std::vector<std::int64_t> victims;
  for (const auto& c : candidates) {
    victims.push_back(c.id);
    gone.push_back(c.id);
    if (!fits(gone)) continue;
    // Only as many as needed: one taken before the last that the job fits without stays.
    for (std::size_t i = 0; i + 1 < victims.size();) {
      auto without = gone;
      without.erase(std::find(without.begin(), without.end(), victims[i]));
      if (fits(without)) {
        gone = std::move(without);
        victims.erase(victims.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    return victims;
  }
  return std::nullopt;
}

}  // namespace twinkle::core::jobs
