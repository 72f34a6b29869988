#include "transports/zmq/message.hpp"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

#include <zmq_addon.hpp>

#include <fmt/format.h>

#include "transports/zmq/codec.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::transport {

namespace {

constexpr std::size_t kHeaderSize = 16;
constexpr char kMagic[4] = {'T', 'W', 'K', 'P'};

void put_le(unsigned char* p, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

std::uint64_t get_le(const unsigned char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t(p[i]) << (8 * i);
  return v;
}

// Keeps a tensor's storage alive while ZeroMQ holds a frame that points into it.
void release_tensor(void*, void* hint) { delete static_cast<Tensor*>(hint); }
void release_buffer(void* data, void*) { std::free(data); }

// Where frame 0 is packed: the thread's own buffer, kept from one message to the next.
// Frame 0 of up to kScratchBody bytes is copied out of it (one allocation, ZeroMQ's, or none
// under 34 bytes); a larger one takes the buffer along, and the next message starts a new one.
constexpr std::size_t kScratchBody = 64 * 1024;
msgpack::sbuffer& scratch_buffer() {
  thread_local msgpack::sbuffer buf(1024);
  return buf;
}

// Frame 0 and the tensor frames of a message whose body `pack` writes.
template <class Pack>
Frames frame(MsgType type, std::uint64_t id, Pack&& pack, ShmChannel* channel) {
  msgpack::sbuffer& buf = scratch_buffer();
  buf.clear();
  unsigned char h[kHeaderSize];
  std::memcpy(h, kMagic, 4);
  put_le(h + 4, kProtocolVersion, 2);
  put_le(h + 6, static_cast<std::uint16_t>(type), 2);
  put_le(h + 8, id, 8);
  buf.write(reinterpret_cast<const char*>(h), sizeof h);
  std::vector<Tensor> tensors;
  pack(buf, tensors);

  // Which of the peer's pooled segments this side let go of since the last message: the peer may
  // reuse them.
  std::vector<std::uint64_t> released;
  if (channel) released = channel->take_released();
  if (!tensors.empty() || !released.empty()) {
    detail::Packer pk(buf);
    pk.pack_array(2);
    pk.pack_array(static_cast<std::uint32_t>(tensors.size()));
    for (auto& t : tensors) {
      const bool shm = channel && t.nbytes() >= kShmThreshold;
      pk.pack_array(shm ? 5 : 2);
      pk.pack_int32(static_cast<std::int32_t>(t.dtype()));
      pk.pack_array(static_cast<std::uint32_t>(t.shape().size()));
      for (auto d : t.shape()) pk.pack_int64(d);
      if (shm) {
        if (t.shm_fd() < 0) {
          Tensor copy = shm_tensor(t.dtype(), t.shape());
          std::memcpy(copy.mutable_data(), t.data(), t.nbytes());
          t = copy;
        }
        pk.pack_uint64(channel->send(t.shm_fd()));
        pk.pack_uint64(t.shm_offset());
        pk.pack_uint64(channel->pool() ? channel->pool()->sent(t.shm_fd()) : 0);
        t = Tensor();  // its frame stays empty
      }
    }
    pk.pack_array(static_cast<std::uint32_t>(released.size()));
    for (auto r : released) pk.pack_uint64(r);
  }

  Frames frames;
  frames.reserve(1 + tensors.size());
  const std::size_t size = buf.size();
  if (size <= kScratchBody) {
    frames.emplace_back(buf.data(), size);
  } else {
    frames.emplace_back(buf.release(), size, &release_buffer, nullptr);
  }
  for (auto& t : tensors) {
    if (!t.defined() || t.nbytes() == 0) {
      frames.emplace_back();
      continue;
    }
    auto* keep = new Tensor(t);
    frames.emplace_back(const_cast<std::byte*>(keep->data()), keep->nbytes(), &release_tensor,
                        keep);
  }
  return frames;
}

using detail::Item;
using detail::NotMsgpack;
using detail::Reader;

struct Unframed {
  MsgType type;
  std::uint64_t id;
  std::size_t body_end;  // offset in frame 0 where the body ends
  std::vector<Tensor> tensors;
  // Keep frame 0 while the body is decoded: shared with the tensors that view the others when
  // there are tensor frames, else the frames themselves.
  std::shared_ptr<Frames> shared;
  Frames frames;
  const zmq::message_t& frame0() const { return shared ? (*shared)[0] : frames[0]; }
};

std::int64_t checked_int(const Item& it, const char* what, std::size_t i) {
  if (it.kind == Item::integer && !it.flag &&
      it.u <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    return static_cast<std::int64_t>(it.u);
  if (it.kind == Item::integer && it.flag) return it.i;
  throw ProtocolError(fmt::format("malformed message: tensor {} has a bad {}", i, what));
}

// Steps over the value at `r`, which must be msgpack.
void check_msgpack(Reader& r, const char* what) {
  try {
    r.skip();
  } catch (const NotMsgpack& e) {
    throw ProtocolError(
        fmt::format("malformed message: its {} is not msgpack ({})", what, e.what()));
  }
}

// The tensor table's entries (`n` of them at `r`) as tensors viewing frames 1..n or mapped from
// shared memory.
void read_tensors(Reader& r, std::size_t n, Frames* owned, Unframed& u, ShmChannel* channel) {
  for (std::size_t i = 0; i < n; ++i) {
    const Item d = r.next();
    if (d.kind != Item::array || (d.size != 2 && d.size != 5)) {
      throw ProtocolError(
          fmt::format("malformed message: tensor {} is not [dtype, shape, ...]", i));
    }
    const Item dtype_item = r.next();
    const Item s = r.next();
    if (s.kind != Item::array) {
      throw ProtocolError(
          fmt::format("malformed message: tensor {} is not [dtype, shape, ...]", i));
    }
    const std::int64_t dtype = checked_int(dtype_item, "dtype", i);
    if (dtype < 0 || dtype > std::numeric_limits<std::int32_t>::max() ||
        !dtype_known(static_cast<std::int32_t>(dtype)))
      throw ProtocolError(fmt::format("malformed message: tensor {} has dtype {}", i, dtype));
    const DType dt = static_cast<DType>(dtype);
    std::vector<std::int64_t> shape;
    shape.reserve(s.size);
    std::uint64_t numel = 1;
    for (std::uint32_t k = 0; k < s.size; ++k) {
      const std::int64_t x = checked_int(r.next(), "dimension", i);
      if (x < 0)
        throw ProtocolError(
            fmt::format("malformed message: tensor {} has a negative dimension", i));
      // No product may wrap: a shape whose bytes exceed what a process can address is refused.
      if (x != 0 && numel > std::numeric_limits<std::uint64_t>::max() / dtype_size(dt) /
                                static_cast<std::uint64_t>(x))
        throw ProtocolError(fmt::format("malformed message: tensor {} has a shape too large", i));
      numel *= static_cast<std::uint64_t>(x);
      shape.push_back(x);
    }
    const std::uint64_t nbytes64 = numel * dtype_size(dt);
    if (nbytes64 > std::numeric_limits<std::size_t>::max() / 2)
      throw ProtocolError(fmt::format("malformed message: tensor {} has a shape too large", i));
    const auto nbytes = static_cast<std::size_t>(nbytes64);
    if (d.size == 5) {
      if (!channel)
        throw ProtocolError("malformed message: a shared-memory tensor without a channel");
      const auto token = static_cast<std::uint64_t>(checked_int(r.next(), "token", i));
      const auto at = static_cast<std::size_t>(checked_int(r.next(), "offset", i));
      const auto pool = static_cast<std::uint64_t>(checked_int(r.next(), "pool id", i));
      std::shared_ptr<ShmSegment> seg;
      try {
        seg = channel->map(channel->receive(token), at, nbytes, pool);
      } catch (const TransportError& e) {
        throw ProtocolError(fmt::format("malformed message: tensor {}: {}", i, e.what()));
      }
      u.tensors.push_back(Tensor::view_fd(dt, shape, seg->data(), nbytes, seg, seg->fd(), at));
      continue;
    }
    auto& fr = (*owned)[1 + i];  // n > 0: there are tensor frames
    try {
      u.tensors.push_back(Tensor::view(dt, shape, fr.data(), fr.size(),
                                       std::shared_ptr<const void>(u.shared, fr.data())));
    } catch (const ValueError& e) {
      throw ProtocolError(fmt::format("malformed message: tensor {}: {}", i, e.what()));
    }
  }
}

// Frame 0 (`data`, `size`): its header, where its body ends, and its tensor table, whose entries
// view frames 1.. of `owned` (none when it is null) or are mapped from shared memory.
void read_frame0(const char* data, std::size_t size, std::size_t n_tensors, Frames* owned,
                 ShmChannel* channel, Unframed& u) {
  if (size < kHeaderSize || std::memcmp(data, kMagic, 4) != 0) {
    throw ProtocolError(
        "malformed message: no twinkle header (is another program talking to this socket?)");
  }
  const auto* h = reinterpret_cast<const unsigned char*>(data);
  const auto version = static_cast<std::uint16_t>(get_le(h + 4, 2));
  if (version != kProtocolVersion) {
    throw ProtocolError(
        fmt::format("protocol version {} from the peer, this twinkle speaks {}; run the same "
                    "twinkle build everywhere",
                    version, kProtocolVersion));
  }
  const auto type = static_cast<std::uint16_t>(get_le(h + 6, 2));
  u.type = static_cast<MsgType>(type);
  if (std::string_view(to_string(u.type)) == "unknown")
    throw ProtocolError(fmt::format("malformed message: unknown type {}", type));
  u.id = get_le(h + 8, 8);
  if (size == kHeaderSize) throw ProtocolError("malformed message: no body after the header");
  Reader body(data + kHeaderSize, size - kHeaderSize);
  check_msgpack(body, "body");
  u.body_end = kHeaderSize + body.offset();
  if (body.done()) {
    if (n_tensors != 0) {
      throw ProtocolError(
          fmt::format("malformed message: {} tensor frame(s) and no tensor table", n_tensors));
    }
    return;
  }
  Reader table(data + u.body_end, size - u.body_end);
  check_msgpack(table, "tensor table");
  if (!table.done()) throw ProtocolError("malformed message: trailing bytes after the table");

  // [[entry...], [released pool id...]]: both lists are looked at before any entry is used.
  Reader t(data + u.body_end, size - u.body_end);
  const Item top = t.next();
  const Item entries = top.kind == Item::array && top.size == 2 ? t.next() : Item{};
  Reader at_entries = t;
  if (entries.kind == Item::array) {
    for (std::uint32_t i = 0; i < entries.size; ++i) t.skip();
  }
  const Item released = entries.kind == Item::array ? t.next() : Item{};
  if (released.kind != Item::array)
    throw ProtocolError("malformed message: the tensor table is not [tensors, released]");
  if (entries.size != n_tensors) {
    throw ProtocolError(
        fmt::format("malformed message: the tensor table lists {} tensor(s) for {} frame(s)",
                    entries.size, n_tensors));
  }
  read_tensors(at_entries, n_tensors, owned, u, channel);
  if (channel && channel->pool()) {
    for (std::uint32_t k = 0; k < released.size; ++k) {
      channel->pool()->released(
          static_cast<std::uint64_t>(checked_int(t.next(), "released id", k)));
    }
  }
}

Unframed unframe(Frames&& frames, ShmChannel* channel) {
  if (frames.empty()) throw ProtocolError("malformed message: no frames");
  Unframed u;
  // With tensor frames, the frames are owned by shared storage so that the tensors can view them.
  const std::size_t n_tensors = frames.size() - 1;
  if (n_tensors > 0) {
    u.shared = std::make_shared<Frames>(std::move(frames));
  } else {
    u.frames = std::move(frames);
  }
  Frames& owned = u.shared ? *u.shared : u.frames;
  read_frame0(static_cast<const char*>(owned[0].data()), owned[0].size(), n_tensors, &owned,
              channel, u);
  return u;
}

// The message of frame 0 at `data`, read by read_frame0 into `u`.
template <class Body>
Envelope<Body> decode_body(const Unframed& u, const char* data, bool (*family)(MsgType)) {
  if (!family(u.type)) {
    throw ProtocolError(fmt::format(
        "malformed message: a {} message is not expected on this socket", to_string(u.type)));
  }
  Envelope<Body> m;
  m.id = u.id;
  Reader body(data + kHeaderSize, u.body_end - kHeaderSize);
  try {
    detail::unpack_body(u.type, body, u.tensors, m.body);
  } catch (const NotMsgpack& e) {  // not after check_msgpack; a ProtocolError all the same
    throw ProtocolError(fmt::format("malformed {} message: {}", to_string(u.type), e.what()));
  } catch (const ProtocolError& e) {
    throw ProtocolError(fmt::format("malformed {} message: {}", to_string(u.type), e.what()));
  }
  return m;
}

template <class Body>
Envelope<Body> decode_as(Frames&& frames, ShmChannel* channel, bool (*family)(MsgType)) {
  Unframed u = unframe(std::move(frames), channel);
  return decode_body<Body>(u, static_cast<const char*>(u.frame0().data()), family);
}

}  // namespace

Frames encode_message(const Message& m, ShmChannel* channel) {
  return frame(
      m.type(), m.id,
      [&](msgpack::sbuffer& buf, std::vector<Tensor>& t) { detail::pack_body(buf, m.body, t); },
      channel);
}

Frames encode_message(const ClusterMessage& m) {
  return frame(
      m.type(), m.id,
      [&](msgpack::sbuffer& buf, std::vector<Tensor>& t) { detail::pack_body(buf, m.body, t); },
      nullptr);
}

Message decode_message(Frames&& frames, ShmChannel* channel) {
  return decode_as<proto::Control>(std::move(frames), channel, &detail::is_control);
}

Message decode_message(const void* frame0, std::size_t size, ShmChannel* channel) {
  Unframed u;
  const auto* data = static_cast<const char*>(frame0);
  read_frame0(data, size, 0, nullptr, channel, u);
  return decode_body<proto::Control>(u, data, &detail::is_control);
}

ClusterMessage decode_cluster_message(Frames&& frames) {
  return decode_as<proto::Cluster>(std::move(frames), nullptr, &detail::is_cluster);
}

void send_frames(zmq::socket_t& socket, Frames&& frames, const std::string* identity) {
  if (identity) socket.send(zmq::buffer(*identity), zmq::send_flags::sndmore);
  for (std::size_t i = 0; i < frames.size(); ++i) {
    socket.send(frames[i],
                i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
}

void send_message(zmq::socket_t& socket, const Message& m, const std::string* identity,
                  ShmChannel* channel) {
  send_frames(socket, encode_message(m, channel), identity);
}

void send_message(zmq::socket_t& socket, const ClusterMessage& m, const std::string* identity) {
  send_frames(socket, encode_message(m), identity);
}

std::optional<Frames> recv_frames(zmq::socket_t& socket, int timeout_ms, std::string* identity) {
  Frames frames;
  // A message already waiting is taken without a poll: one system call less on the hot path.
  if (!zmq::recv_multipart(socket, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
    if (timeout_ms == 0) return std::nullopt;
    if (timeout_ms < 0) {
      if (!zmq::recv_multipart(socket, std::back_inserter(frames))) return std::nullopt;
    } else {
      zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, std::chrono::milliseconds(timeout_ms)) == 0) return std::nullopt;
      if (!zmq::recv_multipart(socket, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
        return std::nullopt;
      }
    }
  }
  if (identity) {
    if (frames.empty()) throw ProtocolError("malformed message: no identity frame");
    *identity = frames.front().to_string();
    frames.erase(frames.begin());
  }
  return frames;
}

}  // namespace twinkle::transport
