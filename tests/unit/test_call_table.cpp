#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/runtime/call_table.hpp"
#include "transports/zmq/channel.hpp"

using namespace twinkle;
using namespace twinkle::core;
using namespace std::chrono_literals;
using transport::ChannelEvent;
using transport::MsgType;
namespace proto = transport::proto;

namespace {

// What the fake channel records of a message the table sent: its type, id and fields as a Value
// (payloads decoded), so that tests read what each worker was sent.
struct SentMessage {
  MsgType type = MsgType::hello;
  std::uint64_t id = 0;
  Value body;
};

SentMessage sent_view(const transport::Message& m) {
  return SentMessage{m.type(), m.id, proto::to_value(m.body)};
}

// The table's create/call/wait with the arguments and the result as Values.
std::uint64_t create_on(CallTable& table, const plugins::ClassInfo& cls, std::size_t group,
                        const Value& args, std::optional<PeerCaller> peer = std::nullopt) {
  return table.create(cls, group, encode(args), peer);
}
std::uint64_t call_on(CallTable& table, std::uint64_t instance, std::string_view method,
                      const Value& args, const std::string& caller,
                      std::optional<PeerCaller> peer = std::nullopt,
                      const std::vector<proto::ChainLink>& chain = {}) {
  return table.call(instance, method, encode(args), caller, peer, chain);
}
Value wait_on(CallTable& table, std::uint64_t future) { return decode(table.wait(future)); }

// A CallChannel in memory: it records what the driver sends per peer and delivers the events
// the test queues (replies, lost workers). `on_send` lets a test answer as a worker would.
class FakeChannel : public transport::CallChannel {
 public:
  std::map<std::size_t, std::vector<SentMessage>> sent;
  std::function<void(std::size_t peer, const SentMessage& m)> on_send;
  std::function<void()> on_next;  // runs as next() starts (inside a wait)

  const std::string& endpoint() const override { return endpoint_; }
  void send(std::size_t peer, const transport::Message& m) override {
    sent[peer].push_back(sent_view(m));
    if (on_send) on_send(peer, sent[peer].back());
  }
  std::optional<ChannelEvent> next(std::chrono::milliseconds timeout) override {
    if (on_next) on_next();
    std::unique_lock lock(mu_);
    auto any = [&] { return !events_.empty(); };
    if (timeout.count() < 0) {
      cv_.wait(lock, any);
    } else if (!cv_.wait_for(lock, timeout, any)) {
      return std::nullopt;
    }
    ChannelEvent e = std::move(events_.front());
    events_.pop_front();
    return e;
  }
  void lost(std::size_t peer, std::string reason, std::vector<std::size_t> with = {}) override {
    ChannelEvent e;
    e.kind = ChannelEvent::Kind::lost;
    e.peer = peer;
    e.reason = std::move(reason);
    e.with = std::move(with);
    push(std::move(e));
  }
  void wake() override {
    ChannelEvent e;
    e.kind = ChannelEvent::Kind::wake;
    push(std::move(e));
  }
  std::uint64_t dropped() const override { return 0; }
  EncodedValue adopt(const twk_value_v1& v) override { return copy_encoded(v); }

  // A message from `peer`, as the channel would deliver it.
  void deliver(std::size_t peer, std::uint64_t id, proto::Control body) {
    ChannelEvent e;
    e.peer = peer;
    e.message = transport::Message{id, std::move(body)};
    push(std::move(e));
  }
  // The hello of worker "g:<peer>" (the table's names in these tests).
  void hello(std::size_t peer, int pid, const std::string& host = "h") {
    deliver(peer, 0, proto::Hello{"g:" + std::to_string(peer), "g", 0, pid, host, ""});
  }
  void created(std::size_t peer, std::uint64_t id, std::optional<std::string> error = {}) {
    deliver(peer, id, proto::Created{std::move(error)});
  }
  void reply(std::size_t peer, std::uint64_t id, Value value) {
    deliver(peer, id, proto::Reply{std::nullopt, encode(value)});
  }
  void reply_error(std::size_t peer, std::uint64_t id, const std::string& error) {
    deliver(peer, id, proto::Reply{error, {}});
  }
  // What `peer` was sent last, of type `type`.
  const SentMessage& last(std::size_t peer, MsgType type) {
    auto& list = sent[peer];
    for (auto it = list.rbegin(); it != list.rend(); ++it) {
      if (it->type == type) return *it;
    }
    static const SentMessage none;
    FAIL("peer " << peer << " was sent no " << transport::to_string(type));
    return none;
  }
  std::size_t count(std::size_t peer, MsgType type) {
    std::size_t n = 0;
    for (const auto& m : sent[peer]) n += m.type == type;
    return n;
  }

 private:
  void push(ChannelEvent e) {
    {
      std::lock_guard lock(mu_);
      events_.push_back(std::move(e));
    }
    cv_.notify_all();
  }

