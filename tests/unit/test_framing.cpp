#include <catch2/catch.hpp>

#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "tests/unit/fixtures.hpp"
#include "transports/fd.hpp"
#include "transports/zmq/channel.hpp"
#include "transports/zmq/kv.hpp"
#include "transports/zmq/message.hpp"
#include "transports/zmq/peers.hpp"
#include "transports/zmq/stream.hpp"
#include "twinkle/errors.hpp"

using namespace twinkle;
using namespace twinkle::transport;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

using twinkle::test::TempDir;
namespace proto = twinkle::transport::proto;

// The message of the ProtocolError that decoding `frames` raises.
std::string error_of(Frames frames, ShmChannel* channel = nullptr) {
  try {
    decode_message(std::move(frames), channel);
  } catch (const ProtocolError& e) {
    return e.what();
  }
  FAIL("the frames decoded without a ProtocolError");
  return {};
}

Frames reply_frames(Value value = Value(7)) {
  return encode_message(Message{9, proto::Reply{std::nullopt, encode(value)}});
}

// Writes a little-endian u16 into the header at `offset`.
void put_u16(Frames& frames, std::size_t offset, std::uint16_t v) {
  auto* h = static_cast<unsigned char*>(frames[0].data());
  h[offset] = static_cast<unsigned char>(v & 0xff);
  h[offset + 1] = static_cast<unsigned char>(v >> 8);
}

// Frame 0 of a message of `type`: the header, then `body` and `table` as msgpack.
zmq::message_t frame0(MsgType type, const Value& body, const std::optional<Value>& table = {}) {
  Frames f = encode_message(Message{0, proto::Shutdown{}});
  std::string bytes(static_cast<const char*>(f[0].data()), 16);
  bytes[6] = static_cast<char>(static_cast<std::uint16_t>(type) & 0xff);
  bytes[7] = static_cast<char>(static_cast<std::uint16_t>(type) >> 8);
  bytes += encode(body).msgpack;
  if (table) bytes += encode(*table).msgpack;
  return zmq::message_t(bytes.data(), bytes.size());
}

// A reply with one tensor whose table entry is `entry` and whose tensor frame is `frame`.
Frames with_tensor_entry(const Value& entry, zmq::message_t frame) {
  Frames f;
  const Value body = Value::map({{"value", Value::list({Value(Bytes{{0xd4, 1, 0}}), 0, 0})}});
  f.push_back(frame0(MsgType::reply, body, Value::list({Value::list({entry}), Value::list()})));
  f.push_back(std::move(frame));
  return f;
}

constexpr int kF32 = static_cast<int>(DType::f32);

}  // namespace

