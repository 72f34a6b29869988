// The plugin `twinkle-bench` runs: each driver entry measures one figure from inside the driver and
// prints it as "FIGURE name value unit" for the bench executable to collect.
#include <twinkle/plugin.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

using twinkle::Context;
using twinkle::Tensor;
using twinkle::Value;
using Clock = std::chrono::steady_clock;

struct Bench {
  explicit Bench(Context&) {}
  int noop(Context&) { return 0; }
  int one(Context&) { return 1; }
  // Receives its slice of a large tensor; touches one byte per page so the data is really there.
  std::int64_t take(Context&, const Tensor& t) {
    std::int64_t sum = 0;
    const auto* p = reinterpret_cast<const unsigned char*>(t.data());
    for (std::size_t i = 0; i < t.nbytes(); i += 4096) sum += p[i];
    return static_cast<std::int64_t>(t.nbytes()) + sum * 0;
  }
  double all_reduce(Context& ctx, int mib, int reps) {
    std::vector<float> buf(static_cast<std::size_t>(mib) << 18, 1.0f);
    auto comm = ctx.comm();
    comm.all_reduce(std::span<float>(buf));  // warm-up: connect
    comm.barrier();
    const auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i) comm.all_reduce(std::span<float>(buf));
    return std::chrono::duration<double>(Clock::now() - t0).count() / reps;
  }
  // Seconds of one broadcast of `mib` from rank 0 of communicator `name` ("": the group), the
  // slowest member's time.
  double broadcast(Context& ctx, const std::string& name, int mib, int reps) {
    auto comm = ctx.comm(name);
    std::vector<float> buf(static_cast<std::size_t>(mib) << 18, comm.rank() == 0 ? 1.0f : 0.0f);
    comm.broadcast(std::span<float>(buf));  // warm-up: connect, fault the pages in
    comm.barrier();
    const auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i) comm.broadcast(std::span<float>(buf));
    comm.barrier();
    return std::chrono::duration<double>(Clock::now() - t0).count() / reps;
  }
  // Round trips from this worker to another group's worker (`target`, a handle the driver
  // passed): p50 and p99 in microseconds, after 200 warm-up calls.
  Value peer_rtt(Context& ctx, const Value& target, int n) {
    auto h = ctx.handle(target);
    for (int i = 0; i < 200; ++i) h.call("noop").get();
    std::vector<double> rtt;
    for (int i = 0; i < n; ++i) {
      const auto t0 = Clock::now();
      h.call("noop").get();
      rtt.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::sort(rtt.begin(), rtt.end());
    return Value::map({{"p50", rtt[rtt.size() / 2]}, {"p99", rtt[rtt.size() * 99 / 100]}});
  }
  // Seconds of one call that hands `mib` MiB to another group's worker (`target`, a handle),
  // best of `reps`, after one warm-up.
  double peer_send(Context& ctx, const Value& target, int mib, int reps) {
    auto h = ctx.handle(target);
    Tensor t(twinkle::DType::f32, {static_cast<std::int64_t>(mib) << 18});
    auto s = t.mutable_span<float>();
    for (std::size_t i = 0; i < s.size(); i += 1024) s[i] = 1.0f;
    h.call("take", Tensor(twinkle::DType::f32, {8 * 1024})).get();
    double best = 1e300;
    for (int i = 0; i < reps; ++i) {
      const auto t0 = Clock::now();
      if (h.call("take", t).get().as<std::int64_t>() != static_cast<std::int64_t>(t.nbytes()))
        throw std::runtime_error("the peer lost bytes");
      best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return best;
  }
  // One 1-float all_reduce: connects the group's collective on first use.
  double reduce_one(Context& ctx) {
    float x = 1.0f;
    ctx.comm().all_reduce(std::span<float>(&x, 1));
    return x;
  }
};
TWINKLE_CLASS(Bench, twinkle::execute::all);
TWINKLE_METHOD(Bench, noop, twinkle::dispatch::all, twinkle::collect::first);
TWINKLE_METHOD(Bench, one, twinkle::dispatch::all, twinkle::collect::sum);
TWINKLE_METHOD(Bench, take, twinkle::dispatch::slice_dp, twinkle::collect::sum);
TWINKLE_METHOD(Bench, all_reduce, twinkle::dispatch::all, twinkle::collect::first);
TWINKLE_METHOD(Bench, broadcast, twinkle::dispatch::all, twinkle::collect::first);
TWINKLE_METHOD(Bench, reduce_one, twinkle::dispatch::all, twinkle::collect::first);
TWINKLE_METHOD(Bench, peer_rtt, twinkle::dispatch::all, twinkle::collect::first,
               twinkle::execute::first);
TWINKLE_METHOD(Bench, peer_send, twinkle::dispatch::all, twinkle::collect::first,
               twinkle::execute::first);

namespace {

void figure(const char* name, double value, const char* unit) {
  std::printf("FIGURE %s %.6g %s\n", name, value, unit);
  std::fflush(stdout);
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(p * static_cast<double>(v.size() - 1))];
}

double calls_per_second(twinkle::Handle& h, int n) {
  std::vector<twinkle::LazyCollect> pending;
  pending.reserve(static_cast<std::size_t>(n));
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) pending.push_back(h.call("noop"));
  for (auto& p : pending) p.get();
  return n / std::chrono::duration<double>(Clock::now() - t0).count();
}