  std::string endpoint_ = "fake://";
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ChannelEvent> events_;
};

plugins::MethodInfo method(std::string name, Dispatch d, Execute e, Collect c,
                           double timeout_s = 0) {
  plugins::MethodInfo m;
  m.name = std::move(name);
  m.dispatch = d;
  m.execute = e;
  m.execute_from_class = false;
  m.collect = c;
  m.timeout_s = timeout_s;
  return m;
}

// Class C with a method per case the tests need.
plugins::ClassInfo class_c() {
  plugins::ClassInfo c;
  c.name = "C";
  c.methods = {
      method("m", Dispatch::all, Execute::all, Collect::sum),
      method("slice", Dispatch::slice, Execute::all, Collect::none),
      method("slice_dp", Dispatch::slice_dp, Execute::all, Collect::none),
      method("first", Dispatch::slice, Execute::first, Collect::first),
      method("mean", Dispatch::all, Execute::all, Collect::mean),
      method("flatten", Dispatch::all, Execute::all, Collect::flatten),
      method("quick", Dispatch::all, Execute::all, Collect::none, 0.05),
  };
  return c;
}

// One group "g" of four workers, mesh dp=2 x tp=2 (data ranks: workers 0,1 -> 0; 2,3 -> 1),
// channel peers 0..3, hellos with pid 41 + index on host "h".
struct Table {
  FakeChannel channel;
  plugins::ClassInfo cls = class_c();
  CallTable table;

  explicit Table(double timeout_s = 5)
      : table(channel, {GroupInfo{"g", DeviceMesh({{"dp", 2}, {"tp", 2}}), {0, 1, 2, 3}}},
              workers(), {}, timeout_s) {}

  static std::vector<WorkerInfo> workers() {
    std::vector<WorkerInfo> w;
    for (int i = 0; i < 4; ++i) {
      WorkerInfo info;
      info.name = "g:" + std::to_string(i);
      info.index = i;
      w.push_back(info);
    }
    return w;
  }

  void start() {
    for (std::size_t p = 0; p < 4; ++p) channel.hello(p, 41 + static_cast<int>(p));
    table.start(5s, [](const WorkerInfo& w) {
      proto::Welcome welcome;
      welcome.self = static_cast<std::uint64_t>(w.index);
      return welcome;
    });
  }

  // Every worker acknowledges constructors (peer 1 with `ctor_error` when given).
  std::uint64_t create(std::optional<std::string> ctor_error = std::nullopt) {
    channel.on_send = [&, ctor_error](std::size_t peer, const SentMessage& m) {
      if (m.type != MsgType::create) return;
      if (peer == 1 && ctor_error) {
        channel.created(peer, m.id, *ctor_error);
      } else {
        channel.created(peer, m.id);
      }
    };
    return create_on(table, cls, 0, Value::list());
  }

  // Starts, creates, and from then on every worker answers calls with answer(peer, args).
  std::uint64_t ready(std::function<Value(std::size_t, const Value&)> answer) {
    start();
    const std::uint64_t inst = create();
    channel.on_send = [this, answer](std::size_t peer, const SentMessage& m) {
      if (m.type == MsgType::call) channel.reply(peer, m.id, answer(peer, m.body["args"]));
    };
    return inst;
  }

  // The message of the CallError that `fn` raises.
  static std::string error_of(const std::function<void()>& fn) {
    try {
      fn();
    } catch (const CallError& e) {
      return e.what();
    }
    FAIL("no CallError");
    return {};
  }
};

Value ints(std::initializer_list<int> v) {
  Value out = Value::list();
  for (int i : v) out.push_back(i);
  return out;
}

}  // namespace

TEST_CASE("start: hellos fill in pid and host; each worker gets its welcome", "[call_table]") {
  Table t;
  t.start();
  for (std::size_t p = 0; p < 4; ++p) {
    const WorkerInfo& w = t.table.workers()[p];
    CHECK(w.ready);
    CHECK(w.pid == 41 + static_cast<int>(p));
    CHECK(w.host == "h");
    CHECK(t.channel.last(p, MsgType::welcome).body["self"] == Value(static_cast<int>(p)));
  }
  CHECK(t.table.worker_label(0, 1) == "group g rank 1 (host h, pid 42)");
  CHECK(t.table.find_group("g") == 0u);
  CHECK_FALSE(t.table.find_group("h"));
}

TEST_CASE("start: a worker lost before its hello fails the start, naming it", "[call_table]") {
  Table t;
  t.channel.hello(0, 41);
  t.channel.lost(1, "exited with code 3");
  CHECK(Table::error_of([&] {
          t.table.start(5s, [](const WorkerInfo&) { return proto::Welcome{}; });
        }) == "worker g:1 exited with code 3 before it was ready");
  CHECK(t.table.lost()->peer == 1);
  CHECK(t.channel.count(0, MsgType::welcome) == 0);
}

TEST_CASE("start: workers without a hello are named after the timeout", "[call_table]") {
  Table t;
  t.channel.hello(0, 41);
  t.channel.hello(2, 43);
  const auto began = std::chrono::steady_clock::now();
  CHECK(Table::error_of([&] {
          t.table.start(50ms, [](const WorkerInfo&) { return proto::Welcome{}; });
        }) == "workers g:1, g:3 did not start within 0.05 s");
  CHECK(std::chrono::steady_clock::now() - began < 2s);
  CHECK(t.table.workers()[2].ready);
}

