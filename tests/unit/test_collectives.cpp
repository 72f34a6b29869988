#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "transports/gloo/communicator.hpp"
#include "transports/shm/communicator.hpp"
#include "transports/zmq/kv.hpp"
#include "twinkle/errors.hpp"

using twinkle::DType;
using twinkle::transport::CommConfig;
using twinkle::transport::Communicator;
using twinkle::transport::KvStore;
using twinkle::transport::ReduceOp;

namespace {

// An in-memory rendezvous store shared by ranks running as threads.
class MemoryStore : public KvStore {
 public:
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard lock(mu_);
    values_[key] = value;
    cv_.notify_all();
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return values_.count(key) > 0; })) {
      throw twinkle::TransportError("key " + key + " not set");
    }
    return values_[key];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
};

enum class Backend { gloo, shm };
const char* name_of(Backend b) { return b == Backend::gloo ? "gloo" : "shm"; }

// Small slots, so that the tests' small buffers still take several rounds.
constexpr std::size_t kTestSlot = 1024;

std::unique_ptr<Communicator> make(Backend b, KvStore& store, const CommConfig& c) {
  if (b == Backend::gloo) return twinkle::transport::create_gloo_communicator(store, c);
  return twinkle::transport::create_shm_communicator(store, c, kTestSlot);
}

// Runs body(rank) on `n` ranks, each a thread.
void on_threads(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// Runs body(comm) on `n` ranks, each a thread with its own communicator named `name`.
void on_ranks(int n, const std::string& name, Backend backend,
              const std::function<void(Communicator&)>& body) {
  MemoryStore store;
  on_threads(n, [&](int r) {
    CommConfig c{name, r, n, "127.0.0.1", std::chrono::seconds(20)};
    auto comm = make(backend, store, c);
    body(*comm);
  });
}

template <class T>
void check_all_ops(int n, Backend backend) {
  const DType dt = twinkle::dtype_of<T>();
  INFO("dtype " << twinkle::dtype_name(dt) << ", world " << n << ", " << name_of(backend));
  std::mutex mu;  // Catch assertions are not thread-safe
  on_ranks(n, "ops", backend, [&](Communicator& c) {
    const int r = c.rank();
    // all_reduce: element i of rank r holds r + i.
    auto fill = [&](std::vector<T>& v) {
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<T>(r + static_cast<int>(i));
    };
    std::vector<T> sum(5), mean(5), mx(5), mn(5);
    fill(sum), fill(mean), fill(mx), fill(mn);
    c.all_reduce(sum.data(), sum.size(), dt, ReduceOp::sum);
    c.all_reduce(mean.data(), mean.size(), dt, ReduceOp::mean);
    c.all_reduce(mx.data(), mx.size(), dt, ReduceOp::max);
    c.all_reduce(mn.data(), mn.size(), dt, ReduceOp::min);
    // broadcast from the last rank.
    std::vector<T> b(3, static_cast<T>(r == n - 1 ? 7 : 0));
    c.broadcast(b.data(), b.size(), dt, n - 1);
    // all_gather: rank r contributes {r, r}.
    std::vector<T> in(2, static_cast<T>(r)), out(2 * static_cast<std::size_t>(n));
    c.all_gather(in.data(), out.data(), 2, dt);
    // reduce_scatter: rank r contributes 1s; each part sums to n.
    std::vector<T> rs_in(3 * static_cast<std::size_t>(n), static_cast<T>(1)), rs_out(3);
    c.reduce_scatter(rs_in.data(), rs_out.data(), 3, dt, ReduceOp::sum);
    c.barrier();

    std::lock_guard lock(mu);
    CHECK(c.size() == n);
    const int ranks_sum = n * (n - 1) / 2;
    for (int i = 0; i < 5; ++i) {
      CHECK(sum[i] == static_cast<T>(ranks_sum + n * i));
      CHECK(mean[i] == static_cast<T>((ranks_sum + n * i) / static_cast<T>(n)));
      CHECK(mx[i] == static_cast<T>(n - 1 + i));
      CHECK(mn[i] == static_cast<T>(i));
    }
    CHECK(b == std::vector<T>(3, static_cast<T>(7)));
    for (int k = 0; k < n; ++k) {
      CHECK(out[2 * k] == static_cast<T>(k));
      CHECK(out[2 * k + 1] == static_cast<T>(k));
    }
    CHECK(rs_out == std::vector<T>(3, static_cast<T>(n)));
  });
}

}  // namespace