// `n` round trips of a no-op call after 500 to warm up: their p50 and p99.
void round_trips(twinkle::Handle& one, int n) {
  for (int i = 0; i < 500; ++i) one.call("noop").get();
  std::vector<double> rtt;
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    one.call("noop").get();
    rtt.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  figure("call_rtt_p50", percentile(rtt, 0.5), "us");
  figure("call_rtt_p99", percentile(rtt, 0.99), "us");
}

// `n` calls of `one` to the 8 workers of `eight` (all + sum) after 200 to warm up: their p50.
void fan_out(twinkle::Handle& eight, int n) {
  for (int i = 0; i < 200; ++i) eight.call("one").get();
  std::vector<double> fan;
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    const int s = eight.call("one").get().as<int>();
    fan.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    if (s != 8) throw std::runtime_error("fan-out sum is not 8");
  }
  figure("fanout_8_p50", percentile(fan, 0.5), "us");
}

}  // namespace

TWINKLE_DRIVER(calls, twinkle::Driver& d) {
  const int n = d.args()["calls"].as<int>();
  auto one = d.create<Bench>("one");
  auto eight = d.create<Bench>("eight");
  round_trips(one, n);
  figure("pipelined_1_worker", calls_per_second(one, 5 * n), "calls/s");
  figure("pipelined_8_workers", calls_per_second(eight, n), "calls/s");
  fan_out(eight, n / 2);
}

// Only round trips to one worker, for profiling: `twinkle run bench.toml --set job.driver=rtt`.
TWINKLE_DRIVER(rtt, twinkle::Driver& d) {
  const int n = d.args()["calls"].as<int>();
  auto one = d.create<Bench>("one");
  round_trips(one, n);
}

// Only the pipelined figures, for profiling one phase: `twinkle run bench.toml --set
// job.driver=pipelined` under perf.
TWINKLE_DRIVER(pipelined, twinkle::Driver& d) {
  const int n = d.args()["calls"].as<int>();
  auto one = d.create<Bench>("one");
  auto eight = d.create<Bench>("eight");
  for (int i = 0; i < 500; ++i) one.call("noop").get();
  figure("pipelined_1_worker", calls_per_second(one, 5 * n), "calls/s");
  figure("pipelined_8_workers", calls_per_second(eight, n), "calls/s");
}

// Only the fan-out to 8, for profiling: `twinkle run bench.toml --set job.driver=fanout`.
TWINKLE_DRIVER(fanout, twinkle::Driver& d) {
  const int n = d.args()["calls"].as<int>();
  auto eight = d.create<Bench>("eight");
  fan_out(eight, n);
}

