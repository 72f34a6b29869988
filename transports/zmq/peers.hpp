#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "transports/shm/segment.hpp"
#include "transports/zmq/auth.hpp"
#include "transports/zmq/channel.hpp"
#include "transports/zmq/message.hpp"
#include "twinkle/fd.hpp"

// Calls between groups (docs/ARCHITECTURE.md, Calls between groups): worker-to-worker traffic.
// Every worker serves calls from the other workers of its run on a socket of its own (ServeSocket);
// a worker that calls another opens a connection to it the first time (PeerChannel). The driver
// only hands out the addresses.
namespace twinkle::transport {

// A worker's ROUTER for calls from other workers: ipc in local mode, TCP (CURVE with the run's
// worker keys when the cluster uses keys) in remote mode. Beside an ipc endpoint PATH it listens on
// PATH.fd (a Unix SEQPACKET socket): a local caller connects there first and says its name, and
// from then on tensors of kShmThreshold bytes or more travel between the two as shared memory
// (their descriptors over that connection), as between the driver and its local workers.
class ServeSocket {
 public:
  struct Request {
    std::string from;  // the calling worker's name ("sampler:1")
    Message message;
  };

  // Binds `endpoint` ("ipc://PATH" or "tcp://HOST:*"); `security.keys` make it a CURVE server.
  // Throws TransportError naming the endpoint.
  ServeSocket(zmq::context_t& context, const std::string& endpoint, const SocketSecurity& security);
  ~ServeSocket();
  ServeSocket(const ServeSocket&) = delete;
  ServeSocket& operator=(const ServeSocket&) = delete;
  // Where the others connect (the port a tcp://HOST:* bind got).
  const std::string& endpoint() const { return endpoint_; }
  zmq::socket_ref socket() { return socket_; }
  // The next request, waiting at most `timeout`; nullopt when none came. A message that does not
  // decode is dropped (DropLog; nothing else of the run is affected).
  std::optional<Request> recv(std::chrono::milliseconds timeout);
  void reply(const std::string& to, const Message& m);
  // A request that decoded but that the worker does not take: dropped, into this socket's
  // DropLog.
  void drop(const std::string& why) { drops_.drop(why); }
  // Where large results for callers go (segments come back when the callers let go of them).
  ShmPool* pool() { return &pool_; }

 private:
  // Takes the callers that connected to the descriptor socket (each says its name first).
  void accept_pending();
  ShmChannel* shm_of(const std::string& caller);

  zmq::socket_t socket_;
  std::string endpoint_;
  std::string listener_path_;  // PATH.fd; empty for TCP
  Fd listener_;
  ShmPool pool_;                                            // before the channels that use it
  std::map<std::string, std::unique_ptr<ShmChannel>> shm_;  // by caller name
  DropLog drops_{"the socket for calls from other workers"};
};

// Where a worker serving at ipc://PATH takes descriptor connections: PATH.fd ("" for TCP).
std::string shm_listener_path(const std::string& serve_endpoint);

// A worker's connections to the serve sockets of the other workers, as a CallChannel: the call
// table a worker uses for its calls between groups runs over it unchanged. Peers are the run's
// workers by index; each gets a DEALER (identity: this worker's name) when first sent to.
// While next() waits it also watches other sockets (the worker's driver link and serve socket)
// and runs their handlers, so that a worker waiting for another still answers what must not wait.
class PeerChannel : public CallChannel {
 public:
  // `endpoints[i]`: worker i's serve socket. `security`: the run's worker keys as a client of
  // the other workers' CURVE servers (empty: plain).
  PeerChannel(zmq::context_t& context, std::string identity, std::vector<std::string> names,
              std::vector<std::string> endpoints, SocketSecurity security);
  ~PeerChannel() override;

  // While next() waits, `on_ready` runs whenever `w` has input.
  void watch(Waitable w, std::function<void()> on_ready);
  // While next() waits, `tick` runs every `interval`.
  void every(std::chrono::milliseconds interval, std::function<void()> tick);

  // This side has no endpoint of its own (it only connects): the worker's name.
  const std::string& endpoint() const override { return identity_; }
  void send(std::size_t peer, const Message& m) override;
  std::optional<ChannelEvent> next(std::chrono::milliseconds timeout) override;
  void lost(std::size_t peer, std::string reason, std::vector<std::size_t> with = {}) override;
  // Worker `peer` was replaced and serves at `endpoint` now: the next send connects there.
  void repoint(std::size_t peer, const std::string& endpoint);
  void wake() override;
  std::uint64_t dropped() const override { return drops_.count(); }
  // Tensors of kShmThreshold bytes or more go straight into shared memory, in segments that are
  // reused once the workers they went to let go of them.
  EncodedValue adopt(const twk_value_v1& v) override { return adopt_to_shm(v, &pool_); }

 private:
  zmq::socket_t& connection(std::size_t peer);
  // A shared-memory channel to a local peer (nullptr for a TCP peer, or if it cannot be made).
  std::unique_ptr<ShmChannel> open_shm(std::size_t peer);

  zmq::context_t& context_;
  std::string identity_;
  std::vector<std::string> names_;
  std::vector<std::string> endpoints_;
  SocketSecurity security_;
  std::vector<std::unique_ptr<zmq::socket_t>> sockets_;  // by peer, made on first send
  ShmPool pool_;                                         // before the channels that use it
  std::vector<std::unique_ptr<ShmChannel>> shm_;         // by peer, beside its socket
  std::vector<std::size_t> open_;                        // peers with a socket
  std::vector<std::pair<Waitable, std::function<void()>>> watched_;
  std::chrono::milliseconds tick_interval_{0};
  std::function<void()> tick_;
  ChannelEvents events_;
  DropLog drops_{"a worker's connections to the other workers"};
};

}  // namespace twinkle::transport