TEST_CASE("create: every worker constructs; a constructor error names the worker", "[call_table]") {
  Table t;
  t.start();
  const std::uint64_t inst = t.create();
  for (std::size_t p = 0; p < 4; ++p) {
    const SentMessage& m = t.channel.last(p, MsgType::create);
    CHECK(m.id == inst);
    CHECK(m.body["class"] == Value("C"));
  }
  CHECK(Table::error_of([&] { t.create("no such checkpoint /ckpt"); }) ==
        "C constructor failed on group g rank 1 (host h, pid 42): no such checkpoint /ckpt");
}

TEST_CASE("create: a worker that does not acknowledge times out, naming its rank", "[call_table]") {
  Table t(0.05);
  t.start();
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::create && peer != 2) t.channel.created(peer, m.id);
  };
  CHECK(Table::error_of([&] { create_on(t.table, t.cls, 0, Value::list()); }) ==
        "C constructor on group g timed out after 0.05 s: ranks [2] did not answer; raise "
        "job.timeout_s");
}

TEST_CASE("call: what each worker receives", "[call_table]") {
  Table t;
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(); });
  auto args_of = [&](std::size_t peer) { return t.channel.last(peer, MsgType::call).body["args"]; };

  SECTION("all: the same arguments for every worker") {
    const auto f = call_on(t.table, inst, "m", Value::list({5, "x"}), "x.cpp:7");
    for (std::size_t p = 0; p < 4; ++p) {
      const SentMessage& m = t.channel.last(p, MsgType::call);
      CHECK(m.id == f);
      CHECK(m.body["instance"] == Value(inst));
      CHECK(m.body["method"] == Value("m"));
      CHECK(m.body["args"] == Value::list({5, "x"}));
    }
  }
  SECTION("slice: one part per worker") {
    call_on(t.table, inst, "slice", Value::list({ints({1, 2, 3, 4}), "whole"}), "x.cpp:7");
    for (int p = 0; p < 4; ++p) CHECK(args_of(p) == Value::list({ints({p + 1}), "whole"}));
  }
  SECTION("slice_dp: one part per data rank; tp peers get the same part") {
    call_on(t.table, inst, "slice_dp", Value::list({ints({1, 2, 3, 4})}), "x.cpp:7");
    CHECK(args_of(0) == Value::list({ints({1, 2})}));
    CHECK(args_of(1) == Value::list({ints({1, 2})}));
    CHECK(args_of(2) == Value::list({ints({3, 4})}));
    CHECK(args_of(3) == Value::list({ints({3, 4})}));
  }
  SECTION("execute first: only worker 0, with the arguments whole") {
    call_on(t.table, inst, "first", Value::list({ints({1, 2, 3, 4})}), "x.cpp:7");
    CHECK(args_of(0) == Value::list({ints({1, 2, 3, 4})}));
    for (std::size_t p = 1; p < 4; ++p) CHECK(t.channel.count(p, MsgType::call) == 0);
  }
  SECTION("execute first: an empty list or a tensor of no rows is not a batch too small") {
    // Dispatch slice is not applied under execute first (twinkle-plugin(7), execute first), so
    // its minimum batch size is not either: worker 0 gets the arguments as they were passed.
    const Value no_rows(Tensor(DType::f32, {0, 3}));
    call_on(t.table, inst, "first", Value::list({Value::list(), no_rows}), "x.cpp:7");
    CHECK(args_of(0) == Value::list({Value::list(), no_rows}));
    for (std::size_t p = 1; p < 4; ++p) CHECK(t.channel.count(p, MsgType::call) == 0);
    // The same arguments sliced across the four workers are still an error.
    CHECK_THROWS_WITH(
        call_on(t.table, inst, "slice", Value::list({Value::list()}), "x.cpp:7"),
        "C.slice: argument 0 has 0 items but dispatch slice splits it into 4 slices (one per "
        "worker); pass at least 4");
  }
}

TEST_CASE("wait: the results are collected as the method says", "[call_table]") {
  Table t;
  const std::uint64_t inst = t.ready([](std::size_t peer, const Value&) {
    return Value(static_cast<int>(peer) + 1);  // 1, 2, 3, 4
  });
  CHECK(wait_on(t.table, call_on(t.table, inst, "m", Value::list(), "x.cpp:7")) == Value(10));
  CHECK(wait_on(t.table, call_on(t.table, inst, "mean", Value::list(), "x.cpp:7")) == Value(2.5));
  CHECK(wait_on(t.table, call_on(t.table, inst, "first", Value::list(), "x.cpp:7")) == Value(1));
  CHECK(wait_on(t.table, call_on(t.table, inst, "slice", Value::list(), "x.cpp:7")) ==
        ints({1, 2, 3, 4}));
  CHECK(t.table.outstanding() == 0);
  CHECK(Table::error_of([&] { wait_on(t.table, 12345); }) == "unknown or already collected call");
}