TEST_CASE("every operation, dtype and world size 1..8 on both backends", "[collectives]") {
  for (Backend b : {Backend::gloo, Backend::shm}) {
    for (int n = 1; n <= 8; ++n) {
      check_all_ops<float>(n, b);
      check_all_ops<double>(n, b);
      check_all_ops<std::int32_t>(n, b);
      check_all_ops<std::int64_t>(n, b);
    }
  }
}

namespace {

// A value of rank r at index i with mantissa bits to lose, or a small integer.
template <class T>
T sample(int r, std::size_t i) {
  const double x = std::sin(r * 12.9898 + static_cast<double>(i) * 78.233) * 43758.5453;
  const double frac = x - std::floor(x);
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<int>(frac * 2001) - 1000);
  } else {
    return static_cast<T>(frac * 2 - 1);
  }
}

// Every rank's results of one collective, as bytes.
using Results = std::vector<std::vector<std::byte>>;

template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& v) {
  std::vector<std::byte> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <class T>
std::vector<T> values_of(const std::vector<std::byte>& b) {
  std::vector<T> v(b.size() / sizeof(T));
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// Runs all_reduce (4 ops), reduce_scatter (4 ops), all_gather and broadcast of random data on
// both backends; returns, per backend, per collective, every rank's result.
template <class T>
std::map<std::string, Results> run_both(int n, std::size_t count, Backend backend) {
  const DType dt = twinkle::dtype_of<T>();
  std::map<std::string, Results> out;
  std::mutex mu;
  on_ranks(n, "cmp", backend, [&](Communicator& c) {
    const int r = c.rank();
    auto record = [&](const std::string& what, const std::vector<T>& v) {
      std::lock_guard lock(mu);
      auto& slot = out[what];
      slot.resize(static_cast<std::size_t>(n));
      slot[static_cast<std::size_t>(r)] = bytes_of(v);
    };
    auto input = [&](std::size_t len) {
      std::vector<T> v(len);
      for (std::size_t i = 0; i < len; ++i) v[i] = sample<T>(r, i);
      return v;
    };
    const std::size_t all = count * static_cast<std::size_t>(n);
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::mean, ReduceOp::max, ReduceOp::min}) {
      auto v = input(count);
      c.all_reduce(v.data(), count, dt, op);
      record(fmt::format("all_reduce {}", static_cast<int>(op)), v);
      auto in = input(all);
      std::vector<T> part(count);
      c.reduce_scatter(in.data(), part.data(), count, dt, op);
      record(fmt::format("reduce_scatter {}", static_cast<int>(op)), part);
    }
    std::vector<T> gathered(all);
    c.all_gather(input(count).data(), gathered.data(), count, dt);
    record("all_gather", gathered);
    auto b = input(count);
    c.broadcast(b.data(), count, dt, n / 2);
    record("broadcast", b);
    c.barrier();
  });
  return out;
}

template <class T>
void compare_backends(int n, std::size_t count) {
  INFO("dtype " << twinkle::dtype_name(twinkle::dtype_of<T>()) << ", world " << n);
  const auto gloo = run_both<T>(n, count, Backend::gloo);
  const auto shm = run_both<T>(n, count, Backend::shm);
  REQUIRE(gloo.size() == shm.size());
  for (const auto& [what, ranks] : shm) {
    INFO(what);
    // Shared memory: bit-identical on every rank (reduce_scatter gives each rank its own part).
    if (!what.starts_with("reduce_scatter")) {
      for (const auto& r : ranks) CHECK(r == ranks[0]);
    }
    const bool exact = std::is_integral_v<T> || what.ends_with(" 2") || what.ends_with(" 3") ||
                       what == "all_gather" || what == "broadcast";
    // Gloo's reduction order is its own: float sums agree within its rounding.
    const double tol = exact ? 0.0 : 4.0 * n * std::numeric_limits<T>::epsilon();
    std::size_t bad = 0;
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      const auto want = values_of<T>(gloo.at(what)[r]);
      const auto got = values_of<T>(ranks[r]);
      REQUIRE(got.size() == want.size());
      for (std::size_t i = 0; i < got.size(); ++i)
        bad += !(std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i])) <= tol);
    }
    CHECK(bad == 0);
  }
}

}  // namespace

