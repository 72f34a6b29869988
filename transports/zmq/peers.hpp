#pragma once

#include <poll.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "transports/shm/segment.hpp"
#include "transports/zmq/auth.hpp"
#include "transports/zmq/channel.hpp"
#include "transports/zmq/message.hpp"
#include "transports/zmq/stream.hpp"
#include "twinkle/fd.hpp"

// Calls between groups (docs/ARCHITECTURE.md, Calls between groups): worker-to-worker traffic.
// Every worker serves calls from the other workers of its run on a socket of its own (ServeSocket);
// a worker that calls another opens a connection to it the first time (PeerChannel). The driver
// only hands out the addresses.
namespace twinkle::transport {

// How a worker serves calls from the other workers.
//
// Local mode ("unix://PATH"): PATH is a Unix SEQPACKET socket where a caller, once, hands over its
// connection: its name and three descriptors in one message (a "greeting"), the read end of a pipe
// it writes its calls to, the write end of a pipe it reads the replies from, and its end of a
// descriptor channel (ShmChannel). From then on calls and replies are FrameStreams over the two
// pipes, read and written by the two workers' own threads: no ZeroMQ I/O thread, no socket
// between them (as between the driver and its local workers). Tensors of kShmThreshold bytes or
// more travel as shared memory. What the worker polls is one epoll descriptor over the socket and
// every caller's pipe.
//
// Remote mode without keys ("tcp+stream://HOST:*"): a TCP listener where a caller connects once;
// its first message is a greeting of one frame (the four bytes and its name), then calls and
// replies are FrameStreams over the connection, read and written by the two workers' threads
// (keepalive, no Nagle delay), tensors in the stream. The same epoll descriptor is polled.
//
// Remote mode with keys ("tcp://HOST:*"): a ZeroMQ ROUTER, CURVE with the run's worker keys,
// heartbeats; tensors as frames.
class ServeSocket {
 public:
  struct Request {
    std::string from;  // the calling worker's name ("sampler:1")
    Message message;
  };

  // Binds `endpoint` ("unix://PATH", "tcp+stream://HOST:*" or "tcp://HOST:*"); `security.keys`
  // make a tcp:// one a CURVE server. Throws TransportError naming the endpoint.
  ServeSocket(zmq::context_t& context, const std::string& endpoint, const SocketSecurity& security);
  ~ServeSocket();
  ServeSocket(const ServeSocket&) = delete;
  ServeSocket& operator=(const ServeSocket&) = delete;
  // Where the others connect (the port a tcp://HOST:* bind got).
  const std::string& endpoint() const { return endpoint_; }
  // What to poll beside others: it may have a request when it polls readable.
  Waitable waitable();
  // The next request, waiting at most `timeout`; nullopt when none came. A message that does not
  // decode, and a greeting that is not one, is dropped (DropLog; nothing else of the run is
  // affected).
  std::optional<Request> recv(std::chrono::milliseconds timeout);
  // Never blocks: what a full pipe does not take is written by this socket's flusher thread.
  // A caller that is gone gets nothing.
  void reply(const std::string& to, const Message& m);
  // A request that decoded but that the worker does not take: dropped, into this socket's
  // DropLog.
  void drop(const std::string& why) { drops_.drop(why); }
  std::uint64_t dropped() const { return drops_.count(); }
  // Where large results for callers go (segments come back when the callers let go of them).
  ShmPool* pool() { return &pool_; }

  // Callers connected in local and stream mode, greeted or not (for tests).
  std::size_t callers() const { return callers_.size(); }
  // The most callers that may be waiting to greet at once; more are refused (closed).
  static constexpr std::size_t kMaxGreeting = 64;

 private:
  struct Caller;
  // What one wait on the epoll descriptor found: callers greeted, requests read into ready_.
  void poll_local(std::chrono::milliseconds timeout);
  void start_polling();
  void accept_greetings();
  void accept_streams();
  void greet(std::uint64_t key);
  // A caller's name, greeted once: a name greeted again (a replaced worker) takes it over.
  void name_caller(std::uint64_t key, const std::string& name);
  void read_caller(std::uint64_t key);
  void close_caller(std::uint64_t key);
  std::vector<int> flush_waiting();  // the flusher's: each caller's waiting replies written

  std::unique_ptr<zmq::socket_t> router_;  // remote mode
  std::string endpoint_;
  // Local and stream mode.
  std::string path_;  // local mode's socket
  bool stream_ = false;
  Fd listener_;
  Fd epoll_;
  std::uint64_t next_key_ = 0;
  std::map<std::uint64_t, Fd> greeting_;  // accepted, greeting not read yet
  ShmPool pool_;                          // before the callers, whose channels point to it
  // Changed on the worker's thread only, under callers_mu_, which the flusher holds while it
  // writes (the worker's thread reads them without).
  std::map<std::uint64_t, std::unique_ptr<Caller>> callers_;
  std::map<std::string, std::uint64_t, std::less<>> by_name_;
  std::mutex callers_mu_;
  std::deque<Request> ready_;  // read and decoded, not taken yet
  DropLog drops_{"the socket for calls from other workers"};
  std::unique_ptr<Flusher> flusher_;  // last: stopped first, while the callers are there
};

// The path of a local serve endpoint ("unix://PATH"); "" for any other.
std::string local_serve_path(const std::string& serve_endpoint);

// A worker's connections to the serve sockets of the other workers, as a CallChannel: the call
// table a worker uses for its calls between groups runs over it unchanged. Peers are the run's
// workers by index; each is connected when first sent to: a local one through a greeting (its
// pipes then, ServeSocket), a remote one by a DEALER (identity: this worker's name). A message to
// a local worker that is gone is dropped: its loss comes from the driver (lost(), or repoint()
// for its replacement).
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
  // Waits up to `timeout` until what was sent to local workers has been written.
  bool flush(std::chrono::milliseconds timeout) override;
  // Tensors of kShmThreshold bytes or more go straight into shared memory, in segments that are
  // reused once the workers they went to let go of them.
  EncodedValue adopt(const twk_value_v1& v) override { return adopt_to_shm(v, &pool_); }

 private:
  struct Connection;
  // The connection to `peer`, made on first use; nullptr for a local worker that is gone.
  Connection* connection(std::size_t peer);
  std::unique_ptr<Connection> connect_local(std::size_t peer, const std::string& path);
  std::unique_ptr<Connection> connect_remote(std::size_t peer);
  // The next message already read from a connection, or read now; a local connection found
  // closed is closed here.
  std::optional<ChannelEvent> read_replies();
  void close(std::size_t peer);
  std::vector<int> flush_waiting();  // the flusher's: each local connection's waiting calls

  zmq::context_t& context_;
  std::string identity_;
  std::vector<std::string> names_;
  std::vector<std::string> endpoints_;
  SocketSecurity security_;
  ShmPool pool_;  // before the connections, whose channels use it
  // By peer, made on first send. Changed on the worker's thread only, under connections_mu_,
  // which the flusher holds while it writes (the worker's thread reads them without).
  std::vector<std::unique_ptr<Connection>> connections_;
  std::mutex connections_mu_;
  std::vector<std::size_t> open_;  // peers with a connection
  std::vector<std::pair<Waitable, std::function<void()>>> watched_;
  std::chrono::milliseconds tick_interval_{0};
  std::function<void()> tick_;
  std::vector<pollfd> fds_;  // scratch for next()
  ChannelEvents events_;
  DropLog drops_{"a worker's connections to the other workers"};
  std::unique_ptr<Flusher> flusher_;  // last: stopped first, while the connections are there
};

}  // namespace twinkle::transport