TEST_CASE("wait: flatten joins one result per data rank", "[call_table]") {
  Table t;
  const std::uint64_t inst = t.ready([](std::size_t peer, const Value&) {
    const int p = static_cast<int>(peer);
    return ints({10 * p, 10 * p + 1});
  });
  // Workers 0 and 2 speak for data ranks 0 and 1.
  CHECK(wait_on(t.table, call_on(t.table, inst, "flatten", Value::list(), "x.cpp:7")) ==
        ints({0, 1, 20, 21}));
}

TEST_CASE("wait: a worker's error names the caller, the call and the worker", "[call_table]") {
  Table t;
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(1); });
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type != MsgType::call) return;
    if (peer == 1 || peer == 2) {
      t.channel.reply_error(peer, m.id, "CUDA out of memory");
    } else {
      t.channel.reply(peer, m.id, 1);
    }
  };
  const auto f = call_on(t.table, inst, "m", Value::list(), "x.cpp:7");
  CHECK(Table::error_of([&] { wait_on(t.table, f); }) ==
        "C.m failed on group g rank 1 (host h, pid 42): CUDA out "
        "of memory (ranks 2 failed too)");
  CHECK(t.table.outstanding() == 0);

  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type != MsgType::call) return;
    if (peer == 3) {
      t.channel.reply_error(peer, m.id, "bad batch");
    } else {
      t.channel.reply(peer, m.id, 1);
    }
  };
  CHECK(Table::error_of([&] {
          wait_on(t.table, call_on(t.table, inst, "m", Value::list(), "y.cpp:9"));
        }) == "C.m failed on group g rank 3 (host h, pid 44): bad batch");
}

TEST_CASE("wait: a worker lost while the driver waits fails the wait, naming it", "[call_table]") {
  Table t;
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(1); });
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::call && peer != 1) t.channel.reply(peer, m.id, 1);
  };
  const auto f = call_on(t.table, inst, "m", Value::list(), "x.cpp:7");
  t.channel.lost(1, "exited with code 3");
  CHECK(Table::error_of([&] { wait_on(t.table, f); }) ==
        "C.m failed: worker g:1 (host h, pid 42) exited with "
        "code 3");
  REQUIRE(t.table.lost());
  CHECK(t.table.lost()->peer == 1);
  CHECK(t.table.lost()->text == "worker g:1 (host h, pid 42) exited with code 3");
  CHECK(t.table.lost()->calls == std::vector<std::string>{"C.m (driver caller: x.cpp:7)"});

  // From then on every call fails with it, and a second loss does not replace the first.
  t.channel.lost(2, "was killed by signal 9 (Killed)");
  t.table.drain();
  CHECK(t.table.lost()->peer == 1);
  CHECK(Table::error_of([&] { call_on(t.table, inst, "m", Value::list(), "x.cpp:8"); }) ==
        "C.m failed: worker g:1 (host h, pid 42) exited with code 3");
}

TEST_CASE("wait: lost workers are not failures once exits are expected", "[call_table]") {
  Table t;
  t.start();
  t.table.expect_exits();
  t.channel.lost(0, "exited with code 0");
  t.table.drain();
  CHECK_FALSE(t.table.lost());
}

TEST_CASE("wait: ranks that do not answer in time are named; late replies are dropped",
          "[call_table]") {
  Table t;
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(1); });
  std::uint64_t id = 0;
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type != MsgType::call) return;
    id = m.id;
    if (peer == 0 || peer == 2) t.channel.reply(peer, m.id, 1);
  };
  const auto f = call_on(t.table, inst, "quick", Value::list(), "x.cpp:7");
  CHECK(Table::error_of([&] { wait_on(t.table, f); }) ==
        "C.quick timed out after 0.05 s: ranks [1, 3] of group g "
        "did not answer; raise the method's timeout (twinkle::timeout in TWINKLE_METHOD) or "
        "job.timeout_s");
  // The late answers arrive and are dropped; nothing is left waiting.
  t.channel.reply(1, id, 1);
  t.channel.reply(3, id, 1);
  t.table.drain();
  CHECK(t.table.outstanding() == 0);
  CHECK(Table::error_of([&] { wait_on(t.table, f); }) == "unknown or already collected call");
  // The table still works.
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::call) t.channel.reply(peer, m.id, 2);
  };
  CHECK(wait_on(t.table, call_on(t.table, inst, "m", Value::list(), "x.cpp:9")) == Value(8));
}