TEST_CASE("shared memory and Gloo agree on random data, pipelined over several rounds",
          "[collectives]") {
  for (int n = 1; n <= 8; ++n) {
    compare_backends<float>(n, 1000);
    compare_backends<double>(n, 1000);
    compare_backends<std::int32_t>(n, 1000);
    compare_backends<std::int64_t>(n, 1000);
  }
}

TEST_CASE("shared-memory sums are in rank order, whatever the timing", "[collectives]") {
  // Sums of floats depend on their order; ranks 0..n-1 in turn is the contract.
  const int n = 5;
  const std::size_t count = 3000;
  std::vector<float> want(count);
  for (std::size_t i = 0; i < count; ++i) {
    float acc = sample<float>(0, i);
    for (int r = 1; r < n; ++r) acc += sample<float>(r, i);
    want[i] = acc;
  }
  std::mutex mu;
  int done = 0;
  for (int rep = 0; rep < 3; ++rep) {
    on_ranks(n, fmt::format("order{}", rep), Backend::shm, [&](Communicator& c) {
      std::vector<float> v(count);
      for (std::size_t i = 0; i < count; ++i) v[i] = sample<float>(c.rank(), i);
      // Ranks arrive in a different order on each repetition.
      if (c.rank() == rep) std::this_thread::yield();
      c.all_reduce(v.data(), count, DType::f32, ReduceOp::sum);
      std::lock_guard lock(mu);
      CHECK(std::memcmp(v.data(), want.data(), count * sizeof(float)) == 0);
      ++done;
    });
  }
  CHECK(done == 3 * n);
}

TEST_CASE("16-bit floats reduce on shared memory", "[collectives]") {
  // 1 and 3 are exact in float16 and bfloat16.
  for (DType dt : {DType::f16, DType::bf16}) {
    INFO(twinkle::dtype_name(dt));
    const std::uint16_t one = dt == DType::f16 ? 0x3c00 : 0x3f80;
    const std::uint16_t three = dt == DType::f16 ? 0x4200 : 0x4040;
    std::mutex mu;
    std::vector<std::vector<std::uint16_t>> got;
    on_ranks(3, "half", Backend::shm, [&](Communicator& c) {
      std::vector<std::uint16_t> sum(700, one);
      std::vector<std::uint16_t> m(700, c.rank() == 1 ? three : one);
      c.all_reduce(sum.data(), sum.size(), dt, ReduceOp::sum);
      c.all_reduce(m.data(), m.size(), dt, ReduceOp::max);
      std::lock_guard lock(mu);
      got.push_back(sum);
      got.push_back(m);
    });
    REQUIRE(got.size() == 6);
    for (std::size_t i = 0; i < got.size(); i += 2) {
      CHECK(got[i] == std::vector<std::uint16_t>(700, three));
      CHECK(got[i + 1] == std::vector<std::uint16_t>(700, three));
    }
  }
}

