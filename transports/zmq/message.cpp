#include "transports/zmq/message.hpp"

#include <cstring>
#include <memory>

#include <zmq_addon.hpp>

#include <fmt/format.h>

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

}  // namespace

const char* to_string(MsgType t) {
  switch (t) {
    case MsgType::hello: return "hello";
    case MsgType::welcome: return "welcome";
    case MsgType::create: return "create";
    case MsgType::created: return "created";
    case MsgType::call: return "call";
    case MsgType::reply: return "reply";
    case MsgType::shutdown: return "shutdown";
    case MsgType::kv_set: return "kv_set";
    case MsgType::kv_get: return "kv_get";
    case MsgType::kv_value: return "kv_value";
    case MsgType::comm_join: return "comm_join";
    case MsgType::peer_lost: return "peer_lost";
    case MsgType::probe: return "probe";
    case MsgType::node_register: return "node_register";
    case MsgType::node_welcome: return "node_welcome";
    case MsgType::heartbeat: return "heartbeat";
    case MsgType::reregister: return "reregister";
    case MsgType::nodes_query: return "nodes_query";
    case MsgType::nodes_info: return "nodes_info";
    case MsgType::reserve: return "reserve";
    case MsgType::reservation: return "reservation";
    case MsgType::release: return "release";
    case MsgType::lease: return "lease";
    case MsgType::launch: return "launch";
    case MsgType::launched: return "launched";
    case MsgType::need_plugin: return "need_plugin";
    case MsgType::plugin: return "plugin";
    case MsgType::stop_job: return "stop_job";
    case MsgType::stopped: return "stopped";
    case MsgType::worker_exit: return "worker_exit";
    case MsgType::output: return "output";
    case MsgType::node_dead: return "node_dead";
    case MsgType::kill_job: return "kill_job";
    case MsgType::node_leave: return "node_leave";
  }
  return "unknown";
}