TEST_CASE("cancel: waits and new calls fail with the reason", "[call_table]") {
  Table t;
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(1); });
  t.channel.on_send = nullptr;  // nobody answers
  const auto f = call_on(t.table, inst, "m", Value::list(), "x.cpp:7");
  // A wait in progress notices a cancel from another thread once the channel is woken.
  auto waiting = std::async(std::launch::async, [&]() -> std::string {
    try {
      wait_on(t.table, f);
    } catch (const CallError& e) {
      return e.what();
    }
    return "no CallError";
  });
  t.table.cancel("interrupted by SIGINT");
  t.table.cancel("a second reason is ignored");
  t.channel.wake();
  REQUIRE(waiting.wait_for(5s) == std::future_status::ready);
  CHECK(waiting.get() == "C.m: interrupted by SIGINT");
  CHECK(t.table.outstanding() == 0);
  CHECK(Table::error_of([&] { call_on(t.table, inst, "m", Value::list(), "x.cpp:8"); }) ==
        "C.m: interrupted by SIGINT");
  CHECK(Table::error_of([&] { create_on(t.table, t.cls, 0, Value::list()); }) ==
        "C constructor on group g: interrupted by SIGINT");
}

TEST_CASE("release: a pending call's answers are dropped when they come", "[call_table]") {
  Table t;
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(1); });
  std::uint64_t id = 0;
  t.channel.on_send = [&](std::size_t, const SentMessage& m) { id = m.id; };
  const auto f = call_on(t.table, inst, "m", Value::list(), "x.cpp:7");
  t.table.release(f);
  CHECK(t.table.outstanding() == 1);  // still answered by the workers
  for (std::size_t p = 0; p < 4; ++p) t.channel.reply(p, id, 1);
  t.table.drain();
  CHECK(t.table.outstanding() == 0);
  CHECK(Table::error_of([&] { wait_on(t.table, f); }) == "unknown or already collected call");

  // Releasing an answered call, or an unknown one, is harmless.
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::call) t.channel.reply(peer, m.id, 1);
  };
  const auto g = call_on(t.table, inst, "m", Value::list(), "x.cpp:8");
  t.table.drain();
  t.table.release(g);
  t.table.release(999);
  CHECK(t.table.outstanding() == 0);
}

TEST_CASE("call: an unknown method or instance", "[call_table]") {
  Table t;
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(1); });
  CHECK(Table::error_of([&] { call_on(t.table, inst, "stpe", Value::list(), "x.cpp:7"); }) ==
        "no remote method stpe (class C has: m, slice, slice_dp, first, mean, flatten, quick); "
        "declare it with TWINKLE_METHOD");
  CHECK(Table::error_of([&] { call_on(t.table, inst + 100, "m", Value::list(), "x.cpp:7"); }) ==
        "unknown instance handle");
  CHECK(t.channel.count(0, MsgType::call) == 0);
}

// ----- Calls from a worker to another group (docs/ARCHITECTURE.md, Calls between groups)
// -----------------------------------

TEST_CASE("a worker's call with execute = peer reaches its block only, sliced across it") {
  // The caller is rank 1 of a group of 2; the target group "g" has 4 workers: block [2, 3].
  Table t;
  plugins::ClassInfo cls = t.cls;
  cls.methods.push_back(method("peer", Dispatch::slice, Execute::peer, Collect::none));
  t.start();
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::call) t.channel.reply(peer, m.id, m.body["args"][0]);
  };
  // An instance that another caller made (its handle came as an argument).
  const std::uint64_t inst = 77;
  t.table.attach(inst, cls, 0);
  t.table.attach(inst, cls, 0);  // again: the same instance, accepted
  const std::uint64_t f =
      call_on(t.table, inst, "peer", Value::list({Value::list({1, 2, 3, 4, 5})}), "w.cpp:3",
              PeerCaller{1, 2}, {proto::ChainLink{"frame", 1, "F.f", "f.cpp:1"}});
  const Value got = wait_on(t.table, f);
  CHECK(got.repr() == Value::list({Value::list({1, 2, 3}), Value::list({4, 5})}).repr());
  CHECK(t.channel.count(0, MsgType::call) == 0);
  CHECK(t.channel.count(1, MsgType::call) == 0);
  // The caller's chain and the call site travel with the call.
  const SentMessage& sent = t.channel.last(2, MsgType::call);
  CHECK(sent.body["chain"][0]["worker"].as<std::string>() == "frame");
  CHECK(sent.body["caller"].as<std::string>() == "w.cpp:3");
}

TEST_CASE("a class with execute = peer created from a worker lives on the caller's block") {
  Table t;
  t.start();
  plugins::ClassInfo peer_cls = t.cls;
  peer_cls.execute = Execute::peer;
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::create) t.channel.created(peer, m.id);
    if (m.type == MsgType::call) t.channel.reply(peer, m.id, static_cast<int>(peer));
  };
  // Rank 3 of 8 callers, 4 targets: worker 3 mod 4 = 3.
  const std::uint64_t inst = create_on(t.table, peer_cls, 0, Value::list(), PeerCaller{3, 8});
  for (std::size_t p = 0; p < 3; ++p) CHECK(t.channel.count(p, MsgType::create) == 0);
  CHECK(t.channel.count(3, MsgType::create) == 1);
  // `all` on it means the workers it lives on.
  CHECK(wait_on(t.table, call_on(t.table, inst, "m", Value::list(), "w.cpp:1")).as<int>() == 3);
  for (std::size_t p = 0; p < 3; ++p) CHECK(t.channel.count(p, MsgType::call) == 0);
}

