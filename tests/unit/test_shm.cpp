#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>

#include "transports/fd.hpp"
#include "transports/shm/segment.hpp"
#include "transports/zmq/message.hpp"
#include "twinkle/errors.hpp"

using namespace twinkle;
using namespace twinkle::transport;

namespace {

Tensor pattern(std::size_t bytes) {
  Tensor t(DType::u8, {static_cast<std::int64_t>(bytes)});
  std::uint32_t x = 2463534242u;
  for (auto& b : t.mutable_span<std::uint8_t>()) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    b = static_cast<std::uint8_t>(x);
  }
  return t;
}

// A call message whose arguments are `v`, and the arguments of a decoded one.
Message value_message(std::uint64_t id, const Value& v) {
  return Message{id, proto::Call{1, "m", "", encode(v), {}}};
}
Value value_of(const Message& m) { return decode(m.get<proto::Call>()->args); }

}  // namespace

TEST_CASE("a large tensor crosses as shared memory, bit-exact, with no payload frame", "[shm]") {
  FdPair p = FdPair::seqpacket("the test channel");
  ShmChannel a(std::move(p.first)), b(std::move(p.second));
  Tensor big = pattern(24 << 20);
  Tensor small = pattern(1000);
  auto frames = encode_message(value_message(7, Value::map({{"big", big}, {"small", small}})), &a);
  REQUIRE(frames.size() == 3);
  std::size_t payload = 0;
  for (std::size_t i = 1; i < frames.size(); ++i) payload += frames[i].size();
  CHECK(payload == 1000);  // only the small tensor travels in a frame
  Message m = decode_message(std::move(frames), &b);
  CHECK(m.id == 7);
  CHECK(value_of(m)["big"].tensor().equals(big));
  CHECK(value_of(m)["small"].tensor().equals(small));
  CHECK(value_of(m)["big"].tensor().shm_fd() >= 0);
}

TEST_CASE("slices of a shared tensor are sent at their offsets without a copy", "[shm]") {
  FdPair p = FdPair::seqpacket("the test channel");
  ShmChannel a(std::move(p.first)), b(std::move(p.second));
  Tensor src = pattern(6 << 20);
  Tensor t = shm_tensor(DType::u8, src.shape());
  std::memcpy(t.mutable_data(), src.data(), src.nbytes());
  Tensor part = t.slice(1234567, 5 << 20);  // not page-aligned
  Message m = decode_message(encode_message(value_message(1, Value(part)), &a), &b);
  CHECK(value_of(m).tensor().equals(part));
}

TEST_CASE("without a channel, shared-memory entries are refused; dropped descriptors are skipped",
          "[shm]") {
  FdPair p = FdPair::seqpacket("the test channel");
  ShmChannel a(std::move(p.first)), b(std::move(p.second));
  auto dropped = encode_message(value_message(1, Value(pattern(2 << 20))), &a);
  CHECK_THROWS_WITH(
      decode_message(encode_message(value_message(2, Value(pattern(2 << 20))), &a)),
      Catch::Contains("without a channel") || Catch::Contains("a shared-memory tensor"));
  Tensor third = pattern(3 << 20);
  Message m = decode_message(encode_message(value_message(3, Value(third)), &a), &b);
  CHECK(value_of(m).tensor().equals(third));  // the two earlier descriptors were closed and skipped
}

TEST_CASE("the pool reuses a segment only after every peer released it", "[shm]") {
  FdPair p = FdPair::seqpacket("the test channel");
  ShmPool pool;
  ShmChannel a(std::move(p.first), &pool), b(std::move(p.second));
  const void* first_data = nullptr;
  Tensor other;  // stays in use throughout
  {
    Tensor t = pool.tensor(DType::f32, {1 << 20});
    first_data = t.data();
    Message m = decode_message(encode_message(value_message(1, Value(t)), &a), &b);
    CHECK(pool.segments() == 1);
    // The driver drops its tensor, but the peer still maps the segment: a new one is made.
    t = Tensor();
    other = pool.tensor(DType::f32, {1 << 20});
    CHECK(other.data() != first_data);
    CHECK(pool.segments() == 2);
    auto released = b.take_released();
    CHECK(released.empty());
    m = Message{};  // the peer lets go
  }
  auto released = b.take_released();
  REQUIRE(released.size() == 1);
  pool.released(released[0]);
  Tensor reused = pool.tensor(DType::f32, {1 << 20});
  CHECK(reused.data() == first_data);
  CHECK(pool.segments() == 2);
}

TEST_CASE("a message naming a descriptor that was never sent is refused at once", "[shm]") {
  FdPair p = FdPair::seqpacket("the test channel");
  ShmChannel a(std::move(p.first)), b(std::move(p.second));
  // Encoded on a channel whose descriptor packets the receiver never sees (a forged entry).
  FdPair other = FdPair::seqpacket("another channel");
  ShmChannel elsewhere(std::move(other.first));
  Frames frames = encode_message(value_message(1, Value(pattern(2 << 20))), &elsewhere);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(decode_message(std::move(frames), &b),
                    "malformed message: tensor 0: shared-memory tensor 1 was never sent on this "
                    "channel");
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
  // The channel still works for what is sent on it.
  Tensor t = pattern(3 << 20);
  Message m = decode_message(encode_message(value_message(2, Value(t)), &a), &b);
  CHECK(value_of(m).tensor().equals(t));
}

TEST_CASE("a shared-memory tensor larger than its segment is refused, never mapped", "[shm]") {
  FdPair p = FdPair::seqpacket("the test channel");
  ShmChannel a(std::move(p.first)), b(std::move(p.second));
  Tensor small = shm_tensor(DType::u8, {4096});
  const std::uint64_t token = a.send(small.shm_fd());
  CHECK_THROWS_WITH(b.map(b.receive(token), 0, std::size_t{1} << 20, 0),
                    "a shared-memory tensor of 1048576 bytes at offset 0 does not fit its segment "
                    "of 4096 bytes");
}