TEST_CASE("unsupported reductions and roots are refused with the reason", "[collectives]") {
  for (Backend b : {Backend::gloo, Backend::shm}) {
    INFO(name_of(b));
    std::mutex mu;
    std::vector<std::string> errors;
    auto error_of = [&](const std::function<void()>& f) {
      try {
        f();
      } catch (const std::exception& e) {
        std::lock_guard lock(mu);
        errors.push_back(e.what());
      }
    };
    on_ranks(2, "bad", b, [&](Communicator& c) {
      bool flag = true;
      float x = 0;
      error_of([&] { c.all_reduce(&flag, 1, DType::boolean, ReduceOp::sum); });
      error_of([&] { c.broadcast(&x, 1, DType::f32, 5); });
      c.barrier();  // neither rank tears down before both finished connecting
    });
    REQUIRE(errors.size() == 4);
    int bool_errors = 0, root_errors = 0;
    for (const auto& e : errors) {
      bool_errors += e.find("bool reductions are not supported on cpu groups") != std::string::npos;
      root_errors += e == "broadcast root 5 is outside the communicator of 2";
    }
    CHECK(bool_errors == 2);
    CHECK(root_errors == 2);
  }
}

TEST_CASE("a peer that never joins fails the rendezvous within the timeout", "[collectives]") {
  MemoryStore store;
  CommConfig c{"lonely", 0, 2, "127.0.0.1", std::chrono::milliseconds(300)};
  CHECK_THROWS_AS(twinkle::transport::create_gloo_communicator(store, c), twinkle::TransportError);
  CommConfig s{"lonely-shm", 0, 2, "127.0.0.1", std::chrono::milliseconds(300)};
  CHECK_THROWS_WITH(twinkle::transport::create_shm_communicator(store, s),
                    "connecting on lonely-shm failed: rank(s) 1 did not arrive within 300 ms");
}

TEST_CASE("a peer that leaves mid-collective fails the others instead of hanging",
          "[collectives]") {
  MemoryStore store;
  std::string error, leaver_error;
  std::thread leaver([&] {
    try {
      CommConfig c{"leave", 1, 2, "127.0.0.1", std::chrono::seconds(20)};
      auto comm = twinkle::transport::create_gloo_communicator(store, c);
      // Leaving while rank 0 still connects would fail its rendezvous, not its collective.
      store.get("test/rank0-connected", std::chrono::seconds(20));
      comm.reset();  // gone before the collective
    } catch (const std::exception& e) {
      leaver_error = e.what();
    }
  });
  // The leaver is joined however rank 0's part ends.
  struct Join {
    MemoryStore& store;
    std::thread& thread;
    ~Join() {
      store.set("test/rank0-connected", "1");
      if (thread.joinable()) thread.join();
    }
  } join{store, leaver};
  CommConfig c{"leave", 0, 2, "127.0.0.1", std::chrono::seconds(5)};
  auto comm = twinkle::transport::create_gloo_communicator(store, c);
  store.set("test/rank0-connected", "1");
  leaver.join();
  REQUIRE(leaver_error.empty());
  std::vector<float> v(1024, 1.0f);
  try {
    comm->all_reduce(v.data(), v.size(), DType::f32, ReduceOp::sum);
  } catch (const twinkle::TransportError& e) {
    error = e.what();
  }
  CHECK_THAT(error,
             Catch::StartsWith("all_reduce on leave failed (a peer died, hung or disconnected)"));
  CHECK_THROWS_WITH(comm->barrier(), Catch::Contains("failed earlier and cannot be used again"));
}

TEST_CASE("a shared-memory peer that leaves fails the others, naming it", "[collectives]") {
  MemoryStore store;
  std::thread leaver([&] {
    CommConfig c{"leave-shm", 1, 2, "127.0.0.1", std::chrono::seconds(20)};
    auto comm = twinkle::transport::create_shm_communicator(store, c);
  });
  CommConfig c{"leave-shm", 0, 2, "127.0.0.1", std::chrono::seconds(20)};
  auto comm = twinkle::transport::create_shm_communicator(store, c);
  leaver.join();
  std::vector<float> v(1024, 1.0f);
  CHECK_THROWS_WITH(
      comm->all_reduce(v.data(), v.size(), DType::f32, ReduceOp::sum),
      "all_reduce on leave-shm failed: rank 1 left the communicator (it failed or was destroyed)");
  CHECK_THROWS_WITH(comm->barrier(), Catch::Contains("failed earlier and cannot be used again"));
}