TEST_CASE("ids of instances made by different callers never collide") {
  FakeChannel channel;
  CallTable table(channel, {GroupInfo{"g", DeviceMesh::data_parallel(1), {0}}}, Table::workers(),
                  {}, 5, std::uint64_t(3) << 40);
  plugins::ClassInfo cls = class_c();
  channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::create) channel.created(peer, m.id);
  };
  CHECK(create_on(table, cls, 0, Value::list()) == (std::uint64_t(3) << 40) + 1);
  // An attached handle of another class on the same id is refused.
  plugins::ClassInfo other = cls;
  other.name = "D";
  CHECK_THROWS_AS(table.attach((std::uint64_t(3) << 40) + 1, other, 0), CallError);
}

TEST_CASE(
    "waiting_peers names the workers the call in wait() still waits for; fail_waiting "
    "ends that wait with an error") {
  Table t;
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(); });
  t.channel.on_send = nullptr;  // nobody answers
  const std::uint64_t f = call_on(t.table, inst, "m", Value::list(), "w.cpp:9");
  CHECK(t.table.waiting_peers().empty());  // not in wait()
  for (std::size_t p : {0u, 1u, 3u}) t.channel.reply(p, f, 1);
  // Inside wait(), as a worker's probe handler would: see whom it waits for, then end it.
  std::vector<std::size_t> seen;
  t.channel.on_next = [&] {
    if (!seen.empty() || t.table.waiting_peers() != std::vector<std::size_t>{2}) return;
    seen = t.table.waiting_peers();
    t.table.fail_waiting(2, "deadlock: a cycle");
    t.channel.wake();
  };
  const std::string e = Table::error_of([&] { wait_on(t.table, f); });
  CHECK(seen == std::vector<std::size_t>{2});
  CHECK(e.find("C.m failed on group g rank 2") != std::string::npos);
  CHECK(e.find("deadlock: a cycle") != std::string::npos);
  CHECK(t.table.waiting_peers().empty());
}

namespace {

// Restarts as the driver sets them up: restart = "worker" (or "group") with recover = "peer",
// every loss restarts at once; what the table asks of the launcher and of the run is recorded.
struct Restarting {
  std::vector<std::vector<std::size_t>> respawned;  // the peers of each respawn
  std::vector<std::string> backs;                   // the donors' text of each return
  int generation = 0;

  Restarts hooks(bool whole_group) {
    return Restarts{
        [this](std::size_t, const std::string&) {
          ++generation;
          return Restarts::Decision{std::chrono::milliseconds(0), ""};
        },
        [this](std::size_t, const std::vector<std::size_t>& peers) { respawned.push_back(peers); },
        [this](std::size_t, const std::string& donors) { backs.push_back(donors); },
        [](std::size_t) { return std::string(", with the state of a surviving replica"); },
        [](std::size_t) { return true; },
        [whole_group](std::size_t) { return whole_group; },
        [whole_group](std::size_t) { return !whole_group; },
        [this](std::size_t) { return generation; }};
  }
};

// Workers that answer creates, recovers (with `bytes` copied) and calls (each with 1).
void answer_all(Table& t, std::uint64_t bytes) {
  t.channel.on_send = [&t, bytes](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::create) t.channel.created(peer, m.id);
    if (m.type == MsgType::recover)
      t.channel.deliver(peer, m.id, proto::Recovered{std::nullopt, 1, bytes, 0.01});
    if (m.type == MsgType::call) t.channel.reply(peer, m.id, Value(1));
  };
}

// A class whose "step" is sent again after a restart (twinkle::retry{1}).
plugins::ClassInfo class_retry() {
  plugins::ClassInfo c = class_c();
  c.name = "R";
  plugins::MethodInfo step = method("step", Dispatch::all, Execute::all, Collect::sum);
  step.retries = 1;
  c.methods.push_back(step);
  return c;
}

}  // namespace

