#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "transports/shm/segment.hpp"
#include "transports/zmq/protocol.hpp"

// The framing of the wire protocol's messages (docs/ARCHITECTURE.md, Wire protocol). On the wire
// a message is multipart:
//   frame 0: [header: 'T' 'W' 'K' 'P', u16 protocol version, u16 type, u64 id (little endian)]
//            [body: msgpack map of the struct's fields]
//            [tensor table: msgpack [[[dtype, [shape...]], ...], [released pool ids...]], only
//             when the message has tensors or releases segments]
//   frames 1..n: one per tensor, its bytes
// A message without tensors is one frame. Tensor payloads are never copied into the body:
// sending references the tensor's memory (kept alive until ZeroMQ is done with it), receiving
// makes tensors that view the received frames. With a ShmChannel to the peer, tensors of
// kShmThreshold bytes or more travel as shared memory instead: their table entry is
// [dtype, shape, token, offset, pool id] and their frame is empty; the memfd goes over the
// channel (a tensor not in shared memory yet is copied into it once). The table also carries the
// ids of the peer's pooled segments this side has let go of (taken from the channel when sending,
// handed to the channel's pool when receiving).
namespace twinkle::transport {

using Frames = std::vector<zmq::message_t>;

Frames encode_message(const Message& m, ShmChannel* channel = nullptr);
Frames encode_message(const ClusterMessage& m);

// Throw ProtocolError naming what is wrong: too few frames, a bad magic, another protocol
// version, an unknown type (or one of the other family), a body field of the wrong type, a
// malformed tensor table, a tensor frame of the wrong size. A shared-memory entry without a
// channel is a ProtocolError too.
Message decode_message(Frames&& frames, ShmChannel* channel = nullptr);
ClusterMessage decode_cluster_message(Frames&& frames);
// The same for a message of one frame, read where it lies (the bytes are not kept).
Message decode_message(const void* frame0, std::size_t size, ShmChannel* channel = nullptr);

// Sends on a DEALER (no identity) or ROUTER (with the peer's identity). Blocks only if the
// socket's high-water mark is reached.
void send_frames(zmq::socket_t& socket, Frames&& frames, const std::string* identity = nullptr);
void send_message(zmq::socket_t& socket, const Message& m, const std::string* identity = nullptr,
                  ShmChannel* channel = nullptr);
void send_message(zmq::socket_t& socket, const ClusterMessage& m,
                  const std::string* identity = nullptr);

// Receives one multipart message; nullopt when nothing arrived before `timeout_ms` (-1: wait
// forever). With a ROUTER socket, `identity` receives the sender's identity (a message without
// one is a ProtocolError).
std::optional<Frames> recv_frames(zmq::socket_t& socket, int timeout_ms,
                                  std::string* identity = nullptr);

}  // namespace twinkle::transport
