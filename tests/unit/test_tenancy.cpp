// Teams sharing a cluster (core/jobs/tenancy): the quotas file, fair share, the queue's order,
// admission within a quota or by borrowing, and who is preempted; and, over simulated time,
// that fair share splits a cluster by the teams' weights.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>

#include "core/jobs/tenancy.hpp"
#include "twinkle/errors.hpp"

using namespace twinkle;
using namespace twinkle::core::jobs;

namespace {

std::string error_of(const std::string& text) {
  try {
    parse_quotas(text, "quotas.toml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::vector<std::int64_t> ids(const std::vector<Waiting>& q) {
  std::vector<std::int64_t> out;
  for (const auto& w : q) out.push_back(w.id);
  return out;
}

}  // namespace

TEST_CASE("a quotas file gives each team its quota, borrowing limit, weight and priority bound",
          "[tenancy]") {
  const Quotas q = parse_quotas(R"(
half_life_s = 3600
[team.default]
gpus = 0
cpus = 4
[team.vision]
gpus = 4
cpus = 16
borrow_gpus = 2
weight = 2
max_priority = 5
)",
                                "quotas.toml");
  CHECK(q.half_life_s == 3600);
  const TeamQuota v = q.of("vision");
  CHECK(v.listed);
  CHECK(v.gpus == 4);
  CHECK(v.cpus == 16);
  CHECK(v.borrow_gpus == 2);
  CHECK(v.borrow_cpus == 0);
  CHECK(v.weight == 2);
  CHECK(v.max_priority == 5);
  // A team the file does not list has a quota of the default's size, of its own.
  const TeamQuota other = q.of("speech");
  CHECK_FALSE(other.listed);
  CHECK(other.name == "speech");
  CHECK(other.gpus == 0);
  CHECK(other.cpus == 4);
  // Without a file: no limits, weight 1.
  const TeamQuota none = no_quotas().of("anyone");
  CHECK_FALSE(none.gpus);
  CHECK_FALSE(none.cpus);
  CHECK(none.weight == 1);
  // A file without [team.default]: the default team has no limits.
  CHECK_FALSE(parse_quotas("[team.a]\ngpus = 1\n", "q.toml").of("b").gpus);
}

TEST_CASE("a malformed quotas file is refused with file:line:col, the key and the fix",
          "[tenancy]") {
  CHECK(error_of("[team.a]\ngpus = -1\n") ==
        "quotas.toml:2:8: team.a.gpus must be a whole number from 0 to 1048576");
  CHECK(error_of("[team.a]\ngpus = 1.5\n").starts_with("quotas.toml:2:8: team.a.gpus must be"));
  CHECK(error_of("[team.a]\nweight = 0\n")
            .starts_with("quotas.toml:2:10: team.a.weight must be a number above 0"));
  CHECK(error_of("[team.a]\ngpu = 2\n").starts_with("quotas.toml:2:7: team.a.gpu: unknown key"));
  CHECK(error_of("[team.Vision]\ngpus = 2\n").find("a team's name is 1 to 64 of a-z") !=
        std::string::npos);
  CHECK(error_of("halflife = 3\n").starts_with("quotas.toml:1:12: unknown key \"halflife\""));
  CHECK(error_of("half_life_s = -3\n").starts_with("quotas.toml:1:15: half_life_s must be"));
  CHECK(error_of("team = 3\n").starts_with("quotas.toml:1:8: team must be a table"));
  CHECK(error_of("[team.a]\ngpus = \n").starts_with("quotas.toml:2:"));  // TOML's own error
  CHECK(error_of("[team.a]\nmax_priority = 5000\n")
            .starts_with("quotas.toml:2:16: team.a.max_priority must be a whole number from 0 to "
                         "1000"));
}

TEST_CASE("fair share: use counts in full now and half a half-life later", "[tenancy]") {
  ShareMeter m(100);
  m.advance(1000, {});
  m.advance(1100, {{"a", Resources{2, 4}}});   // 2 GPUs for one half-life
  const double k = 100 / std::log(2.0) * 0.5;  // one GPU held for a half-life, seen at its end
  CHECK(m.of("a").gpu_seconds == Approx(2 * k));
  CHECK(m.of("a").cpu_seconds == Approx(4 * k));
  CHECK(m.of("b").gpu_seconds == 0);
  m.advance(1200, {});
  CHECK(m.of("a").gpu_seconds == Approx(k));  // halved
  // The same span read from the history gives the same share.
  ShareMeter h(100);
  h.add_span("a", Resources{2, 4}, 1000, 1100, 1200);
  CHECK(h.of("a").gpu_seconds == Approx(k));
  // Short steps add up to one long one.
  ShareMeter s(100);
  s.advance(1000, {});
  for (int t = 1; t <= 100; ++t) s.advance(1000 + t, {{"a", Resources{2, 4}}});
  CHECK(s.of("a").gpu_seconds == Approx(2 * k));
}

TEST_CASE("the queue's order: within quota, then fair share by weight, priority, submit time",
          "[tenancy]") {
  Quotas q = parse_quotas(R"(
[team.a]
gpus = 2
borrow_gpus = 2
[team.b]
gpus = 2
weight = 2
[team.c]
gpus = 4
)",
                          "q.toml");
  ShareMeter m(3600);
  m.advance(0.5, {});
  // a has used 100 GPU-seconds-ish, b 150 (weight 2: 75 each), c nothing.
  m.advance(1.5, {{"a", Resources{100, 0}}, {"b", Resources{150, 0}}});
  std::map<std::string, Resources> use = {{"a", Resources{2, 2}}};  // a is at its quota
  std::vector<Waiting> queue = {
      {1, "a", {1, 1}, 0, 10, true},  // would borrow: last
      {2, "b", {1, 1}, 0, 11, true},  // b's share per weight 75 < a's 100
      {3, "c", {1, 1}, 0, 12, true},  // c has used nothing: first
      {4, "b", {1, 1}, 5, 13, true},  // b's higher priority goes before b's earlier job
      {5, "c", {1, 1}, 0, 9, true},   // earlier submit within c
  };
  CHECK(ids(queue_order(queue, q, m, use)) == std::vector<std::int64_t>{5, 3, 4, 2, 1});
  // Back within its quota, a's job still comes after b's: a's share per weight is higher.
  use.clear();
  CHECK(ids(queue_order(queue, q, m, use)) == std::vector<std::int64_t>{5, 3, 4, 2, 1});
  // Without a share of the past the queue is first come, first served (priority aside).
  CHECK(ids(queue_order(queue, no_quotas(), ShareMeter(3600), {})) ==
        std::vector<std::int64_t>{4, 5, 1, 2, 3});
}