TEST_CASE("restart = worker: only the lost rank is replaced and copies a replica's state",
          "[call_table]") {
  Table t;
  Restarting r;
  t.table.set_restarts(r.hooks(false));
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(1); });
  // Workers answer creates and recovers; calls are left unanswered.
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::create) t.channel.created(peer, m.id);
    if (m.type == MsgType::recover)
      t.channel.deliver(peer, m.id, proto::Recovered{std::nullopt, 1, 4096, 0.01});
  };
  const std::uint64_t f = call_on(t.table, inst, "m", Value::list(), "t.cpp:1");
  t.channel.lost(1, "was killed by signal 9");
  bool said = false;
  t.channel.on_next = [&] {
    // Once the replacement is started, it says hello (once).
    if (!said && r.respawned.size() == 1) {
      said = true;
      t.channel.hello(1, 99);
    }
  };
  const std::string lost = Table::error_of([&] { wait_on(t.table, f); });
  CHECK_THAT(lost, Catch::Contains("worker g:1 (host h, pid 42) was killed by signal 9; group g "
                                   "restarts. The call had finished on ranks []; it may have run "
                                   "on ranks [0, 1, 2, 3]"));
  // A call made now runs once the group is back, on the new worker and the others.
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::create) t.channel.created(peer, m.id);
    if (m.type == MsgType::recover)
      t.channel.deliver(peer, m.id, proto::Recovered{std::nullopt, 1, 4096, 0.01});
    if (m.type == MsgType::call && m.id != f) t.channel.reply(peer, m.id, Value(1));
  };
  const std::uint64_t after = call_on(t.table, inst, "m", Value::list(), "t.cpp:2");
  CHECK(wait_on(t.table, after) == Value(4));
  REQUIRE(r.respawned.size() == 1);
  CHECK(r.respawned[0] == std::vector<std::size_t>{1});
  // The survivors regrouped at the new generation; nothing of the kind went to the lost rank.
  for (std::size_t p : {0u, 2u, 3u}) {
    CHECK(t.channel.last(p, MsgType::regroup).body["generation"] == Value(1));
    CHECK(t.channel.count(p, MsgType::welcome) == 1);  // theirs from the start only
    CHECK(t.channel.count(p, MsgType::create) == 1);
    CHECK(t.channel.count(p, MsgType::recover) == 0);
  }
  CHECK(t.channel.count(1, MsgType::regroup) == 0);
  CHECK(t.channel.count(1, MsgType::welcome) == 2);
  CHECK(t.channel.count(1, MsgType::create) == 2);
  // Rank 1 (dp 0, tp 1) copies from rank 3 (dp 1, tp 1): the same coordinates but dp.
  CHECK(t.channel.last(1, MsgType::recover).body["donor"] == Value(3));
  // The donor was told at its regroup to take its state then; the other survivors were not.
  CHECK(t.channel.last(3, MsgType::regroup).body["donor"] == Value(true));
  CHECK(t.channel.last(0, MsgType::regroup).body["donor"] == Value(false));
  CHECK(t.channel.last(2, MsgType::regroup).body["donor"] == Value(false));
  REQUIRE(r.backs.size() == 1);
  CHECK(r.backs[0] == "g:1 from g:3 (0.0 MiB in 0.010 s)");
  CHECK(t.table.workers()[1].pid == 99);
}

TEST_CASE("restart = worker: a retried call drops what the survivors answered to its first try",
          "[call_table]") {
  Table t;
  Restarting r;
  t.table.set_restarts(r.hooks(false));
  t.start();
  const plugins::ClassInfo cls = class_retry();
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::create) t.channel.created(peer, m.id);
  };
  const std::uint64_t inst = create_on(t.table, cls, 0, Value::list());
  const std::uint64_t f = call_on(t.table, inst, "step", Value::list(), "t.cpp:1");
  // Rank 0 answered the first try; ranks 2 and 3 answer it only after the loss (their
  // collective failed on rank 1): those answers are dropped, the second try's count.
  t.channel.reply(0, f, Value(100));
  t.channel.lost(1, "was killed by signal 9");
  bool second = false;
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::create) t.channel.created(peer, m.id);
    if (m.type == MsgType::recover)
      t.channel.deliver(peer, m.id, proto::Recovered{std::nullopt, 0, 0, 0});
    if (m.type == MsgType::call && m.id == f) {
      second = true;
      t.channel.reply(peer, m.id, Value(1));
    }
  };
  bool said = false;
  t.channel.on_next = [&] {
    if (!said && r.respawned.size() == 1) {
      said = true;
      t.channel.reply_error(2, f, "all_reduce failed: rank 1 exited");
      t.channel.reply_error(3, f, "all_reduce failed: rank 1 exited");
      t.channel.hello(1, 99);
    }
  };
  CHECK(wait_on(t.table, f) == Value(4));
  CHECK(second);
  CHECK(t.channel.count(0, MsgType::call) == 2);  // sent again to every rank
  CHECK(t.channel.count(1, MsgType::call) == 2);
}

TEST_CASE("restart = group: every worker is replaced; nobody regroups or copies", "[call_table]") {
  Table t;
  Restarting r;
  t.table.set_restarts(r.hooks(true));
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(1); });
  t.channel.lost(2, "exited with code 1");
  bool said = false;
  t.channel.on_next = [&] {
    if (!said && r.respawned.size() == 1) {
      said = true;
      for (std::size_t p = 0; p < 4; ++p) t.channel.hello(p, 90 + static_cast<int>(p));
    }
  };
  t.channel.on_send = [&](std::size_t peer, const SentMessage& m) {
    if (m.type == MsgType::create) t.channel.created(peer, m.id);
    if (m.type == MsgType::call) t.channel.reply(peer, m.id, Value(1));
  };
  // The restart reaches the caller once (no call was waiting), then calls run on the new group.
  CHECK_THAT(Table::error_of(
                 [&] { wait_on(t.table, call_on(t.table, inst, "m", Value::list(), "t.cpp:1")); }),
             Catch::Contains("group g restarted while no call was waiting on it"));
  CHECK(wait_on(t.table, call_on(t.table, inst, "m", Value::list(), "t.cpp:2")) == Value(4));
  REQUIRE(r.respawned.size() == 1);
  CHECK(r.respawned[0] == std::vector<std::size_t>{0, 1, 2, 3});
  for (std::size_t p = 0; p < 4; ++p) {
    CHECK(t.channel.count(p, MsgType::regroup) == 0);
    CHECK(t.channel.count(p, MsgType::recover) == 0);
    CHECK(t.channel.count(p, MsgType::welcome) == 2);
  }
  REQUIRE(r.backs.size() == 1);
  CHECK(r.backs[0].empty());
}

