#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "transports/shm/segment.hpp"
#include "twinkle/value.hpp"

namespace twinkle::transport {

// Version of the control-channel protocol, checked at hello. Bump on any incompatible change.
inline constexpr std::uint16_t kProtocolVersion = 4;

enum class MsgType : std::uint16_t {
  hello = 1,       // worker -> driver: {rank, group, pid, host, serve}
  welcome = 2,     // driver -> worker: {job, args, mesh, ..., groups, peers}
  create = 3,      // driver -> worker, id = instance: {class, args}
  created = 4,     // worker -> driver, id = instance: {ok, error}
  call = 5,        // driver -> worker, id = call: {instance, method, args}
  reply = 6,       // worker -> driver, id = call: {ok, value | error}
  shutdown = 7,    // driver -> worker
  kv_set = 8,      // worker -> driver: {key, value}   (rendezvous store)
  kv_get = 9,      // worker -> driver, id = request: {key}
  kv_value = 10,   // driver -> worker, id = request: {value}
  comm_join = 11,  // driver -> worker: {name, rank, size, members, timeout_s}: a cross-group comm
  peer_lost = 12,  // driver -> worker: {peer, text}: a worker of the run is gone
  probe = 13,      // worker -> worker: {origin, token, nodes, path}: who waits on whom (cycles)
  // Calls between groups (DESIGN.md 10b) use create/created/call/reply from worker to worker,
  // with {caller, chain} in create and call: the call sites and workers that led to the call.

  // Cluster messages (remote mode), between the head and its agents, drivers and clients. The
  // head forwards driver -> agent messages by body["node"] and agent -> driver ones by body["run"].
  node_register = 20,  // agent -> head: {node, host, address, cpus, memory, gpus, labels, jobs}
  node_welcome = 21,   // head -> agent: {ok, error}
  heartbeat = 22,      // agent -> head: {node}
  reregister = 23,     // head -> agent: the head does not know this agent (it restarted)
  nodes_query = 24,    // client -> head
  nodes_info = 25,     // head -> client: {nodes, reservations}
  reserve = 26,        // driver -> head, id = request: {run, job, owner, groups, dry_run}
  reservation = 27,    // head -> driver, id = request: {ok, groups | kind, message}
  release = 28,        // driver -> head: {run}
  lease = 29,          // driver -> head: {run}, every heartbeat interval
  launch = 30,         // driver -> agent: {run, node, sha256, endpoint, keys, workers}
  launched = 31,       // agent -> driver: {run, node, ok, error}
  need_plugin = 32,    // agent -> driver: {run, node, sha256}
  plugin = 33,         // driver -> agent: {run, node, sha256, bytes}
  stop_job = 34,       // driver -> agent: {run, node, grace_ms}
  stopped = 35,        // agent -> driver: {run, node, signalled}
  worker_exit = 36,    // agent -> driver: {run, name, exit_code, signal, text, stderr}
  output = 37,         // agent -> driver: {run, name, stream, line}
  node_dead = 38,      // head -> driver: {node, host, reason}
  kill_job = 39,       // head -> agent: {run}: its driver's lease expired
  node_leave = 40,     // agent -> head: {node, reason}: it is stopping (SIGTERM, node stop)
};

const char* to_string(MsgType t);

// One control-channel message. On the wire it is multipart:
//   [header: 'T' 'W' 'K' 'P', u16 protocol version, u16 type, u64 id (little endian)]
//   [body: msgpack]  [framing: msgpack [[[dtype, [shape...]], ...], [released pool ids...]]]
//   [one frame per tensor]
// Tensor payloads are never copied into the body: sending references the tensor's memory (kept
// alive until ZeroMQ is done with it), receiving makes tensors that view the received frames.
// With a ShmChannel to the peer, tensors of kShmThreshold bytes or more travel as shared memory
// instead: their table entry is [dtype, shape, token, offset, pool id] and their frame is empty;
// the memfd goes over the channel (a tensor not in shared memory yet is copied into it once).
// The framing also carries the ids of the peer's pooled segments this side has let go of (taken
// from the channel when sending, handed to the channel's pool when receiving).
struct Message {
  MsgType type = MsgType::hello;
  std::uint64_t id = 0;
  Value body;
};

std::vector<zmq::message_t> encode_message(const Message& m, ShmChannel* channel = nullptr);

// Throws TransportError naming what is wrong: too few frames, a bad magic, another protocol
// version, an unknown type, a malformed body or tensor table, a tensor frame of the wrong size.
// A shared-memory entry without a channel is a TransportError too.
Message decode_message(std::vector<zmq::message_t>&& frames, ShmChannel* channel = nullptr);

// Sends on a DEALER (no identity) or ROUTER (with the peer's identity). Blocks only if the
// socket's high-water mark is reached.
void send_message(zmq::socket_t& socket, const Message& m, const std::string* identity = nullptr,
                  ShmChannel* channel = nullptr);

// Receives one message; nullopt when nothing arrived before `timeout_ms` (-1: wait forever).
// With a ROUTER socket, `identity` receives the sender's identity.
// `channel_of` gives the shared-memory channel of the sender (by identity, "" for a DEALER).
using ChannelOf = std::function<ShmChannel*(const std::string& identity)>;
std::optional<Message> recv_message(zmq::socket_t& socket, int timeout_ms,
                                    std::string* identity = nullptr,
                                    const ChannelOf& channel_of = {});

}  // namespace twinkle::transport