TEST_CASE("admission: within the quota, borrowing, or waiting, each with its reason", "[tenancy]") {
  Quotas q = parse_quotas("[team.vision]\ngpus = 4\nborrow_gpus = 2\n", "q.toml");
  const TeamQuota v = q.of("vision");
  Waiting two{20, "vision", {2, 2}, 0, 0, true};
  CHECK(admit(two, v, Resources{2, 2}, {12}).admission == Admission::quota);
  const Verdict b = admit(two, v, Resources{4, 4}, {12, 17});
  CHECK(b.admission == Admission::borrow);
  // The issue's own example of what a waiting job says.
  CHECK(b.reason ==
        "team vision uses 4 of its 4 GPUs (jobs 12, 17); it may borrow 2 more when the cluster "
        "has them free");
  Waiting four{21, "vision", {4, 4}, 0, 0, true};
  const Verdict w = admit(four, v, Resources{4, 4}, {12, 17});
  CHECK(w.admission == Admission::wait);
  CHECK(w.reason ==
        "waiting: team vision uses 4 of its 4 GPUs (jobs 12, 17); this job needs 4 more and the "
        "team may borrow at most 2 beyond its quota; it starts when the team's jobs end");
  Waiting seven{23, "vision", {7, 7}, 0, 0, true};  // more than the quota and borrowing allow
  CHECK(admit(seven, v, Resources{}, {}).reason ==
        "waiting: team vision may hold at most 6 GPUs (a quota of 4 and 2 to borrow) and this job "
        "needs 7: it starts only once an admin raises the team's quota");
  Waiting fixed{22, "vision", {2, 2}, 0, 0, false};  // preemptible = false never borrows
  const Verdict f = admit(fixed, v, Resources{4, 4}, {12});
  CHECK(f.admission == Admission::wait);
  CHECK(f.reason.find("preemptible = false, so it does not borrow") != std::string::npos);
  // CPUs count too, where the quota names them.
  Quotas c = parse_quotas("[team.t]\ncpus = 4\n", "q.toml");
  const Verdict cv = admit(Waiting{1, "t", {0, 3}, 0, 0, true}, c.of("t"), Resources{0, 2}, {7});
  CHECK(cv.admission == Admission::wait);
  CHECK(cv.reason ==
        "waiting: team t uses 2 of its 4 CPUs (job 7); this job needs 3 more; it "
        "starts when the team's jobs end");
}