TEST_CASE("restart = worker: ranks lost together (a DEAD node's) are replaced in one restart",
          "[call_table]") {
  Table t;
  Restarting r;
  t.table.set_restarts(r.hooks(false));
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(1); });
  answer_all(t, 4096);
  t.channel.lost(1, "its node n2 is DEAD", {2});
  bool said = false;
  t.channel.on_next = [&] {
    if (!said && r.respawned.size() == 1) {
      said = true;
      t.channel.hello(1, 98);
      t.channel.hello(2, 99);
    }
  };
  CHECK_THAT(Table::error_of(
                 [&] { wait_on(t.table, call_on(t.table, inst, "m", Value::list(), "t.cpp:1")); }),
             Catch::Contains("its node n2 is DEAD"));
  CHECK(wait_on(t.table, call_on(t.table, inst, "m", Value::list(), "t.cpp:2")) == Value(4));
  // One decision (one restart of the budget, one generation), one respawn of both.
  CHECK(r.generation == 1);
  REQUIRE(r.respawned.size() == 1);
  CHECK(r.respawned[0] == std::vector<std::size_t>{1, 2});
  for (std::size_t p : {0u, 3u}) {
    CHECK(t.channel.last(p, MsgType::regroup).body["generation"] == Value(1));
    CHECK(t.channel.count(p, MsgType::recover) == 0);
  }
  // Each copies from its replica: rank 1 (dp 0, tp 1) from rank 3, rank 2 (dp 1, tp 0) from 0.
  CHECK(t.channel.count(1, MsgType::regroup) == 0);
  CHECK(t.channel.count(2, MsgType::regroup) == 0);
  CHECK(t.channel.last(1, MsgType::recover).body["donor"] == Value(3));
  CHECK(t.channel.last(2, MsgType::recover).body["donor"] == Value(0));
  for (std::size_t p : {0u, 3u})
    CHECK(t.channel.last(p, MsgType::regroup).body["donor"] == Value(true));
  REQUIRE(r.backs.size() == 1);
  CHECK_THAT(r.backs[0], Catch::Contains("g:1 from g:3") && Catch::Contains("g:2 from g:0"));
}

TEST_CASE("restart: an instance a worker made on the group is made again for its maker",
          "[call_table]") {
  Table t;
  Restarting r;
  static const plugins::ClassInfo made_cls = class_c();
  Restarts hooks = r.hooks(false);
  hooks.find_class = [](std::string_view name) {
    return name == "C" ? &made_cls : static_cast<const plugins::ClassInfo*>(nullptr);
  };
  t.table.set_restarts(hooks);
  const std::uint64_t inst = t.ready([](std::size_t, const Value&) { return Value(1); });
  answer_all(t, 0);
  // Worker g:3 made instance 9001 on workers 1 and 2 (a call between groups); one naming an
  // unknown class or a worker the group lacks is not recorded.
  t.channel.deliver(3, 9001, proto::Made{0, {1, 2}, "C", encode(Value::list({7}))});
  t.channel.deliver(3, 9002, proto::Made{0, {1}, "Nope", encode(Value::list())});
  t.channel.deliver(3, 9003, proto::Made{0, {9}, "C", encode(Value::list())});
  t.channel.lost(1, "was killed by signal 9");
  bool said = false;
  t.channel.on_next = [&] {
    if (!said && r.respawned.size() == 1) {
      said = true;
      t.channel.hello(1, 99);
    }
  };
  CHECK_THAT(Table::error_of(
                 [&] { wait_on(t.table, call_on(t.table, inst, "m", Value::list(), "t.cpp:1")); }),
             Catch::Contains("was killed by signal 9"));
  CHECK(wait_on(t.table, call_on(t.table, inst, "m", Value::list(), "t.cpp:2")) == Value(4));
  // The replacement got the driver's instance and worker g:3's (same id, same arguments, its
  // maker named), and nothing of the others; the survivors got no creates again.
  std::map<std::uint64_t, Value> creates;
  for (const auto& m : t.channel.sent[1]) {
    if (m.type == MsgType::create) creates[m.id] = m.body;
  }
  REQUIRE(creates.count(9001) == 1);
  CHECK(creates[9001]["class"] == Value("C"));
  CHECK(creates[9001]["args"] == Value::list({7}));
  CHECK(creates[9001]["maker"] == Value("g:3"));
  CHECK(creates.count(9002) == 0);
  CHECK(creates.count(9003) == 0);
  CHECK(creates.count(inst) == 1);
  CHECK_FALSE(creates[inst].contains("maker"));
  CHECK(t.channel.count(2, MsgType::create) == 1);
}
