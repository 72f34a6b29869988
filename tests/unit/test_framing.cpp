#include <catch2/catch.hpp>

#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "tests/unit/fixtures.hpp"
#include "transports/zmq/channel.hpp"
#include "transports/zmq/message.hpp"
#include "twinkle/errors.hpp"

using namespace twinkle;
using namespace twinkle::transport;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

using twinkle::test::TempDir;

using Frames = std::vector<zmq::message_t>;

// The message of the TransportError that decoding `frames` raises.
std::string error_of(Frames frames, ShmChannel* channel = nullptr) {
  try {
    decode_message(std::move(frames), channel);
  } catch (const TransportError& e) {
    return e.what();
  }
  FAIL("the frames decoded without a TransportError");
  return {};
}

Frames reply_frames(Value body = Value::map({{"ok", true}, {"value", 7}})) {
  return encode_message(Message{MsgType::reply, 9, std::move(body)});
}

// Writes a little-endian u16 into the header at `offset`.
void put_u16(Frames& frames, std::size_t offset, std::uint16_t v) {
  auto* h = static_cast<unsigned char*>(frames[0].data());
  h[offset] = static_cast<unsigned char>(v & 0xff);
  h[offset + 1] = static_cast<unsigned char>(v >> 8);
}

zmq::message_t msgpack_frame(const Value& v) {
  EncodedValue e = encode(v);
  return zmq::message_t(e.msgpack.data(), e.msgpack.size());
}

// A message with one tensor whose table entry is `entry` and whose tensor frame is `frame`.
Frames with_tensor_entry(const Value& entry, zmq::message_t frame) {
  Frames f = reply_frames();
  f[2] = msgpack_frame(Value::list({Value::list({entry}), Value::list()}));
  f.push_back(std::move(frame));
  return f;
}

constexpr int kF32 = static_cast<int>(DType::f32);

}  // namespace