TEST_CASE("preemption takes the newest borrowing jobs of other teams, as few as make room",
          "[tenancy]") {
  Quotas q = parse_quotas(R"(
[team.a]
gpus = 2
borrow_gpus = 4
[team.b]
gpus = 4
)",
                          "q.toml");
  // a holds 6 GPUs (2 of its quota, then 4 borrowed in jobs 2 and 3); b holds 1 of its 4.
  std::vector<Holding> held = {
      {1, "a", {2, 2}, 100, true, false},
      {2, "a", {2, 2}, 200, true, false},
      {3, "a", {2, 2}, 300, true, false},
      {4, "b", {1, 1}, 150, true, false},
  };
  const auto borrowing = borrowing_jobs(held, q);
  REQUIRE(borrowing.size() == 2);
  CHECK(borrowing[0].id == 2);
  CHECK(borrowing[1].id == 3);
  // An 8-GPU cluster with 1 free: b's 3-GPU job needs 2 more, one borrowing job's worth.
  auto free_after = [&](const std::vector<std::int64_t>& gone) {
    int free = 1;
    for (const auto& h : held)
      if (std::find(gone.begin(), gone.end(), h.id) != gone.end()) free += h.held.gpus;
    return free;
  };
  Waiting lender{10, "b", {3, 3}, 0, 0, true};
  auto v =
      preemption_victims(lender, held, q, [&](const auto& gone) { return free_after(gone) >= 3; });
  REQUIRE(v);
  CHECK(*v == std::vector<std::int64_t>{3});  // the newest only
  // 5 GPUs: both borrowing jobs, newest first; a's job within its quota is never taken.
  v = preemption_victims(lender, held, q, [&](const auto& gone) { return free_after(gone) >= 5; });
  REQUIRE(v);
  CHECK(*v == std::vector<std::int64_t>{3, 2});
  // Only as many as needed: when job 2's devices are the ones that make room (say, they carry a
  // label the lender asks for), the newer job 3, tried first, is not taken after all.
  v = preemption_victims(lender, held, q, [&](const auto& gone) {
    return std::find(gone.begin(), gone.end(), 2) != gone.end();
  });
  REQUIRE(v);
  CHECK(*v == std::vector<std::int64_t>{2});
  CHECK_FALSE(
      preemption_victims(lender, held, q, [&](const auto& gone) { return free_after(gone) >= 7; }));
  // What is already stopping counts first: nobody more is preempted.
  held[2].stopping = true;
  v = preemption_victims(lender, held, q, [&](const auto& gone) { return free_after(gone) >= 3; });
  REQUIRE(v);
  CHECK(v->empty());
  // A team never preempts its own borrowing jobs, and non-preemptible jobs are never taken.
  held[2].stopping = false;
  Waiting own{11, "a", {1, 1}, 0, 0, true};
  CHECK_FALSE(preemption_victims(own, held, q, [&](const auto& gone) { return !gone.empty(); }));
  held[1].preemptible = held[2].preemptible = false;
  CHECK(borrowing_jobs(held, q).empty());
}

TEST_CASE("over simulated time, fair share splits the GPUs 1:1:2 between weights 1, 1 and 2",
          "[tenancy]") {
  // 8 GPUs; three teams without quotas (weights 1, 1, 2) keep 4 equal jobs each in the queue: 1
  // GPU for 60 s. Each second: jobs end, the meter moves, the queue is tried in its order.
  Quotas q = parse_quotas(R"(
half_life_s = 1800
[team.x]
weight = 1
[team.y]
weight = 1
[team.z]
weight = 2
)",
                          "q.toml");
  ShareMeter meter(q.half_life_s);
  const std::vector<std::string> teams = {"x", "y", "z"};
  std::vector<Waiting> queue;
  struct Run {
    std::int64_t id;
    std::string team;
    int ends;
  };
  std::vector<Run> running;
  std::map<std::string, double> gpu_seconds;  // in the measured window
  std::int64_t next_id = 1;
  const int warmup = 3600, window = 20000;
  for (int t = 0; t < warmup + window; ++t) {
    std::erase_if(running, [&](const Run& r) { return r.ends <= t; });
    for (const auto& team : teams) {
      while (std::count_if(queue.begin(), queue.end(),
                           [&](const Waiting& w) { return w.team == team; }) < 4)
        queue.push_back(Waiting{next_id++, team, {1, 1}, 0, t, true});
    }
    std::map<std::string, Resources> use;
    for (const auto& r : running) use[r.team] += Resources{1, 1};
    meter.advance(t, use);
    int free = 8 - static_cast<int>(running.size());
    std::vector<Waiting> left;
    for (auto& w : queue_order(queue, q, meter, use)) {
      if (free > 0) {
        --free;
        running.push_back(Run{w.id, w.team, t + 60});
        use[w.team] += w.need;
      } else {
        left.push_back(std::move(w));
      }
    }
    queue = std::move(left);
    if (t >= warmup)
      for (const auto& r : running) gpu_seconds[r.team] += 1;
  }
  const double total = gpu_seconds["x"] + gpu_seconds["y"] + gpu_seconds["z"];
  CHECK(total == Approx(8.0 * window));
  INFO("x " << gpu_seconds["x"] << ", y " << gpu_seconds["y"] << ", z " << gpu_seconds["z"]);
  CHECK(gpu_seconds["x"] / total == Approx(0.25).epsilon(0.1));
  CHECK(gpu_seconds["y"] / total == Approx(0.25).epsilon(0.1));
  CHECK(gpu_seconds["z"] / total == Approx(0.5).epsilon(0.1));
}