TWINKLE_DRIVER(dispatch, twinkle::Driver& d) {
  const std::int64_t mib = d.args()["dispatch_mib"].as<std::int64_t>();
  auto eight = d.create<Bench>("eight");
  Tensor t(twinkle::DType::f32, {mib * 1024 * 256});
  auto s = t.mutable_span<float>();
  for (std::size_t i = 0; i < s.size(); i += 1024) s[i] = 1.0f;
  eight.call("take", Tensor(twinkle::DType::f32, {8 * 1024})).get();  // warm-up
  double best = 1e300;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    const auto got = eight.call("take", t).get().as<std::int64_t>();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    if (got != static_cast<std::int64_t>(t.nbytes()))
      throw std::runtime_error("dispatch lost bytes");
  }
  figure("dispatch_bandwidth", static_cast<double>(t.nbytes()) / best / 1e9, "GB/s");
}

// A tensor of dispatch_mib to the two workers of group "two" (slice_dp: half each), best of 3.
TWINKLE_DRIVER(dispatch_two, twinkle::Driver& d) {
  const std::int64_t mib = d.args()["dispatch_mib"].as<std::int64_t>();
  auto two = d.create<Bench>("two");
  Tensor t(twinkle::DType::f32, {mib * 1024 * 256});
  two.call("take", Tensor(twinkle::DType::f32, {8 * 1024})).get();  // warm-up
  double best = 1e300;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    const auto got = two.call("take", t).get().as<std::int64_t>();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    if (got != static_cast<std::int64_t>(t.nbytes())) throw std::runtime_error("lost bytes");
  }
  figure("dispatch_two_bandwidth", static_cast<double>(t.nbytes()) / best / 1e9, "GB/s");
}

TWINKLE_DRIVER(first_call, twinkle::Driver& d) {
  auto eight = d.create<Bench>("eight");
  eight.call("noop").get();
  std::printf("FIRST CALL DONE\n");
  std::fflush(stdout);
}

TWINKLE_DRIVER(noop, twinkle::Driver&) {}

// Start, one all_reduce over every worker of the only group, exit: the launch figure.
TWINKLE_DRIVER(launch, twinkle::Driver& d) {
  auto h = d.create<Bench>("eight");
  const double sum = h.call("reduce_one").get().as<double>();
  if (sum != 8.0) throw std::runtime_error("all_reduce of ones over 8 workers is not 8");
}

TWINKLE_DRIVER(all_reduce, twinkle::Driver& d) {
  const int mib = d.args()["all_reduce_mib"].as<int>();
  const int reps = d.args()["all_reduce_reps"].as<int>();
  for (const char* g : {"two", "eight"}) {
    auto h = d.create<Bench>(g);
    const int n = std::string(g) == "two" ? 2 : 8;
    const double t = h.call("all_reduce", mib, reps).get().as<double>();
    // nccl-tests' bus bandwidth: bytes x 2(n-1)/n per second.
    const double busbw = static_cast<double>(mib) * 1048576.0 * 2.0 * (n - 1) / n / t / 1e9;
    figure(n == 2 ? "all_reduce_busbw_2" : "all_reduce_busbw_8", busbw, "GB/s");
  }
}

TWINKLE_DRIVER(broadcast, twinkle::Driver& d) {
  const int mib = d.args()["broadcast_mib"].as<int>();
  const int reps = d.args()["all_reduce_reps"].as<int>();
  auto h = d.create<Bench>("eight");
  const double t = h.call("broadcast", "", mib, reps).get().as<double>();
  // Bytes that reach each receiver per second (nccl-tests' algbw and busbw for broadcast).
  figure("broadcast_8", static_cast<double>(mib) * 1048576.0 / t / 1e9, "GB/s");
}

// Weight sync after a training step: `broadcast_mib` from a trainer's rank 0 (group "one") to
// both workers of a sampler (group "two") over a communicator across the groups.
TWINKLE_DRIVER(weight_sync, twinkle::Driver& d) {
  const int mib = d.args()["broadcast_mib"].as<int>();
  const int reps = d.args()["all_reduce_reps"].as<int>();
  auto trainer = d.create<Bench>("one");
  auto sampler = d.create<Bench>("two");
  d.communicator("weights", {{"one", {0}}, {"two"}});
  auto x = trainer.call("broadcast", "weights", mib, reps);
  auto y = sampler.call("broadcast", "weights", mib, reps);
  const double t = std::max(x.get().as<double>(), y.get().as<double>());
  figure("weight_sync_2", static_cast<double>(mib) * 1048576.0 / t / 1e9, "GB/s");
}