TEST_CASE("a message with tensors survives encode and decode", "[zmq]") {
  Tensor t = Tensor::from(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor empty(DType::i64, {0, 4});
  Value body =
      Value::map({{"x", t}, {"rows", Value::list({empty, 3, "s"})}, {"step", 12}, {"lr", 0.5}});
  Frames frames = encode_message(Message{MsgType::call, 0x0102030405060708ull, body});
  // header, body, framing, one frame per tensor (in the order of the body's sorted keys)
  REQUIRE(frames.size() == 5);
  CHECK(frames[3].size() == 0);
  CHECK(frames[4].size() == 6 * sizeof(float));

  Message m = decode_message(std::move(frames));
  CHECK(m.type == MsgType::call);
  CHECK(m.id == 0x0102030405060708ull);
  CHECK(m.body == body);
  CHECK(m.body["x"].tensor().shape() == std::vector<std::int64_t>{2, 3});
  CHECK(m.body["rows"][0].tensor().shape() == std::vector<std::int64_t>{0, 4});
}

TEST_CASE("decode_message names what is wrong with the frames", "[zmq]") {
  SECTION("fewer than 3 frames") {
    Frames f = reply_frames();
    f.resize(2);
    CHECK(error_of(std::move(f)) == "malformed message: 2 frame(s), at least 3 expected");
    CHECK(error_of(Frames{}) == "malformed message: 0 frame(s), at least 3 expected");
  }
  SECTION("no twinkle header") {
    Frames f = reply_frames();
    static_cast<char*>(f[0].data())[0] = 'X';
    CHECK(error_of(std::move(f)) ==
          "malformed message: no twinkle header (is another program talking to this socket?)");
    Frames short_header = reply_frames();
    short_header[0] = zmq::message_t(std::string("TWKP"));
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
    put_u16(gap, 6, 15);  // between the worker and the cluster messages
    CHECK(error_of(std::move(gap)) == "malformed message: unknown type 15");
  }
  SECTION("a framing frame that is not [tensors, released]") {
    Frames f = reply_frames();
    f[2] = msgpack_frame(Value::list({Value::list()}));
    CHECK(error_of(std::move(f)) ==
          "malformed message: the tensor frame is not [tensors, released]");
    Frames m = reply_frames();
    m[2] = msgpack_frame(Value::map({{"tensors", Value::list()}}));
    CHECK(error_of(std::move(m)) ==
          "malformed message: the tensor frame is not [tensors, released]");
  }
  SECTION("a tensor table that does not match the frames") {
    Frames f = encode_message(
        Message{MsgType::reply, 1, Value::map({{"x", Tensor::from(std::vector<float>{1, 2})}})});
    REQUIRE(f.size() == 4);
    f.pop_back();
    CHECK(error_of(std::move(f)) ==
          "malformed message: the tensor table lists 1 tensor(s) for 0 frame(s)");
    Frames extra = reply_frames();
    extra.emplace_back();
    CHECK(error_of(std::move(extra)) ==
          "malformed message: the tensor table lists 0 tensor(s) for 1 frame(s)");
  }
  SECTION("a tensor frame of the wrong size") {
    Frames f = with_tensor_entry(Value::list({kF32, Value::list({2})}), zmq::message_t(4));
    CHECK(error_of(std::move(f)) ==
          "malformed reply message: tensor of shape [2] and dtype float32 needs 8 bytes, buffer "
          "has 4");
  }
  SECTION("a negative dimension") {
    Frames f = with_tensor_entry(Value::list({kF32, Value::list({2, -1})}), zmq::message_t());
    CHECK(error_of(std::move(f)) == "malformed message: tensor 0 has a negative dimension");
  }
  SECTION("an unknown dtype") {
    Frames f = with_tensor_entry(Value::list({77, Value::list({1})}), zmq::message_t(4));
    CHECK(error_of(std::move(f)) == "malformed message: tensor 0 has dtype 77");
  }
  SECTION("a shared-memory entry without a channel") {
    Frames f = with_tensor_entry(Value::list({kF32, Value::list({2}), 1, 0, 0}), zmq::message_t());
    CHECK(error_of(std::move(f)) == "malformed message: a shared-memory tensor without a channel");
  }
  SECTION("a body that is not msgpack names the message type") {
    Frames f = reply_frames();
    f[1] = zmq::message_t(std::string("\xc1"));  // a byte msgpack never uses
    CHECK_THAT(error_of(std::move(f)), Catch::StartsWith("malformed reply message: "));
  }
}

TEST_CASE("driver channel: a message from an unknown identity is dropped and counted", "[zmq]") {
  TempDir dir;
  zmq::context_t ctx;
  LocalDriverChannel channel(ctx, dir.path / "ctl", {"w0", "w1"});
  CHECK(channel.endpoint() == "ipc://" + (dir.path / "ctl").string());

  zmq::socket_t intruder(ctx, zmq::socket_type::dealer);
  intruder.set(zmq::sockopt::linger, 0);
  intruder.set(zmq::sockopt::routing_id, "intruder");
  intruder.connect(channel.endpoint());
  send_message(intruder, Message{MsgType::hello, 0, Value::map({{"pid", 1}, {"host", "x"}})});

  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (channel.dropped() == 0 && std::chrono::steady_clock::now() < deadline) {
    auto e = channel.next(20ms);
    CHECK_FALSE(e);  // nothing is delivered for it
  }
  CHECK(channel.dropped() == 1);
  CHECK_FALSE(channel.next(0ms));
}

TEST_CASE("driver channel: a worker's hello arrives with its peer index", "[zmq]") {
  TempDir dir;
  zmq::context_t ctx;
  LocalDriverChannel channel(ctx, dir.path / "ctl", {"w0", "w1"});
  auto link = connect_local_worker(ctx, channel.endpoint(), "w1", channel.take_worker_end(1));
  link->send(Message{MsgType::hello, 0, Value::map({{"pid", 42}, {"host", "h"}})});

  auto e = channel.next(5s);
  REQUIRE(e);
  CHECK(e->kind == ChannelEvent::Kind::message);
  CHECK(e->peer == 1);
  CHECK(e->message.type == MsgType::hello);
  CHECK(e->message.body["pid"] == Value(42));
  CHECK(channel.dropped() == 0);

  // And the driver's answer reaches that worker.
  channel.send(1, Message{MsgType::welcome, 0, Value::map({{"rank", 1}})});
  auto w = link->recv(5s);
  REQUIRE(w);
  CHECK(w->type == MsgType::welcome);
  CHECK(w->body["rank"] == Value(1));
}

TEST_CASE("driver channel: lost() from another thread wakes a next() that waits forever", "[zmq]") {
  TempDir dir;
  zmq::context_t ctx;
  LocalDriverChannel channel(ctx, dir.path / "ctl", {"w0", "w1"});
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

TEST_CASE("driver channel: wake() makes a waiting next() return a wake event", "[zmq]") {
  TempDir dir;
  zmq::context_t ctx;
  LocalDriverChannel channel(ctx, dir.path / "ctl", {"w0"});
  channel.wake();
  auto e = channel.next(5s);
  REQUIRE(e);
  CHECK(e->kind == ChannelEvent::Kind::wake);
}

TEST_CASE("driver channel: a control socket path too long for a Unix socket", "[zmq]") {
  zmq::context_t ctx;
  const std::string path = "/tmp/" + std::string(103, 'x');  // 108 characters
  REQUIRE(path.size() == 108);
  CHECK_THROWS_AS(LocalDriverChannel(ctx, path, {"w0"}), TransportError);
  CHECK_THROWS_WITH(
      LocalDriverChannel(ctx, path, {"w0"}),
      fmt::format("the control socket path {} is 108 characters long, more than a Unix socket "
                  "allows (107); set TMPDIR to a shorter folder",
                  path));
}

TEST_CASE("driver channel: a path of 107 characters still binds", "[zmq]") {
  TempDir dir;
  zmq::context_t ctx;
  const std::size_t name = 107 - dir.path.string().size() - 1;
  const fs::path path = dir.path / std::string(name, 's');
  REQUIRE(path.string().size() == 107);
  LocalDriverChannel channel(ctx, path, {"w0"});
  CHECK(fs::exists(path));
}