namespace {

// Shared-memory collectives mapped or held open by this process.
int collective_segments_here() {
  int n = 0;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    n += line.find("twinkle-collectives") != line.npos;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    n += std::filesystem::read_symlink(e.path(), ec).string().find("twinkle-collectives") !=
         std::string::npos;
  }
  return n;
}

// Reads what `fd` delivers until it closes or `deadline` passes.
std::string read_until_closed(int fd, std::chrono::steady_clock::time_point deadline) {
  std::string got;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) return got;
    char buf[512];
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) return got;
    got.append(buf, static_cast<std::size_t>(n));
  }
}

}  // namespace

TEST_CASE("a peer SIGKILLed mid-collective fails the others quickly and nothing stays mapped",
          "[collectives]") {
  const int n = 3, victim = 2;
  const auto path = std::filesystem::temp_directory_path() / fmt::format("twk-kv-{}", getpid());
  const std::string endpoint = "ipc://" + path.string();
  zmq::context_t ctx;
  twinkle::transport::KvServer server(ctx, endpoint);
  std::vector<pid_t> pids;
  std::vector<int> pipes;
  for (int r = 0; r < n; ++r) {
    int p[2];
    REQUIRE(pipe(p) == 0);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      close(p[0]);
      std::string report;
      try {
        zmq::context_t cctx;
        twinkle::transport::KvClient kv(cctx, endpoint);
        CommConfig c{"killed", r, n, "127.0.0.1", std::chrono::seconds(30)};
        auto comm = twinkle::transport::create_shm_communicator(kv, c);
        std::vector<float> v(1 << 20, 1.0f);
        try {
          for (int i = 0;; ++i) {
            comm->all_reduce(v.data(), v.size(), DType::f32, ReduceOp::sum);
            if (i == 0 && r == victim) (void)!write(p[1], "ready", 5);
          }
        } catch (const std::exception& e) {
          report = e.what();
        }
        comm.reset();
        report += fmt::format("|held {}", collective_segments_here());
      } catch (const std::exception& e) {
        report = std::string("setup: ") + e.what();
      }
      (void)!write(p[1], report.data(), report.size());
      _exit(0);
    }
    close(p[1]);
    pids.push_back(pid);
    pipes.push_back(p[0]);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  std::string ready;
  pollfd p{pipes[victim], POLLIN, 0};
  REQUIRE(poll(&p, 1, 20000) == 1);
  char buf[8];
  REQUIRE(read(pipes[victim], buf, 5) == 5);
  const auto killed_at = std::chrono::steady_clock::now();
  kill(pids[victim], SIGKILL);
  std::vector<std::string> reports;
  for (int r = 0; r < n; ++r) {
    if (r != victim) reports.push_back(read_until_closed(pipes[r], deadline));
  }
  const auto took = std::chrono::steady_clock::now() - killed_at;
  for (int r = 0; r < n; ++r) {
    close(pipes[r]);
    waitpid(pids[r], nullptr, 0);
  }
  std::filesystem::remove(path);
  const std::string want = fmt::format(
      "all_reduce on killed failed: rank 2 (pid {}) exited during the collective|held 0",
      pids[victim]);
  for (const auto& r : reports) CHECK(r == want);
  CHECK(took < std::chrono::seconds(30));  // the communicators' timeout
  CHECK(collective_segments_here() == 0);
}

TEST_CASE("the driver's rendezvous store answers gets that came before the set",
          "[collectives][kv]") {
  zmq::context_t ctx;
  twinkle::transport::KvServer server(ctx, "inproc://kv-test");
  twinkle::transport::KvClient a(ctx, "inproc://kv-test"), b(ctx, "inproc://kv-test");
  std::string got;
  std::thread waiter([&] { got = a.get("k", std::chrono::seconds(10)); });
  b.set("k", std::string("v\0w", 3));
  waiter.join();
  CHECK(got == std::string("v\0w", 3));
  CHECK(b.get("k", std::chrono::seconds(1)) == got);
  CHECK_THROWS_WITH(a.get("missing", std::chrono::milliseconds(100)),
                    "rendezvous: key \"missing\" was not set within 100 ms (a peer did not join)");
}