std::vector<zmq::message_t> encode_message(const Message& m, ShmChannel* channel) {
  std::vector<zmq::message_t> frames;
  zmq::message_t header(kHeaderSize);
  auto* h = static_cast<unsigned char*>(header.data());
  std::memcpy(h, kMagic, 4);
  put_le(h + 4, kProtocolVersion, 2);
  put_le(h + 6, static_cast<std::uint16_t>(m.type), 2);
  put_le(h + 8, m.id, 8);
  frames.push_back(std::move(header));

  EncodedValue e = encode(m.body);
  frames.emplace_back(e.msgpack.data(), e.msgpack.size());
  Value::List table;
  for (auto& t : e.tensors) {
    Value::List entry;
    entry.emplace_back(static_cast<int>(t.dtype()));
    entry.emplace_back(t.shape());
    if (channel && t.nbytes() >= kShmThreshold) {
      if (t.shm_fd() < 0) {
        Tensor copy = shm_tensor(t.dtype(), t.shape());
        std::memcpy(copy.mutable_data(), t.data(), t.nbytes());
        t = copy;
      }
      entry.emplace_back(static_cast<std::int64_t>(channel->send(t.shm_fd())));
      entry.emplace_back(static_cast<std::int64_t>(t.shm_offset()));
      entry.emplace_back(
          static_cast<std::int64_t>(channel->pool() ? channel->pool()->sent(t.shm_fd()) : 0));
      t = Tensor();  // its frame stays empty
    }
    table.emplace_back(std::move(entry));
  }
  // Which of the peer's pooled segments this side let go of since the last message: the peer may
  // reuse them. Part of the framing, never of the body.
  Value::List released;
  if (channel) {
    for (std::uint64_t id : channel->take_released()) released.emplace_back(id);
  }
  EncodedValue te = encode(Value::list({Value(std::move(table)), Value(std::move(released))}));
  frames.emplace_back(te.msgpack.data(), te.msgpack.size());
  for (auto& t : e.tensors) {
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

Message decode_message(std::vector<zmq::message_t>&& frames, ShmChannel* channel) {
  if (frames.size() < 3) {
    throw TransportError(
        fmt::format("malformed message: {} frame(s), at least 3 expected", frames.size()));
  }
  if (frames[0].size() != kHeaderSize || std::memcmp(frames[0].data(), kMagic, 4) != 0) {
    throw TransportError(
        "malformed message: no twinkle header (is another program talking to this socket?)");
  }
  const auto* h = static_cast<const unsigned char*>(frames[0].data());
  const auto version = static_cast<std::uint16_t>(get_le(h + 4, 2));
  if (version != kProtocolVersion) {
    throw TransportError(
        fmt::format("protocol version {} from the peer, this twinkle speaks {}; run the same "
                    "twinkle build everywhere",
                    version, kProtocolVersion));
  }
  Message m;
  const auto type = static_cast<std::uint16_t>(get_le(h + 6, 2));
  if (std::string_view(to_string(static_cast<MsgType>(type))) == "unknown") {
    throw TransportError(fmt::format("malformed message: unknown type {}", type));
  }
  m.type = static_cast<MsgType>(type);
  m.id = get_le(h + 8, 8);

  // The frames are owned by shared storage so that received tensors can view them.
  auto owned = std::make_shared<std::vector<zmq::message_t>>(std::move(frames));
  try {
    Value framing = decode((*owned)[2].data(), (*owned)[2].size(), {});
    if (!framing.is_list() || framing.size() != 2 || !framing[1].is_list()) {
      throw TransportError("malformed message: the tensor frame is not [tensors, released]");
    }
    const Value& table = framing[0];
    if (!table.is_list() || table.size() != owned->size() - 3) {
      throw TransportError(
          fmt::format("malformed message: the tensor table lists {} tensor(s) for {} frame(s)",
                      table.is_list() ? table.size() : 0, owned->size() - 3));
    }
    std::vector<Tensor> tensors;
    for (std::size_t i = 0; i < table.size(); ++i) {
      const Value& d = table[i];
      auto dtype = d[0].as<int>();
      if (!dtype_known(dtype))
        throw TransportError(fmt::format("malformed message: tensor {} has dtype {}", i, dtype));
      auto shape = d[1].as<std::vector<std::int64_t>>();
      std::int64_t numel = 1;
      for (auto x : shape) {
        if (x < 0)
          throw TransportError(
              fmt::format("malformed message: tensor {} has a negative dimension", i));
        numel *= x;
      }
      const std::size_t nbytes =
          static_cast<std::size_t>(numel) * dtype_size(static_cast<DType>(dtype));
      if (d.size() == 5) {
        if (!channel)
          throw TransportError("malformed message: a shared-memory tensor without a channel");
        Fd fd = channel->receive(d[2].as<std::uint64_t>());
        auto seg =
            channel->map(std::move(fd), d[3].as<std::size_t>(), nbytes, d[4].as<std::uint64_t>());
        tensors.push_back(Tensor::view_fd(static_cast<DType>(dtype), shape, seg->data(), nbytes,
                                          seg, seg->fd(), d[3].as<std::size_t>()));
        continue;
      }
      auto& frame = (*owned)[3 + i];
      tensors.push_back(Tensor::view(static_cast<DType>(dtype), shape, frame.data(), frame.size(),
                                     std::shared_ptr<const void>(owned, frame.data())));
    }
    m.body = decode((*owned)[1].data(), (*owned)[1].size(), tensors);
    if (channel && channel->pool()) {
      for (const auto& id : framing[1]) channel->pool()->released(id.as<std::uint64_t>());
    }
  } catch (const ValueError& e) {
    throw TransportError(fmt::format("malformed {} message: {}", to_string(m.type), e.what()));
  }
  return m;
}

void send_message(zmq::socket_t& socket, const Message& m, const std::string* identity,
                  ShmChannel* channel) {
  auto frames = encode_message(m, channel);
  if (identity) socket.send(zmq::buffer(*identity), zmq::send_flags::sndmore);
  for (std::size_t i = 0; i < frames.size(); ++i) {
    socket.send(frames[i],
                i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
}

std::optional<Message> recv_message(zmq::socket_t& socket, int timeout_ms, std::string* identity,
                                    const ChannelOf& channel_of) {
  std::vector<zmq::message_t> frames;
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
    if (frames.empty()) throw TransportError("malformed message: no identity frame");
    *identity = frames.front().to_string();
    frames.erase(frames.begin());
  }
  return decode_message(std::move(frames),
                        channel_of ? channel_of(identity ? *identity : std::string()) : nullptr);
}

}  // namespace twinkle::transport
