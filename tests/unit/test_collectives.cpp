#include <catch2/catch.hpp>

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "transports/gloo/communicator.hpp"
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

// Runs body(comm) on `n` ranks, each a thread with its own communicator named `name`.
void on_ranks(int n, const std::string& name, const std::function<void(Communicator&)>& body) {
  MemoryStore store;
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        CommConfig c{name, r, n, "127.0.0.1", std::chrono::seconds(20)};
        auto comm = twinkle::transport::create_gloo_communicator(store, c);
        body(*comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

template <class T>
void check_all_ops(int n) {
  const DType dt = twinkle::dtype_of<T>();
  INFO("dtype " << twinkle::dtype_name(dt) << ", world " << n);
  std::mutex mu;  // Catch assertions are not thread-safe
  on_ranks(n, "ops", [&](Communicator& c) {
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

TEST_CASE("every operation, dtype and world size 1..4 over Gloo", "[collectives]") {
  for (int n = 1; n <= 4; ++n) {
    check_all_ops<float>(n);
    check_all_ops<double>(n);
    check_all_ops<std::int32_t>(n);
    check_all_ops<std::int64_t>(n);
  }
}

TEST_CASE("unsupported reductions and roots are refused with the reason", "[collectives]") {
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
  on_ranks(2, "bad", [&](Communicator& c) {
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

TEST_CASE("a peer that never joins fails the rendezvous within the timeout", "[collectives]") {
  MemoryStore store;
  CommConfig c{"lonely", 0, 2, "127.0.0.1", std::chrono::milliseconds(300)};
  CHECK_THROWS_AS(twinkle::transport::create_gloo_communicator(store, c), twinkle::TransportError);
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
