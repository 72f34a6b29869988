// `meson test --benchmark tenancy`: the head's scheduling pass with 1,000 queued jobs of three
// teams on 100 simulated nodes (8 GPUs and 64 CPUs each, half of the GPUs held), next to the
// head's heartbeat load of those nodes measured in the same run (100 nodes beat every 500 ms:
// 200 heartbeat messages a second, decoded as the head decodes them), as ratios.
// A pass is what the job service does each tick: order the queue (quota, fair share, priority,
// submit time), admit each job against its team's quota and place it on the free capacity;
// "every job placed" tries the scheduler for all 1,000 (no job holds back the others), the worst
// case. Usage: twinkle_bench_tenancy [ROUNDS]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <zmq.hpp>

#include "core/cluster/scheduler.hpp"
#include "core/jobs/tenancy.hpp"
#include "transports/zmq/message.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace jobs = twinkle::core::jobs;
namespace cluster = twinkle::core::cluster;
namespace proto = twinkle::transport::proto;

constexpr int kNodes = 100, kGpus = 8, kCpus = 64, kQueued = 1000;
constexpr double kBeatsPerSecond = kNodes / 0.5;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Setup {
  jobs::Quotas quotas;
  jobs::ShareMeter shares{86400};
  std::vector<cluster::NodeCapacity> free;
  std::vector<jobs::Waiting> queue;
  std::vector<std::vector<cluster::GroupDemand>> demands;  // by job id - 1
  std::map<std::string, jobs::Resources> use;
};

Setup make_setup() {
  Setup s;
  s.quotas = jobs::parse_quotas(R"(
[team.vision]
gpus = 200
borrow_gpus = 100
[team.speech]
gpus = 200
borrow_gpus = 100
[team.nlp]
gpus = 400
weight = 2
)",
                                "bench.toml");
  std::mt19937 rng(42);
  for (int n = 0; n < kNodes; ++n) {
    cluster::NodeCapacity c;
    c.id = fmt::format("n{}", n);
    c.cpus = kCpus / 2;
    for (int g = kGpus / 2; g < kGpus; ++g) c.gpus.push_back(g);  // half held
    s.free.push_back(std::move(c));
  }
  const std::vector<std::string> teams = {"vision", "speech", "nlp"};
  s.shares.advance(1000, {});
  s.shares.advance(2000, {{"vision", {100, 100}}, {"speech", {150, 150}}, {"nlp", {150, 150}}});
  s.use = {{"vision", {150, 150}}, {"speech", {100, 100}}, {"nlp", {150, 150}}};
  std::uniform_int_distribution<int> size(1, 16), prio(-3, 3);
  for (int i = 0; i < kQueued; ++i) {
    const int gpus = size(rng);
    cluster::GroupDemand d;
    d.name = "model";
    d.workers = gpus;
    d.gpus_per_worker = 1;
    s.demands.push_back({d});
    s.queue.push_back(jobs::Waiting{i + 1, teams[static_cast<std::size_t>(i) % 3],
                                    jobs::Resources{gpus, gpus}, prio(rng), 1000 + i, true});
  }
  return s;
}

// One pass; returns how many jobs were placed. `every`: no job holds back the later ones.
int pass(const Setup& s, bool every) {
  auto free = s.free;
  auto use = s.use;
  bool blocked = false;
  int placed = 0;
  for (const auto& w : jobs::queue_order(s.queue, s.quotas, s.shares, use)) {
    const auto v = jobs::admit(w, s.quotas.of(w.team), use[w.team], {});
    if (v.admission == jobs::Admission::wait || (blocked && !every)) continue;
    auto slots = cluster::schedule(free, s.demands[static_cast<std::size_t>(w.id - 1)]);
    if (!slots) {
      blocked = true;
      continue;
    }
    for (const auto& sl : (*slots)[0]) {
      auto& node = *std::find_if(free.begin(), free.end(),
                                 [&](const cluster::NodeCapacity& c) { return c.id == sl.node; });
      node.cpus -= 1;
      for (int g : sl.gpus) node.gpus.erase(std::find(node.gpus.begin(), node.gpus.end(), g));
    }
    use[w.team] += w.need;
    ++placed;
  }
  return placed;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::stoi(argv[1]) : 21;
  const Setup s = make_setup();

  // The reference: one second of the head's heartbeats from these nodes, decoded.
  proto::Heartbeat hb;
  hb.node = "n42";
  hb.gpus = std::vector<proto::GpuUseEntry>();
  for (int g = 0; g < kGpus; ++g) hb.gpus->push_back(proto::GpuUseEntry{g, 37, 1ll << 30});
  const auto frames = twinkle::transport::encode_message(twinkle::transport::ClusterMessage{0, hb});
  std::vector<double> beats, blocked, every;
  int placed_blocked = 0, placed_every = 0;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = Clock::now();
    for (int i = 0; i < static_cast<int>(kBeatsPerSecond); ++i) {
      std::vector<zmq::message_t> copy;
      for (const auto& f : frames) copy.emplace_back(f.data(), f.size());
      auto m = twinkle::transport::decode_cluster_message(std::move(copy));
      if (!m.get<proto::Heartbeat>()) return 1;
    }
    beats.push_back(seconds_since(t0));
    t0 = Clock::now();
    placed_blocked = pass(s, false);
    blocked.push_back(seconds_since(t0));
    t0 = Clock::now();
    placed_every = pass(s, true);
    every.push_back(seconds_since(t0));
  }
  const double b = median(beats), p = median(blocked), e = median(every);
  fmt::print(
      "queue of {} jobs (1-16 GPUs each) on {} nodes ({} GPUs, {} CPUs each, half held), "
      "median of {}\n",
      kQueued, kNodes, kGpus, kCpus, rounds);
  fmt::print("  heartbeat load: {:.0f} heartbeats a second decoded in {:.3f} ms\n", kBeatsPerSecond,
             b * 1e3);
  fmt::print(
      "  a pass as the head runs it: {:.3f} ms ({} placed): {:.0f} decisions/s, {:.2f}x "
      "the heartbeat load of a second\n",
      p * 1e3, placed_blocked, kQueued / p, p / b);
  fmt::print(
      "  every job placed (worst case): {:.3f} ms ({} placed): {:.0f} decisions/s, {:.2f}x "
      "the heartbeat load of a second\n",
      e * 1e3, placed_every, kQueued / e, e / b);
  fmt::print("  the head runs a pass every 50 ms: {:.1f}% of a core in the worst case\n",
             e / 0.05 * 100);
  return 0;
}