TEST_CASE("a message with tensors survives encode and decode", "[zmq]") {
  Tensor t = Tensor::from(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor empty(DType::i64, {0, 4});
  Value args =
      Value::map({{"x", t}, {"rows", Value::list({empty, 3, "s"})}, {"step", 12}, {"lr", 0.5}});
  Frames frames = encode_message(
      Message{0x0102030405060708ull,
              proto::Call{3, "step", "t.cpp:1", encode(args), {{"driver", 0, "entry", ""}}}});
  // frame 0 (header, body, tensor table), then one frame per tensor (the args' order)
  REQUIRE(frames.size() == 3);
  CHECK(frames[1].size() == 0);
  CHECK(frames[2].size() == 6 * sizeof(float));

  Message m = decode_message(std::move(frames));
  CHECK(m.type() == MsgType::call);
  CHECK(m.id == 0x0102030405060708ull);
  const auto* call = m.get<proto::Call>();
  REQUIRE(call);
  CHECK(call->instance == 3);
  CHECK(call->method == "step");
  CHECK(call->caller == "t.cpp:1");
  REQUIRE(call->chain.size() == 1);
  CHECK(call->chain[0].worker == "driver");
  const Value got = decode(call->args);
  CHECK(got == args);
  CHECK(got["x"].tensor().shape() == std::vector<std::int64_t>{2, 3});
  CHECK(got["rows"][0].tensor().shape() == std::vector<std::int64_t>{0, 4});
}

TEST_CASE("a message without tensors is one frame", "[zmq]") {
  CHECK(reply_frames().size() == 1);
  CHECK(encode_message(Message{0, proto::Shutdown{}}).size() == 1);
}

TEST_CASE("every message type survives encode and decode", "[zmq]") {
  proto::Welcome w;
  w.job = "j";
  w.groups.push_back(proto::GroupEntry{"g", Value::map({{"dp", 2}}), {0, 1}});
  w.workers.push_back(proto::WorkerEntry{"g:0", 0, 0, 42, "h", "ipc:///x"});
  w.self = 1;
  w.args = Value::map({{"lr", 0.5}});
  w.timeout_s = 3;
  Message m = decode_message(encode_message(Message{0, w}));
  const auto* got = m.get<proto::Welcome>();
  REQUIRE(got);
  CHECK(got->workers[0].pid == 42);
  CHECK(got->groups[0].peers == std::vector<std::uint64_t>{0, 1});
  CHECK(got->args == w.args);
  CHECK(got->timeout_s == 3.0);

  proto::Launch l;
  l.run = "r";
  l.workers.push_back(proto::LaunchWorker{"g:0", {"A=1"}});
  l.keys = proto::RunKeys{"p", "s", "v"};
  ClusterMessage c = decode_cluster_message(encode_message(ClusterMessage{5, l}));
  const auto* lg = c.get<proto::Launch>();
  REQUIRE(lg);
  CHECK(c.id == 5);
  REQUIRE(lg->keys);
  CHECK(lg->keys->secret_key == "s");
  CHECK(lg->workers[0].env == std::vector<std::string>{"A=1"});

  // Optional fields left out come back empty.
  proto::Launch nokeys;
  c = decode_cluster_message(encode_message(ClusterMessage{0, nokeys}));
  CHECK_FALSE(c.get<proto::Launch>()->keys);
}

TEST_CASE("every message type is described with its fields", "[zmq]") {
  const auto lines = proto::describe_messages();
  CHECK(lines.size() == std::variant_size_v<proto::Control> + std::variant_size_v<proto::Cluster>);
  CHECK(std::find(lines.begin(), lines.end(),
                  "call (5): instance u64, method str, caller str, args payload, chain [{worker "
                  "str, token u64, what str, caller str}]") != lines.end());
  CHECK(std::find(lines.begin(), lines.end(), "shutdown (7): no fields") != lines.end());
}

TEST_CASE("decode_message names what is wrong with the frames", "[zmq]") {
  SECTION("no frames, no body") {
    CHECK(error_of(Frames{}) == "malformed message: no frames");
    Frames f = reply_frames();
    f[0] = zmq::message_t(static_cast<const char*>(f[0].data()), 16);
    CHECK(error_of(std::move(f)) == "malformed message: no body after the header");
  }
  SECTION("no twinkle header") {
    Frames f = reply_frames();
    static_cast<char*>(f[0].data())[0] = 'X';
    CHECK(error_of(std::move(f)) ==
          "malformed message: no twinkle header (is another program talking to this socket?)");
    Frames short_header;
    short_header.emplace_back(std::string("TWKP"));
    CHECK(error_of(std::move(short_header)) ==
          "malformed message: no twinkle header (is another program talking to this socket?)");
  }
  SECTION("another protocol version") {
    Frames f = reply_frames();
    put_u16(f, 4, 1);
    CHECK(error_of(std::move(f)) ==
          fmt::format("protocol version 1 from the peer, this twinkle speaks {}; run the same "
                      "twinkle build everywhere",
                      twinkle::transport::kProtocolVersion));
  }
  SECTION("an unknown type") {
    Frames f = reply_frames();
    put_u16(f, 6, 99);
    CHECK(error_of(std::move(f)) == "malformed message: unknown type 99");
    Frames zero = reply_frames();
    put_u16(zero, 6, 0);
    CHECK(error_of(std::move(zero)) == "malformed message: unknown type 0");
    Frames gap = reply_frames();
    put_u16(gap, 6, 65);  // just after the last type
    CHECK(error_of(std::move(gap)) == "malformed message: unknown type 65");
  }
  SECTION("a cluster message on a control socket, and the other way round") {
    Frames f = encode_message(ClusterMessage{0, proto::Heartbeat{"n", std::nullopt}});
    CHECK(error_of(std::move(f)) ==
          "malformed message: a heartbeat message is not expected on this socket");
    CHECK_THROWS_WITH(decode_cluster_message(reply_frames()),
                      "malformed message: a reply message is not expected on this socket");
  }
  SECTION("a body field that is missing or of the wrong type names the field") {
    Frames f;
    f.push_back(frame0(MsgType::hello, Value::map({{"name", "g:0"}})));
    CHECK(error_of(std::move(f)) == "malformed hello message: missing field \"group\"");
    Frames g;
    g.push_back(frame0(MsgType::hello, Value::map({{"name", "g:0"},
                                                   {"group", "g"},
                                                   {"rank", "x"},
                                                   {"pid", 1},
                                                   {"host", "h"},
                                                   {"serve", ""}})));
    CHECK(error_of(std::move(g)) ==
          "malformed hello message: rank: expected an integer, got a string");
    Frames h;
    h.push_back(frame0(MsgType::peer_lost, Value::map({{"peer", -1}, {"text", ""}})));
    CHECK(error_of(std::move(h)) == "malformed peer_lost message: peer: integer -1 is negative");
    Frames w;
    Value worker = Value::map(
        {{"name", "g:0"}, {"group", 0}, {"index", 0}, {"pid", "?"}, {"host", "h"}, {"serve", ""}});
    w.push_back(frame0(
        MsgType::welcome,
        Value::map({{"job", "j"}, {"groups", Value::list()}, {"workers", Value::list({worker})}})));
    CHECK(error_of(std::move(w)) ==
          "malformed welcome message: workers[0]: pid: expected an integer, got a string");
  }
  SECTION("a body that is not msgpack names the message") {
    Frames f;
    f.push_back(frame0(MsgType::reply, Value()));
    std::string bytes(static_cast<const char*>(f[0].data()), 16);
    bytes += "\xc1";  // a byte msgpack never uses
    f[0] = zmq::message_t(bytes.data(), bytes.size());
    CHECK_THAT(error_of(std::move(f)),
               Catch::StartsWith("malformed message: its body is not msgpack"));
  }
  SECTION("fields in any order, keys of no field passed over, a repeated field counts once") {
    // msgpack written by hand: {"serve": "", "later": [1, [2, {"a": 3}]], "pid": 7, "name":
    // "g:0", 5: 6, "group": "g", "rank": 1, "host": "h", "pid": 8}
    std::string body = "\x89";
    auto str = [&](std::string_view s) {
      body += static_cast<char>(0xa0 | s.size());
      body += s;
    };
    str("serve");
    str("");
    str("later");
    body += "\x92\x01\x92\x02\x81";
    str("a");
    body += "\x03";
    str("pid");
    body += "\x07";
    str("name");
    str("g:0");
    body += "\x05\x06";
    str("group");
    str("g");
    str("rank");
    body += "\x01";
    str("host");
    str("h");
    str("pid");
    body += "\x08";
    std::string bytes(static_cast<const char*>(frame0(MsgType::hello, Value()).data()), 16);
    bytes += body;
    Frames f;
    f.emplace_back(bytes.data(), bytes.size());
    const Message m = decode_message(std::move(f));
    const auto* hello = m.get<proto::Hello>();
    REQUIRE(hello);
    CHECK(hello->name == "g:0");
    CHECK(hello->group == "g");
    CHECK(hello->rank == 1);
    CHECK(hello->pid == 7);
    CHECK(hello->host == "h");
  }
  SECTION("a list that claims more entries than the message has bytes is not msgpack") {
    std::string bytes(static_cast<const char*>(frame0(MsgType::reply, Value()).data()), 16);
    bytes += "\x81\xa5value\xdd\xff\xff\xff\xff\x01";
    Frames f;
    f.emplace_back(bytes.data(), bytes.size());
    CHECK(error_of(std::move(f)) ==
          "malformed message: its body is not msgpack (a list or map of 4294967295 entries at "
          "offset 7 runs past the end)");
    Frames cut = reply_frames();
    std::string prefix(static_cast<const char*>(cut[0].data()), cut[0].size() - 1);
    cut[0] = zmq::message_t(prefix.data(), prefix.size());
    CHECK_THAT(error_of(std::move(cut)),
               Catch::StartsWith("malformed message: its body is not msgpack (truncated at"));
  }
  SECTION("a tensor table that is not [tensors, released]") {
    Frames f;
    f.push_back(frame0(MsgType::shutdown, Value::map(), Value::list({Value::list()})));
    CHECK(error_of(std::move(f)) ==
          "malformed message: the tensor table is not [tensors, released]");
  }
  SECTION("a tensor table that does not match the frames") {
    Frames f = reply_frames(Tensor::from(std::vector<float>{1, 2}));
    REQUIRE(f.size() == 2);
    f.pop_back();
    CHECK(error_of(std::move(f)) ==
          "malformed message: the tensor table lists 1 tensor(s) for 0 frame(s)");
    Frames extra = reply_frames();
    extra.emplace_back();
    CHECK(error_of(std::move(extra)) == "malformed message: 1 tensor frame(s) and no tensor table");
  }
  SECTION("a tensor frame of the wrong size") {
    Frames f = with_tensor_entry(Value::list({kF32, Value::list({2})}), zmq::message_t(4));
    CHECK(error_of(std::move(f)) ==
          "malformed message: tensor 0: tensor of shape [2] and dtype float32 needs 8 bytes, "
          "buffer has 4");
  }
  SECTION("a negative dimension") {
    Frames f = with_tensor_entry(Value::list({kF32, Value::list({2, -1})}), zmq::message_t());
    CHECK(error_of(std::move(f)) == "malformed message: tensor 0 has a negative dimension");
  }
  SECTION("a shape whose size overflows") {
    const std::int64_t big = std::int64_t{1} << 40;
    Frames f =
        with_tensor_entry(Value::list({kF32, Value::list({big, big, big})}), zmq::message_t());
    CHECK(error_of(std::move(f)) == "malformed message: tensor 0 has a shape too large");
  }
  SECTION("an unknown dtype") {
    Frames f = with_tensor_entry(Value::list({77, Value::list({1})}), zmq::message_t(4));
    CHECK(error_of(std::move(f)) == "malformed message: tensor 0 has dtype 77");
  }
  SECTION("a shared-memory entry without a channel") {
    Frames f = with_tensor_entry(Value::list({kF32, Value::list({2}), 1, 0, 0}), zmq::message_t());
    CHECK(error_of(std::move(f)) == "malformed message: a shared-memory tensor without a channel");
  }
}

// The TCP channel (remote workers) knows its peers by identity: what else connects is dropped.
TEST_CASE("driver channel: a message from an unknown identity is dropped and counted", "[zmq]") {
  zmq::context_t ctx;
  TcpDriverChannel channel(ctx, "127.0.0.1", {"w0", "w1"}, SocketSecurity{});
  REQUIRE(channel.endpoint().starts_with("tcp://127.0.0.1:"));

  zmq::socket_t intruder(ctx, zmq::socket_type::dealer);
  intruder.set(zmq::sockopt::linger, 0);
  intruder.set(zmq::sockopt::routing_id, "intruder");
  intruder.connect(channel.endpoint());
  send_message(intruder, Message{0, proto::Hello{"w0", "g", 0, 1, "x", ""}});

  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (channel.dropped() == 0 && std::chrono::steady_clock::now() < deadline) {
    auto e = channel.next(20ms);
    CHECK_FALSE(e);  // nothing is delivered for it
  }
  CHECK(channel.dropped() == 1);
  CHECK_FALSE(channel.next(0ms));
}

TEST_CASE("driver channel: a stranger that takes a worker's identity first does not keep it",
          "[zmq]") {
  zmq::context_t ctx;
  TcpDriverChannel channel(ctx, "127.0.0.1", {"w0", "w1"}, SocketSecurity{});
  // A process of an older build claims w1's identity and says hello in protocol version 1.
  zmq::socket_t intruder(ctx, zmq::socket_type::dealer);
  intruder.set(zmq::sockopt::linger, 0);
  intruder.set(zmq::sockopt::routing_id, "w1");
  intruder.connect(channel.endpoint());
  Frames old = encode_message(Message{0, proto::Hello{"w1", "g", 1, 1, "x", ""}});
  put_u16(old, 4, 1);
  send_frames(intruder, std::move(old));
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (channel.dropped() == 0 && std::chrono::steady_clock::now() < deadline) channel.next(20ms);
  REQUIRE(channel.dropped() == 1);

  // The real worker connects later with the same identity: its hello arrives and it is answered.
  auto link = connect_tcp_worker(ctx, channel.endpoint(), "w1", SocketSecurity{},
                                 [](const std::string&) {});
  link->send(Message{0, proto::Hello{"w1", "g", 1, 42, "h", ""}});
  auto e = channel.next(5s);
  REQUIRE(e);
  REQUIRE(e->kind == ChannelEvent::Kind::message);
  CHECK(e->peer == 1);
  REQUIRE(e->message.get<proto::Hello>());
  CHECK(e->message.get<proto::Hello>()->pid == 42);
  channel.send(1, Message{0, proto::Shutdown{}});
  auto w = link->recv(5s);
  REQUIRE(w);
  CHECK(w->type() == MsgType::shutdown);
}

namespace {

// A local worker's link on the ends the channel hands out for `peer`; `lost` counts on_lost.
// The control channel is a pair of pipes: this process ignores SIGPIPE, as the driver and the
// workers do.
std::unique_ptr<WorkerLink> local_link(LocalDriverChannel& channel, std::size_t peer,
                                       int* lost = nullptr) {
  ::signal(SIGPIPE, SIG_IGN);
  auto ends = channel.take_worker_ends(peer);
  return connect_local_worker(std::move(ends.control_in), std::move(ends.control_out),
                              std::move(ends.shm), [lost](const std::string&) {
                                if (lost) ++*lost;
                              });
}

}  // namespace

TEST_CASE("driver channel: a worker's hello arrives with its peer index", "[zmq]") {
  LocalDriverChannel channel({"w0", "w1"});
  CHECK(channel.endpoint() == "fd:4,5");
  auto link = local_link(channel, 1);
  link->send(Message{0, proto::Hello{"w1", "g", 1, 42, "h", ""}});

  auto e = channel.next(5s);
  REQUIRE(e);
  CHECK(e->kind == ChannelEvent::Kind::message);
  CHECK(e->peer == 1);
  REQUIRE(e->message.get<proto::Hello>());
  CHECK(e->message.get<proto::Hello>()->pid == 42);
  CHECK(channel.dropped() == 0);

  // And the driver's answer reaches that worker.
  proto::Welcome welcome;
  welcome.self = 1;
  channel.send(1, Message{0, welcome});
  auto w = link->recv(5s);
  REQUIRE(w);
  REQUIRE(w->get<proto::Welcome>());
  CHECK(w->get<proto::Welcome>()->self == 1);
}

TEST_CASE("worker link: recv_ready takes what came, and a poll announces what comes after",
          "[zmq]") {
  // The worker's inbox reads its link only when a poll says so (three system calls a call):
  // whatever recv_ready leaves, the link's descriptor must wake for.
  int lost = 0;
  auto channel = std::make_unique<LocalDriverChannel>(std::vector<std::string>{"w0"});
  auto link = local_link(*channel, 0, &lost);
  REQUIRE(link->waitable().level_triggered());
  CHECK_FALSE(link->recv_ready());
  channel->send(0, Message{1, proto::Shutdown{}});
  channel->send(0, Message{2, proto::Shutdown{}});  // after a first message: may wait (kCoalesce)
  for (std::uint64_t id = 1; id <= 2; ++id) {
    REQUIRE(wait_readable({link->waitable()}, -1, 5s));
    auto m = link->recv_ready();
    if (!m && id == 2) {  // the second was written later than the first read
      REQUIRE(wait_readable({link->waitable()}, -1, 5s));
      m = link->recv_ready();
    }
    REQUIRE(m);
    CHECK(m->id == id);
  }
  CHECK_FALSE(link->recv_ready());
  CHECK_FALSE(wait_readable({link->waitable()}, -1, 0ms));  // nothing more: no wake
  // An answer read by the driver: the next message is written at once, and the poll wakes.
  link->send(Message{2, proto::Reply{std::nullopt, encode(Value(1))}});
  REQUIRE(channel->next(5s));
  channel->send(0, Message{3, proto::Shutdown{}});
  REQUIRE(wait_readable({link->waitable()}, -1, 5s));
  auto third = link->recv_ready();
  REQUIRE(third);
  CHECK(third->id == 3);
  CHECK_FALSE(link->recv_ready());
  // The driver gone: the poll wakes, and recv_ready reports the loss once.
  channel.reset();
  REQUIRE(wait_readable({link->waitable()}, -1, 5s));
  CHECK_FALSE(link->recv_ready());
  CHECK_FALSE(link->recv_ready());
  CHECK(lost == 1);
}

TEST_CASE("driver channel: a burst to a busy worker is written together, and all of it arrives",
          "[zmq]") {
  // The first message of a burst is written at once; the rest wait for the flusher
  // (kCoalesce). The driver reads nothing meanwhile: the last of them arrives all the same.
  LocalDriverChannel channel({"w0"});
  auto link = local_link(channel, 0);
  channel.send(0, Message{1, proto::Shutdown{}});
  auto first = link->recv(0ms);  // in the pipe when send returned
  REQUIRE(first);
  CHECK(first->id == 1);
  constexpr int kBurst = 2000;
  for (int i = 2; i <= kBurst; ++i)
    channel.send(0, Message{static_cast<std::uint64_t>(i), proto::Shutdown{}});
  for (int i = 2; i <= kBurst; ++i) {
    auto m = link->recv(5s);
    REQUIRE(m);
    REQUIRE(m->id == static_cast<std::uint64_t>(i));
  }
  // An answer read: the next message is written at once again.
  link->send(Message{kBurst, proto::Reply{std::nullopt, encode(Value(1))}});
  auto e = channel.next(5s);
  REQUIRE(e);
  REQUIRE(e->kind == ChannelEvent::Kind::message);
  channel.send(0, Message{kBurst + 1, proto::Shutdown{}});
  auto next = link->recv(0ms);
  REQUIRE(next);
  CHECK(next->id == kBurst + 1);

  // The worker's side: answers sent one after another with nothing read in between wait for
  // its flusher, and more than its pipe holds does not block it; the driver gets them all, in
  // order.
  const std::string pad(20000, 'p');
  for (int i = 1; i <= 200; ++i)  // 4 MB: more than the pipe takes
    link->send(
        Message{static_cast<std::uint64_t>(i), proto::Reply{std::nullopt, encode(Value(pad))}});
  for (int i = 1; i <= 200; ++i) {
    auto r = channel.next(5s);
    REQUIRE(r);
    REQUIRE(r->kind == ChannelEvent::Kind::message);
    REQUIRE(r->message.id == static_cast<std::uint64_t>(i));
  }
}

TEST_CASE("driver channel: a message waits no longer for a worker whose pipe another fills",
          "[zmq]") {
  // Worker 0 reads nothing, so what the driver sends it fills its pipe and the flusher waits for
  // room there; a burst to worker 1 meanwhile still reaches it, without the driver reading.
  LocalDriverChannel channel({"w0", "w1"});
  auto link0 = local_link(channel, 0);
  auto link1 = local_link(channel, 1);
  const std::string pad(20000, 'p');
  for (int i = 1; i <= 100; ++i)  // 2 MB: more than the pipe takes
    channel.send(0, Message{static_cast<std::uint64_t>(i),
                            proto::Call{1, "m", "x.cpp:1", encode(Value(pad)), {}}});
  for (int i = 1; i <= 3; ++i)
    channel.send(1, Message{static_cast<std::uint64_t>(i), proto::Shutdown{}});
  for (int i = 1; i <= 3; ++i) {
    auto m = link1->recv(5s);
    REQUIRE(m);
    REQUIRE(m->id == static_cast<std::uint64_t>(i));
  }
  // And worker 0 gets all of its own once it reads.
  for (int i = 1; i <= 100; ++i) {
    auto m = link0->recv(5s);
    REQUIRE(m);
    REQUIRE(m->id == static_cast<std::uint64_t>(i));
  }
}

TEST_CASE("driver channel: one message sent to each of several workers reaches every one whole",
          "[zmq]") {
  // send_each encodes a message without tensors once for all: worker 0 reads nothing, so the
  // rest of each message waits for its pipe to have room, kept from the one encoding that the
  // others were sent too; each gets all of its own, intact.
  LocalDriverChannel channel({"w0", "w1", "w2"});
  auto link0 = local_link(channel, 0);
  auto link1 = local_link(channel, 1);
  auto link2 = local_link(channel, 2);
  std::string pad(100000, 'p');    // a frame large enough to wait as it is, not copied
  for (int i = 1; i <= 40; ++i) {  // 4 MB: more than worker 0's pipe takes
    pad[0] = static_cast<char>('a' + i % 26);
    channel.send_each({0, 1, 2}, Message{static_cast<std::uint64_t>(i),
                                         proto::Call{1, "m", "x.cpp:1", encode(Value(pad)), {}}});
    for (auto* link : {link1.get(), link2.get()}) {
      auto m = link->recv(5s);
      REQUIRE(m);
      REQUIRE(m->id == static_cast<std::uint64_t>(i));
      REQUIRE(decode(m->get<proto::Call>()->args).as<std::string>() == pad);
    }
  }
  for (int i = 1; i <= 40; ++i) {
    pad[0] = static_cast<char>('a' + i % 26);
    auto m = link0->recv(5s);
    REQUIRE(m);
    REQUIRE(m->id == static_cast<std::uint64_t>(i));
    REQUIRE(decode(m->get<proto::Call>()->args).as<std::string>() == pad);
  }
  // With a tensor for shared memory, each worker is sent its own encoding and its own segment.
  Tensor big(DType::f32, {static_cast<std::int64_t>(kShmThreshold / 4 + 1)});
  big.mutable_span<float>()[12345] = 9;
  channel.send_each({1, 2}, Message{200, proto::Call{1, "m", "x.cpp:1", encode(Value(big)), {}}});
  for (auto* link : {link1.get(), link2.get()}) {
    auto m = link->recv(5s);
    REQUIRE(m);
    REQUIRE(m->id == 200);
    const Value got = decode(m->get<proto::Call>()->args);
    CHECK(got.tensor().span<float>()[12345] == 9);
    CHECK(got.tensor().shm_fd() >= 0);
  }
}

TEST_CASE("driver channel: tensors reach a local worker inline and in shared memory", "[zmq]") {
  LocalDriverChannel channel({"w0"});
  auto link = local_link(channel, 0);
  // One below the shared-memory threshold (a frame of its own), one above (a memfd).
  Tensor small(DType::f32, {1000});
  Tensor big(DType::f32, {static_cast<std::int64_t>(kShmThreshold / 4 + 1)});
  small.mutable_span<float>()[999] = 7;
  big.mutable_span<float>()[12345] = 9;
  channel.send(
      0, Message{5, proto::Call{
                        1, "m", "x.cpp:1", encode(Value::list({Value(small), Value(big)})), {}}});
  auto m = link->recv(5s);
  REQUIRE(m);
  REQUIRE(m->get<proto::Call>());
  CHECK(m->id == 5);
  const Value args = decode(m->get<proto::Call>()->args);
  CHECK(args[0].tensor().span<float>()[999] == 7);
  CHECK(args[0].tensor().shm_fd() < 0);
  CHECK(args[1].tensor().span<float>()[12345] == 9);
  CHECK(args[1].tensor().shm_fd() >= 0);
}

TEST_CASE("driver channel: more than the sockets hold, both ways, without blocking either side",
          "[zmq]") {
  // The driver sends calls without reading while the worker answers each: neither blocks on the
  // other (the driver's sends wait in its outbox, the worker's replies in the socket), and all
  // arrive in order.
  LocalDriverChannel channel({"w0"});
  auto link = local_link(channel, 0);
  const std::string pad(60000, 'p');
  constexpr int kCalls = 400;  // 24 MB each way: more than any socket buffer
  for (int i = 0; i < kCalls; ++i)
    channel.send(0, Message{static_cast<std::uint64_t>(i + 1),
                            proto::Call{1, "m", pad, encode(Value::list()), {}}});
  std::thread worker([&] {
    for (int i = 0; i < kCalls; ++i) {
      auto m = link->recv(10s);
      if (!m || m->id != static_cast<std::uint64_t>(i + 1)) return;
      link->send(Message{m->id, proto::Reply{std::nullopt, encode(Value(pad))}});
    }
  });
  int got = 0;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (got < kCalls && std::chrono::steady_clock::now() < deadline) {
    auto e = channel.next(100ms);
    if (!e || e->kind != ChannelEvent::Kind::message) continue;
    if (e->message.id != static_cast<std::uint64_t>(got + 1)) break;
    ++got;
  }
  worker.join();
  CHECK(got == kCalls);
}

TEST_CASE("driver channel: lost() from another thread wakes a next() that waits forever", "[zmq]") {
  LocalDriverChannel channel({"w0", "w1"});
  auto waiting =
      std::async(std::launch::async, [&] { return channel.next(std::chrono::milliseconds(-1)); });
  std::thread reporter([&] { channel.lost(1, "exited with code 3"); });
  reporter.join();
  const bool woke = waiting.wait_for(5s) == std::future_status::ready;
  if (!woke) channel.wake();  // let the waiting thread end before the channel does
  REQUIRE(woke);
  auto e = waiting.get();
  REQUIRE(e);
  CHECK(e->kind == ChannelEvent::Kind::lost);
  CHECK(e->peer == 1);
  CHECK(e->reason == "exited with code 3");
  CHECK_FALSE(channel.next(0ms));  // delivered once
}

TEST_CASE("driver channel: a loss queued before next() is delivered once", "[zmq]") {
  LocalDriverChannel channel({"w0", "w1"});
  channel.lost(0, "killed by signal 9");
  auto e = channel.next(5s);
  REQUIRE(e);
  CHECK(e->kind == ChannelEvent::Kind::lost);
  CHECK(e->peer == 0);
  CHECK_FALSE(channel.next(0ms));
}

TEST_CASE("driver channel: wake() makes a waiting next() return a wake event", "[zmq]") {
  LocalDriverChannel channel({"w0"});
  channel.wake();
  auto e = channel.next(5s);
  REQUIRE(e);
  CHECK(e->kind == ChannelEvent::Kind::wake);
}

namespace {

// Worker `peer` answers call 7 and is gone (its end closed) before the driver reads the answer.
void answer_and_die(LocalDriverChannel& channel, std::size_t peer, int* lost) {
  auto link = local_link(channel, peer, lost);
  link->send(Message{7, proto::Reply{std::nullopt, encode(Value(1))}});
}

// The driver's next events after answer_and_die and a loss: the answer, then the loss.
ChannelEvent answer_then_loss(LocalDriverChannel& channel) {
  auto first = channel.next(5s);
  REQUIRE(first);
  CHECK(first->kind == ChannelEvent::Kind::message);
  CHECK(first->message.id == 7);
  auto second = channel.next(5s);
  REQUIRE(second);
  CHECK(second->kind == ChannelEvent::Kind::lost);
  return std::move(*second);
}

}  // namespace

TEST_CASE("driver channel: a lost worker's last messages come before its loss", "[zmq]") {
  LocalDriverChannel channel({"w0", "w1"});
  int lost = 0;
  answer_and_die(channel, 1, &lost);
  channel.lost(1, "exited with code 3");
  CHECK(answer_then_loss(channel).peer == 1);
  CHECK_NOTHROW(channel.send(1, Message{0, proto::Shutdown{}}));  // to no one: dropped
  CHECK(lost == 0);
}

TEST_CASE("driver channel: a call to a worker that just died is not the error; its loss is",
          "[zmq]") {
  // The driver writes to a worker that died with an answer still unread (the write finds the
  // other end gone): the write goes nowhere without an error, the answer is still read, then
  // the loss comes, which is what names how the worker ended.
  LocalDriverChannel channel({"w0"});
  int lost = 0;
  answer_and_die(channel, 0, &lost);
  CHECK_NOTHROW(channel.send(0, Message{8, proto::Shutdown{}}));
  CHECK_NOTHROW(channel.send(0, Message{9, proto::Shutdown{}}));
  channel.lost(0, "killed by signal 6");
  CHECK(answer_then_loss(channel).reason == "killed by signal 6");
  CHECK(channel.dropped() == 0);  // a worker that died is no malformed stream
}

TEST_CASE("driver channel: a worker's link says so when the driver's end is gone", "[zmq]") {
  int lost = 0;
  std::unique_ptr<WorkerLink> link;
  {
    LocalDriverChannel channel({"w0"});
    link = local_link(channel, 0, &lost);
    channel.send(0, Message{0, proto::Shutdown{}});
  }
  // What the driver sent before it went is still read, then the loss is told once.
  auto m = link->recv(5s);
  REQUIRE(m);
  CHECK(m->type() == MsgType::shutdown);
  CHECK_FALSE(link->recv(5s));
  CHECK(lost == 1);
  CHECK_FALSE(link->recv(0ms));
  link->send(Message{0, proto::Shutdown{}});  // no one to send to: dropped, no error
  CHECK(lost == 1);
}

namespace {

// A local serve socket in `dir` and a PeerChannel of worker "a:0" whose peer 1 ("b:0") it is.
struct PeerPair {
  explicit PeerPair(const fs::path& dir, const std::string& caller = "a:0")
      : serve(context, "unix://" + (dir / "w1").string(), {}),
        peers(context, caller, {"a:0", "b:0"}, {"", serve.endpoint()}, {}) {
    ::signal(SIGPIPE, SIG_IGN);
  }
  zmq::context_t context;
  ServeSocket serve;
  PeerChannel peers;
};

Message peer_call(std::uint64_t id, const Value& args = Value::list()) {
  return Message{id, proto::Call{1, "m", "x.cpp:1", encode(args), {}}};
}

// The next message event of `peers` within `timeout`, skipping none.
std::optional<ChannelEvent> next_message(PeerChannel& peers, std::chrono::milliseconds timeout) {
  auto e = peers.next(timeout);
  if (e && e->kind != ChannelEvent::Kind::message) return std::nullopt;
  return e;
}

// A raw connection to the serve socket at `path` that sends `bytes` (no descriptors) unless
// `bytes` is empty; kept open while it lives.
Fd raw_peer(const fs::path& path, const std::string& bytes) {
  Fd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
  REQUIRE(::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  if (!bytes.empty()) REQUIRE(::send(fd.get(), bytes.data(), bytes.size(), 0) > 0);
  return fd;
}

}  // namespace

TEST_CASE("calls between workers: a call and its reply, inline and in shared memory", "[zmq]") {
  TempDir dir;
  PeerPair p(dir.path);
  Tensor small(DType::f32, {1000});
  Tensor big(DType::f32, {static_cast<std::int64_t>(kShmThreshold / 4 + 1)});
  small.mutable_span<float>()[999] = 7;
  big.mutable_span<float>()[12345] = 9;
  p.peers.send(1, peer_call(5, Value::list({Value(small), Value(big)})));
  auto r = p.serve.recv(5s);
  REQUIRE(r);
  CHECK(r->from == "a:0");
  REQUIRE(r->message.get<proto::Call>());
  CHECK(r->message.id == 5);
  const Value args = decode(r->message.get<proto::Call>()->args);
  CHECK(args[0].tensor().span<float>()[999] == 7);
  CHECK(args[0].tensor().shm_fd() < 0);
  CHECK(args[1].tensor().span<float>()[12345] == 9);
  CHECK(args[1].tensor().shm_fd() >= 0);
  CHECK(p.serve.callers() == 1);

  Tensor result = p.serve.pool()->tensor(DType::f32, {static_cast<std::int64_t>(kShmThreshold)});
  result.mutable_span<float>()[3] = 11;
  p.serve.reply("a:0", Message{5, proto::Reply{std::nullopt, encode(Value(result))}});
  auto e = next_message(p.peers, 5s);
  REQUIRE(e);
  CHECK(e->peer == 1);
  CHECK(e->message.id == 5);
  const auto* reply = e->message.get<proto::Reply>();
  REQUIRE(reply);
  const Value v = decode(reply->value);
  CHECK(v.tensor().span<float>()[3] == 11);
  CHECK(v.tensor().shm_fd() >= 0);
  CHECK(p.serve.dropped() == 0);
  CHECK(p.peers.dropped() == 0);
}

TEST_CASE(
    "calls between workers: more than the pipes hold, both ways, without blocking either side",
    "[zmq]") {
  // As between the driver and a worker: the caller sends without reading while the served
  // worker answers each; neither blocks (what a pipe does not take waits for the flushers), and
  // all arrive in order.
  TempDir dir;
  PeerPair p(dir.path);
  const std::string pad(60000, 'p');
  constexpr int kCalls = 200;  // 12 MB each way: far more than a 64 KiB pipe
  for (int i = 0; i < kCalls; ++i)
    p.peers.send(1, peer_call(static_cast<std::uint64_t>(i + 1), Value::list({Value(pad)})));
  std::thread worker([&] {
    for (int i = 0; i < kCalls; ++i) {
      auto r = p.serve.recv(10s);
      if (!r || r->message.id != static_cast<std::uint64_t>(i + 1)) return;
      p.serve.reply(r->from,
                    Message{r->message.id, proto::Reply{std::nullopt, encode(Value(pad))}});
    }
  });
  int got = 0;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (got < kCalls && std::chrono::steady_clock::now() < deadline) {
    auto e = next_message(p.peers, 100ms);
    if (!e) continue;
    if (e->message.id != static_cast<std::uint64_t>(got + 1)) break;
    ++got;
  }
  worker.join();
  CHECK(got == kCalls);
}

TEST_CASE("calls between workers: what is not a worker's greeting is dropped, callers still served",
          "[zmq]") {
  TempDir dir;
  PeerPair p(dir.path);
  const fs::path path = dir.path / "w1";
  Fd junk = raw_peer(path, "hello");    // not a greeting
  Fd bare = raw_peer(path, "TWKGa:0");  // a greeting without its descriptors
  Fd silent = raw_peer(path, "");       // connects and says nothing
  { Fd gone = raw_peer(path, ""); }     // connects and closes
  CHECK_FALSE(p.serve.recv(200ms));
  CHECK(p.serve.dropped() == 2);
  CHECK(p.serve.callers() == 0);
  p.peers.send(1, peer_call(1));
  auto r = p.serve.recv(5s);
  REQUIRE(r);
  CHECK(r->from == "a:0");
  CHECK(p.serve.callers() == 1);
}

TEST_CASE("calls between workers: a caller that greets under a known name takes its replies",
          "[zmq]") {
  // A worker replaced after a restart calls under its predecessor's name.
  TempDir dir;
  PeerPair p(dir.path);
  p.peers.send(1, peer_call(1));
  REQUIRE(p.serve.recv(5s));
  PeerChannel successor(p.context, "a:0", {"a:0", "b:0"}, {"", p.serve.endpoint()}, {});
  successor.send(1, peer_call(2));
  auto r = p.serve.recv(5s);
  REQUIRE(r);
  CHECK(r->message.id == 2);
  CHECK(p.serve.callers() == 1);
  p.serve.reply("a:0", Message{2, proto::Reply{std::nullopt, encode(Value(3))}});
  auto e = next_message(successor, 5s);
  REQUIRE(e);
  CHECK(e->message.id == 2);
  CHECK_FALSE(next_message(p.peers, 100ms));  // the predecessor's connection was closed
}

TEST_CASE("calls between workers: a worker that is gone is not the caller's error", "[zmq]") {
  // Its loss (or replacement) comes from the driver; what it is sent meanwhile goes nowhere.
  TempDir dir;
  zmq::context_t context;
  ::signal(SIGPIPE, SIG_IGN);
  auto serve = std::make_unique<ServeSocket>(context, "unix://" + (dir.path / "w1").string(),
                                             SocketSecurity{});
  PeerChannel peers(context, "a:0", {"a:0", "b:0"}, {"", serve->endpoint()}, {});
  peers.send(1, peer_call(1));
  REQUIRE(serve->recv(5s));
  serve.reset();  // the worker ends: its socket file goes, its pipes close
  CHECK_FALSE(fs::exists(dir.path / "w1"));
  CHECK_FALSE(peers.next(200ms));  // the closed connection is dropped, not waited on forever
  CHECK_NOTHROW(peers.send(1, peer_call(2)));
  CHECK_FALSE(peers.next(50ms));
  CHECK(peers.dropped() == 0);
}

TEST_CASE("calls between workers: a caller that ends is closed on the serving side", "[zmq]") {
  TempDir dir;
  zmq::context_t context;
  ServeSocket serve(context, "unix://" + (dir.path / "w1").string(), {});
  {
    PeerChannel peers(context, "a:0", {"a:0", "b:0"}, {"", serve.endpoint()}, {});
    peers.send(1, peer_call(1));
    REQUIRE(serve.recv(5s));
    CHECK(serve.callers() == 1);
  }
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (serve.callers() != 0 && std::chrono::steady_clock::now() < deadline) serve.recv(100ms);
  CHECK(serve.callers() == 0);
  CHECK(serve.dropped() == 0);
}

TEST_CASE("calls between remote workers without keys: TCP streams", "[zmq]") {
  zmq::context_t context;
  ::signal(SIGPIPE, SIG_IGN);
  auto serve = std::make_unique<ServeSocket>(context, "tcp+stream://127.0.0.1:*", SocketSecurity{});
  const std::string at = serve->endpoint();
  REQUIRE(at.starts_with("tcp+stream://127.0.0.1:"));
  CHECK(serve->waitable().level_triggered());
  PeerChannel peers(context, "a:0", {"a:0", "b:0"}, {"", at}, {});

  SECTION("a call and its reply carry a tensor in the stream") {
    Tensor big(DType::f32, {static_cast<std::int64_t>(kShmThreshold / 4 + 1)});
    big.mutable_span<float>()[12345] = 9;
    peers.send(1, peer_call(5, Value::list({Value(big)})));
    auto r = serve->recv(5s);
    REQUIRE(r);
    CHECK(r->from == "a:0");
    REQUIRE(r->message.get<proto::Call>());
    const Value args = decode(r->message.get<proto::Call>()->args);
    CHECK(args[0].tensor().span<float>()[12345] == 9);
    CHECK(args[0].tensor().shm_fd() < 0);  // no shared memory between machines
    serve->reply("a:0", Message{5, proto::Reply{std::nullopt, encode(Value(big))}});
    auto e = next_message(peers, 5s);
    REQUIRE(e);
    CHECK(e->peer == 1);
    CHECK(e->message.id == 5);
    REQUIRE(e->message.get<proto::Reply>());
    CHECK(decode(e->message.get<proto::Reply>()->value).tensor().span<float>()[12345] == 9);
    CHECK(serve->dropped() == 0);
    CHECK(peers.dropped() == 0);
  }

  SECTION("a first message that is not a greeting is dropped and its connection closed") {
    FrameStream call(connect_stream(at, "the serve socket"));  // a call without a greeting
    call.send(encode_message(peer_call(1)));
    FrameStream nameless(connect_stream(at, "the serve socket"));  // a greeting without a name
    Frames empty;
    empty.emplace_back("TWKG", 4);
    nameless.send(std::move(empty));
    FrameStream silent(connect_stream(at, "the serve socket"));  // says nothing: waits
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (serve->dropped() < 2 && std::chrono::steady_clock::now() < deadline) serve->recv(50ms);
    CHECK(serve->dropped() == 2);
    CHECK(serve->callers() == 1);  // the silent one
    for (FrameStream* s : {&call, &nameless}) {
      FrameStream::Read got = FrameStream::Read::empty;
      for (int i = 0; i < 100 && got != FrameStream::Read::closed; ++i) {
        pollfd p{s->in_fd(), POLLIN, 0};
        ::poll(&p, 1, 50);
        got = s->read();
      }
      CHECK(got == FrameStream::Read::closed);
    }
    peers.send(1, peer_call(2));  // the real caller is served
    auto r = serve->recv(5s);
    REQUIRE(r);
    CHECK(r->from == "a:0");
    CHECK(r->message.id == 2);
  }

  SECTION("a caller that greets under a known name takes its replies") {
    peers.send(1, peer_call(1));
    REQUIRE(serve->recv(5s));
    PeerChannel successor(context, "a:0", {"a:0", "b:0"}, {"", at}, {});
    successor.send(1, peer_call(2));
    auto r = serve->recv(5s);
    REQUIRE(r);
    CHECK(r->message.id == 2);
    serve->reply("a:0", Message{2, proto::Reply{std::nullopt, encode(Value(3))}});
    auto e = next_message(successor, 5s);
    REQUIRE(e);
    CHECK(e->message.id == 2);
    CHECK_FALSE(next_message(peers, 100ms));  // the predecessor's connection was closed
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (serve->callers() != 1 && std::chrono::steady_clock::now() < deadline) serve->recv(50ms);
    CHECK(serve->callers() == 1);
  }

  SECTION("a worker that is gone is not the caller's error") {
    peers.send(1, peer_call(1));
    REQUIRE(serve->recv(5s));
    serve.reset();
    CHECK_FALSE(peers.next(200ms));              // the closed connection is dropped
    CHECK_NOTHROW(peers.send(1, peer_call(2)));  // refused: nowhere, its loss comes from the driver
    CHECK_FALSE(peers.next(50ms));
    CHECK(peers.dropped() == 0);
  }
}

TEST_CASE("calls between workers: a serve socket path too long for a Unix socket", "[zmq]") {
  TempDir dir;
  zmq::context_t context;
  const std::string path = (dir.path / std::string(120, 'd')).string();
  try {
    ServeSocket serve(context, "unix://" + path, {});
    FAIL("a serve socket path of " << path.size() << " bytes was bound");
  } catch (const TransportError& e) {
    CHECK_THAT(e.what(), Catch::Contains("longer than a Unix socket's 107 bytes"));
  }
}

// Remote workers of a cluster without keys: one TCP stream each, known by its first hello.
TEST_CASE("stream channel: a worker's hello names its connection; calls and replies both ways",
          "[zmq]") {
  StreamDriverChannel channel("127.0.0.1", {"w0", "w1"});
  REQUIRE(channel.endpoint().starts_with("tcp+stream://127.0.0.1:"));
  auto link = connect_stream_worker(channel.endpoint(), [](const std::string&) {});
  link->send(Message{0, proto::Hello{"w1", "g", 1, 42, "h", ""}});
  auto e = channel.next(5s);
  REQUIRE(e);
  REQUIRE(e->kind == ChannelEvent::Kind::message);
  CHECK(e->peer == 1);
  REQUIRE(e->message.get<proto::Hello>());
  CHECK(e->message.get<proto::Hello>()->pid == 42);

  Tensor t(DType::f32, {static_cast<std::int64_t>(kShmThreshold / 4 + 1)});  // in the stream
  t.mutable_span<float>()[777] = 5;
  channel.send(1, Message{7, proto::Call{1, "m", "x.cpp:1", encode(Value::list({Value(t)})), {}}});
  auto m = link->recv(5s);
  REQUIRE(m);
  REQUIRE(m->get<proto::Call>());
  CHECK(m->id == 7);
  CHECK(decode(m->get<proto::Call>()->args)[0].tensor().span<float>()[777] == 5);
  link->send(Message{7, proto::Reply{std::nullopt, encode(Value(9))}});
  e = channel.next(5s);
  REQUIRE(e);
  CHECK(e->peer == 1);
  REQUIRE(e->message.get<proto::Reply>());
  CHECK(decode(e->message.get<proto::Reply>()->value).as<int>() == 9);
  CHECK(channel.dropped() == 0);
}

TEST_CASE("stream channel: what does not begin with a worker's hello is closed and counted",
          "[zmq]") {
  StreamDriverChannel channel("127.0.0.1", {"w0", "w1"});
  // Not Twinkle at all; a hello of another build (protocol version 1); a hello from a name that
  // is not a worker of the run; a call before any hello.
  auto junk = connect_stream(channel.endpoint());
  REQUIRE(::send(junk.get(), "GET / HTTP/1.0\r\n\r\n", 18, MSG_NOSIGNAL) == 18);
  Frames v1 = encode_message(Message{0, proto::Hello{"w1", "g", 1, 1, "x", ""}});
  put_u16(v1, 4, 1);
  FrameStream old_stream(connect_stream(channel.endpoint()));
  old_stream.send(std::move(v1));
  auto stranger = connect_stream_worker(channel.endpoint(), [](const std::string&) {});
  stranger->send(Message{0, proto::Hello{"intruder", "g", 0, 1, "x", ""}});
  auto early = connect_stream_worker(channel.endpoint(), [](const std::string&) {});
  early->send(Message{1, proto::Shutdown{}});
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (channel.dropped() < 4 && std::chrono::steady_clock::now() < deadline) {
    auto e = channel.next(20ms);
    CHECK_FALSE(e);  // nothing is delivered for them
  }
  CHECK(channel.dropped() == 4);
  // The real worker still says hello and is answered.
  auto link = connect_stream_worker(channel.endpoint(), [](const std::string&) {});
  link->send(Message{0, proto::Hello{"w1", "g", 1, 42, "h", ""}});
  auto e = channel.next(5s);
  REQUIRE(e);
  CHECK(e->peer == 1);
  channel.send(1, Message{0, proto::Shutdown{}});
  auto w = link->recv(5s);
  REQUIRE(w);
  CHECK(w->type() == MsgType::shutdown);
}

TEST_CASE("stream channel: a stranger that says hello first under a worker's name does not keep it",
          "[zmq]") {
  StreamDriverChannel channel("127.0.0.1", {"w0", "w1"});
  auto stranger = connect_stream_worker(channel.endpoint(), [](const std::string&) {});
  stranger->send(Message{0, proto::Hello{"w1", "g", 1, 1, "x", ""}});
  auto e = channel.next(5s);
  REQUIRE(e);
  CHECK(e->peer == 1);
  // The worker's own connection, later, takes the name over: what is sent to w1 reaches it.
  auto link = connect_stream_worker(channel.endpoint(), [](const std::string&) {});
  link->send(Message{0, proto::Hello{"w1", "g", 1, 42, "h", ""}});
  e = channel.next(5s);
  REQUIRE(e);
  CHECK(e->peer == 1);
  REQUIRE(e->message.get<proto::Hello>());
  CHECK(e->message.get<proto::Hello>()->pid == 42);
  channel.send(1, Message{3, proto::Shutdown{}});
  auto w = link->recv(5s);
  REQUIRE(w);
  CHECK(w->id == 3);
  CHECK_FALSE(stranger->recv(100ms));
}

TEST_CASE("stream channel: a remote worker hears at once that the driver's end is gone", "[zmq]") {
  // Without reading: its worker's thread may be busy in plugin code.
  std::atomic<int> lost{0};
  std::promise<std::string> told;
  auto why = told.get_future();
  std::unique_ptr<WorkerLink> link;
  {
    StreamDriverChannel channel("127.0.0.1", {"w0"});
    link = connect_stream_worker(channel.endpoint(), [&](const std::string& w) {
      if (lost++ == 0) told.set_value(w);
    });
    link->send(Message{0, proto::Hello{"w0", "g", 0, 42, "h", ""}});
    REQUIRE(channel.next(5s));
  }
  REQUIRE(why.wait_for(5s) == std::future_status::ready);
  CHECK_THAT(why.get(), Catch::Contains("the connection to the driver at tcp+stream://"));
  CHECK_FALSE(link->recv(100ms));
  CHECK(lost == 1);
}

TEST_CASE(
    "stream channel: a worker that does not read for longer than the heartbeat timeout "
    "keeps its connection",
    "[zmq]") {
  // A worker in a long call does not read its stream: what the driver sends fills the window, and
  // the connection must live on (a TCP user timeout of 3 s ended it after 3.5 s).
  std::atomic<int> lost{0};
  StreamDriverChannel channel("127.0.0.1", {"w0"});
  auto link = connect_stream_worker(channel.endpoint(), [&](const std::string&) { ++lost; });
  link->send(Message{0, proto::Hello{"w0", "g", 0, 42, "h", ""}});
  REQUIRE(channel.next(5s));
  const std::string pad(1 << 20, 'p');
  constexpr int kCalls = 24;  // 24 MiB: more than both sockets' buffers
  for (int i = 0; i < kCalls; ++i)
    channel.send(0, Message{static_cast<std::uint64_t>(i + 1),
                            proto::Call{1, "m", pad, encode(Value::list()), {}}});
  // Nothing comes back while the worker is busy: the driver's wait outlasts kHeartbeatTimeout.
  CHECK_FALSE(channel.next(kHeartbeatTimeout + 1500ms));
  int got = 0;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (got < kCalls && std::chrono::steady_clock::now() < deadline) {
    auto m = link->recv(100ms);
    if (m && m->id == static_cast<std::uint64_t>(got + 1)) ++got;
    channel.next(0ms);  // the driver writes what waits as the window opens
  }
  CHECK(got == kCalls);
  CHECK(lost == 0);
}

TEST_CASE("stream channel: a driver that is not there is named", "[zmq]") {
  std::string endpoint;
  { endpoint = StreamDriverChannel("127.0.0.1", {"w0"}).endpoint(); }  // its port is free again
  try {
    connect_stream(endpoint);
    FAIL("connected to " << endpoint);
  } catch (const TransportError& e) {
    CHECK_THAT(e.what(), Catch::Contains("cannot reach the driver at " + endpoint));
  }
  CHECK_THROWS_AS(connect_stream("tcp://127.0.0.1:1"), TransportError);
}

TEST_CASE("frame stream: a stream whose framing breaks is closed and says why", "[zmq]") {
  auto pair = FdPair::stream("a test");
  FrameStream reader(std::move(pair.first));
  unsigned char bogus[8];
  const std::uint64_t size = FrameStream::kMaxFrame + 1;
  for (int i = 0; i < 8; ++i) bogus[i] = static_cast<unsigned char>(size >> (8 * i));
  REQUIRE(::write(pair.second.get(), bogus, sizeof bogus) == 8);
  REQUIRE(reader.read() == FrameStream::Read::data);
  CHECK_FALSE(reader.take());
  CHECK(reader.closed());
  CHECK(reader.error() == fmt::format("a frame of {} bytes (the framing is broken)", size));
}

TEST_CASE("frame stream: a message in several frames arrives whole, split across reads", "[zmq]") {
  auto pair = FdPair::stream("a test");
  FrameStream writer(std::move(pair.first)), reader(std::move(pair.second));
  Frames out;
  out.emplace_back(std::string("head"));
  out.emplace_back();  // an empty frame stays a frame
  out.emplace_back(std::string(200000, 'x'));
  writer.send(std::move(out));
  REQUIRE(writer.flush_wait(5s));
  std::optional<Frames> in;
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (!in && std::chrono::steady_clock::now() < deadline) in = reader.recv();
  REQUIRE(in);
  REQUIRE(in->size() == 3);
  CHECK((*in)[0].to_string() == "head");
  CHECK((*in)[1].size() == 0);
  CHECK((*in)[2].size() == 200000);
  CHECK_FALSE(reader.take());
}

TEST_CASE("frame stream: large frames that wait, between small ones, arrive whole and in order",
          "[zmq]") {
  // More than the pipe holds: what waits is partly kept as frames (large payloads), partly as
  // bytes (heads, small frames), and must leave in the order it was sent. Large messages are
  // handed to the reader as views of its read buffer.
  auto to_reader = FdPair::pipe("a test");
  auto to_writer = FdPair::pipe("a test");
  FrameStream writer(std::move(to_writer.first), std::move(to_reader.second), false);
  FrameStream reader(std::move(to_reader.first), std::move(to_writer.second), false);
  constexpr int kMessages = 24;
  for (int i = 0; i < kMessages; ++i) {
    Frames out;
    out.emplace_back(fmt::format("m{}", i));
    // 1.5 MiB, 200 KiB and 1 KiB payloads in turn: held frames, one read buffer adopted.
    const std::size_t big = i % 3 == 0 ? (3u << 19) : i % 3 == 1 ? 200000u : 1000u;
    out.emplace_back(std::string(big, static_cast<char>('a' + i % 26)));
    out.emplace_back(std::string(100000, static_cast<char>('A' + i % 26)));
    writer.send(std::move(out), i % 2 == 0);  // now, or into the outbox after the others
  }
  int got = 0;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (got < kMessages && std::chrono::steady_clock::now() < deadline) {
    writer.flush();
    while (auto in = reader.recv()) {
      REQUIRE(in->size() == 3);
      CHECK((*in)[0].to_string() == fmt::format("m{}", got));
      const std::size_t big = got % 3 == 0 ? (3u << 19) : got % 3 == 1 ? 200000u : 1000u;
      const std::string b = (*in)[1].to_string(), c = (*in)[2].to_string();
      CHECK(b == std::string(big, static_cast<char>('a' + got % 26)));
      CHECK(c == std::string(100000, static_cast<char>('A' + got % 26)));
      ++got;
    }
  }
  CHECK(got == kMessages);
  CHECK_FALSE(writer.has_output());
}

TEST_CASE("rendezvous store: a socket path too long for a Unix socket", "[zmq]") {
  zmq::context_t ctx;
  const std::string path = "/tmp/" + std::string(103, 'x');  // 108 characters
  REQUIRE(path.size() == 108);
  CHECK_THROWS_WITH(
      KvServer(ctx, "ipc://" + path),
      fmt::format("the rendezvous socket path {} is 108 characters long, more than a Unix socket "
                  "allows (107); set TMPDIR to a shorter folder",
                  path));
}

TEST_CASE("rendezvous store: a path of 107 characters still binds", "[zmq]") {
  TempDir dir;
  zmq::context_t ctx;
  const std::size_t name = 107 - dir.path.string().size() - 1;
  const fs::path path = dir.path / std::string(name, 's');
  REQUIRE(path.string().size() == 107);
  KvServer server(ctx, "ipc://" + path.string());
  CHECK(fs::exists(path));
}

TEST_CASE("docs/ARCHITECTURE.md lists every message with the fields the code has", "[zmq]") {
  const fs::path doc = fs::path(TWINKLE_TEST_DATA) / ".." / "docs" / "ARCHITECTURE.md";
  std::ifstream in(doc);
  REQUIRE(in);
  std::vector<std::string> listed;
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (line == "<!-- messages begin -->") {
      inside = true;
    } else if (line == "<!-- messages end -->") {
      inside = false;
    } else if (inside && !line.starts_with("```")) {
      listed.push_back(line);
    }
  }
  const auto code = proto::describe_messages();
  std::string want;
  for (const auto& l : code) want += l + "\n";
  INFO("the list between the markers in " << doc.string() << " should read:\n" << want);
  CHECK(listed == code);
}