// Calls between groups: worker two:0 calls the worker of group "one" directly, worker to worker.
TWINKLE_DRIVER(peer_calls, twinkle::Driver& d) {
  const int n = d.args()["calls"].as<int>();
  auto target = d.create<Bench>("one");
  auto caller = d.create<Bench>("two");
  const Value r = caller.call("peer_rtt", target, n).get();
  figure("peer_rtt_p50", r["p50"].as<double>(), "us");
  figure("peer_rtt_p99", r["p99"].as<double>(), "us");
  const int mib = d.args()["broadcast_mib"].as<int>();
  const double s = caller.call("peer_send", target, mib, 3).get().as<double>();
  figure("peer_send", static_cast<double>(mib) * 1048576.0 / s / 1e9, "GB/s");
}

// Restarts (bench/restart.sh): a replica with `mib` MiB of state. Its save gives its tensor (the
// runtime copies it once, into shared memory for a local replacement); its load keeps the tensor
// it is given.
class Heavy {
 public:
  Heavy(Context&, const Value& args)
      : state_(twinkle::DType::f32, {args[0]["mib"].as<std::int64_t>() << 18}) {
    auto s = state_.mutable_span<float>();
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<float>(i % 1000);
  }
  Value save(Context&) {
    return Value::map({{"w", state_}});  // shares the memory: no copy here
  }
  void load(Context&, const Value& state) { state_ = state["w"].tensor(); }
  void crash(Context& ctx, int rank) {
    if (ctx.rank() == rank) std::abort();
  }
  // Every 997th element, summed: the same on every replica whose state is the same.
  Value checksum(Context&) {
    double sum = 0;
    const auto s = state_.span<float>();
    for (std::size_t i = 0; i < s.size(); i += 997) sum += s[i];
    return Value::list({sum});
  }

 private:
  Tensor state_;
};

TWINKLE_CLASS(Heavy, twinkle::execute::all);
TWINKLE_STATE(Heavy, save, load);
TWINKLE_METHOD(Heavy, crash, twinkle::dispatch::all, twinkle::collect::first);
TWINKLE_METHOD(Heavy, checksum, twinkle::dispatch::all, twinkle::collect::flatten);

// Rank 1 of group "pair" (max_restarts) aborts; the group comes back and both replicas hold the
// same state. Prints the memcpy of the same bytes as FIGURE memcpy.
TWINKLE_DRIVER(peer_recover, twinkle::Driver& d) {
  const std::int64_t mib = d.args()["state_mib"].as<std::int64_t>();
  auto h = d.create<Heavy>("pair", Value::map({{"mib", mib}}));
  {
    // memcpy of the same bytes into memory touched before, and into memory never touched (which
    // pays for the pages, as a copy into new shared memory does).
    const std::size_t n = static_cast<std::size_t>(mib) << 20;
    std::vector<char> a(n, 1), b(n, 0);
    double warm = 1e9, cold = 1e9;
    for (int rep = 0; rep < 3; ++rep) {
      auto t0 = Clock::now();
      std::memcpy(b.data(), a.data(), n);
      warm = std::min(warm, std::chrono::duration<double>(Clock::now() - t0).count());
      std::unique_ptr<char[]> fresh(new char[n]);
      t0 = Clock::now();
      std::memcpy(fresh.get(), a.data(), n);
      cold = std::min(cold, std::chrono::duration<double>(Clock::now() - t0).count());
      if (fresh[n - 1] != 1) throw std::runtime_error("memcpy");
    }
    std::printf("FIGURE memcpy %.6f s\nFIGURE memcpy_fresh %.6f s\n", warm, cold);
  }
  try {
    h.call("crash", 1).get();
    throw std::runtime_error("rank 1 did not crash");
  } catch (const twinkle::WorkerLost&) {
  }
  const Value sums = h.call("checksum").get();
  if (sums.size() != 2 || sums[0].as<double>() != sums[1].as<double>())
    std::printf("CHECKSUMS DIFFER\n");
  std::fflush(stdout);
}

TWINKLE_PLUGIN("twinkle-bench", "1.0.0");
