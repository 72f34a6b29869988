#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "transports/shm/segment.hpp"
#include "transports/zmq/auth.hpp"
#include "transports/zmq/message.hpp"
#include "transports/zmq/stream.hpp"
#include "twinkle/fd.hpp"

// The worker channel: how the driver and its workers exchange messages, whatever carries them.
// The driver's logic sees peers (worker indices), messages and lost peers; never a socket, an
// identity frame or a shared-memory descriptor.
namespace twinkle::transport {

// The longest path a Unix socket address holds (sockaddr_un::sun_path, without its NUL): the
// limit on the socket paths in a run folder.
inline constexpr std::size_t kMaxSocketPath = 107;

// What the driver's end of the channel delivers.
struct ChannelEvent {
  enum class Kind { message, lost, wake };
  Kind kind = Kind::message;
  std::size_t peer = 0;           // message, lost
  Message message;                // message
  std::string reason;             // lost: how the peer was lost ("exited with code 3; ...")
  std::vector<std::size_t> with;  // lost: peers of the same group lost with it (a DEAD node's)
};

// Something a wait can wake on: a ZeroMQ socket, or a descriptor that polls readable (what a
// FrameStream reads).
struct Waitable {
  Waitable(zmq::socket_ref s) : socket(s) {}  // NOLINT: a socket is the common case
  Waitable(zmq::socket_t& s) : socket(s) {}   // NOLINT
  static Waitable descriptor(int fd) {
    Waitable w{zmq::socket_ref()};
    w.fd = fd;
    return w;
  }
  // A descriptor's poll says whether it holds something now (level-triggered); a ZeroMQ socket's
  // descriptor wakes only for what came to it while empty, so it is read empty before a wait.
  bool level_triggered() const { return !socket; }
  zmq::socket_ref socket;
  int fd = -1;
};

// What woke wait_readable: bit i of `waitables` for waitables[i], `fd` for the descriptor.
struct Woke {
  unsigned sockets = 0;
  bool fd = false;
  explicit operator bool() const { return sockets != 0 || fd; }
};

// Waits until one of `waitables` (at most 7) may have a message or `fd` (when >= 0) is readable,
// up to `timeout` (negative: no limit); nothing woke on timeout. Cheaper than zmq::poll (no first
// pass, no readiness query of sockets that did not wake): call it only once a non-blocking receive
// on each of `waitables` found nothing, since ZeroMQ signals a socket's descriptor only for what
// arrives after that. A socket that woke has its pending commands processed, so that the next
// non-blocking receive sees what came.
Woke wait_readable(std::initializer_list<Waitable> waitables, int fd,
                   std::chrono::milliseconds timeout);

// A channel's lost and wake events: queued from any thread, signalled through an eventfd that the
// channel's next() polls beside its sockets.
class ChannelEvents {
 public:
  ChannelEvents();  // throws TransportError when no eventfd can be made
  void lost(std::size_t peer, std::string reason, std::vector<std::size_t> with = {});
  void wake();
  // A queued lost event, if any.
  std::optional<ChannelEvent> take();
  // Drops the queued lost events of `peer` (its process was replaced).
  void forget(std::size_t peer);
  int fd() const { return wake_.get(); }
  // After fd() polled readable: clears it and returns the queued event, or a wake event.
  ChannelEvent signalled();
  // Clears fd() without taking an event: for a reader that took one with take() and takes the
  // rest with take() before each wait.
  void clear();

 private:
  Fd wake_;  // eventfd
  std::mutex mu_;
  std::deque<ChannelEvent> pending_;
};

// A caller's channels to the workers it calls: the driver's to every worker of its run
// (RouterDriverChannel), or a worker's to the other workers (PeerChannel, calls between groups).
// A CallTable runs over either. Peers are numbered 0..n-1 and known by identities fixed before they
// connect; a message from any other identity, or one that does not decode, is dropped and counted
// (DropLog), never fatal. send() and next() are called from one thread (the caller's); lost() and
// wake() from any.
class CallChannel {
 public:
  virtual ~CallChannel() = default;

  // What workers connect to (a PeerChannel, which only connects: the worker's name).
  virtual const std::string& endpoint() const = 0;
  // Queues `m` for `peer`. Throws TransportError when the peer is unreachable; a local worker
  // whose end of the stream is gone has died, and what it is sent is dropped (its loss comes
  // through lost(), from its launcher).
  virtual void send(std::size_t peer, const Message& m) = 0;
  // send(peer, m) for each of `peers` (a call every one of them gets whole), each tried even when
  // one before it threw; then throws the first TransportError. A channel may encode `m` once.
  virtual void send_each(const std::vector<std::size_t>& peers, const Message& m);
  // The next event, waiting at most `timeout` (negative: until one comes); nullopt on timeout.
  virtual std::optional<ChannelEvent> next(std::chrono::milliseconds timeout) = 0;
  // `peer` is gone (its process ended, its node stopped answering): next() delivers it once.
  // `with`: peers of its group lost in the same event (the others of a DEAD node), one loss.
  virtual void lost(std::size_t peer, std::string reason, std::vector<std::size_t> with = {}) = 0;
  // Drops the queued lost events of `peer`: they are of a process a restart replaced (channels
  // whose peers are never replaced keep none).
  virtual void forget_lost(std::size_t peer) { (void)peer; }
  // Makes a waiting next() return a wake event (a signal arrived, for example).
  virtual void wake() = 0;
  // Waits up to `timeout` until what send() queued has left (a channel that writes the socket
  // itself may hold messages a full socket did not take yet); false when some had not.
  virtual bool flush(std::chrono::milliseconds timeout) {
    (void)timeout;
    return true;
  }
  // Messages dropped so far: from unknown peers, or malformed.
  virtual std::uint64_t dropped() const = 0;
  // A value the plugin handed over (which must be copied out of its memory) in the form this
  // channel sends best: local channels put large tensors straight into shared memory, so that
  // slices of them reach the workers without another copy. Not decoded.
  virtual EncodedValue adopt(const twk_value_v1& v) = 0;
};

// A worker's end of the channel to its driver. Used from one thread.
class WorkerLink {
 public:
  virtual ~WorkerLink() = default;
  virtual void send(const Message& m) = 0;
  // The next message, waiting at most `timeout` (negative: until one comes); nullopt on timeout
  // or when what came did not decode (dropped, counted and logged: DropLog).
  virtual std::optional<Message> recv(std::chrono::milliseconds timeout) = 0;
  // The next message that needs no wait and no poll: one already read, or what one read brings.
  // nullopt once a read found the link empty: for a level-triggered waitable() its poll says
  // when more comes (the stream's reads stop at a short read), for a socket recv(0) is asked.
  virtual std::optional<Message> recv_ready() { return recv(std::chrono::milliseconds(0)); }
  // A value the plugin handed over, in the form this channel sends best (CallChannel::adopt).
  virtual EncodedValue adopt(const twk_value_v1& v) = 0;
  // A message that decoded but that the worker does not take: dropped, into the link's DropLog.
  virtual void drop(const std::string& why) = 0;
  // What to poll beside others (a worker also serves calls from other workers).
  virtual Waitable waitable() = 0;
};

// The driver's end as a ZeroMQ ROUTER (TcpDriverChannel's base): peers by identity, lost and wake
// events through an eventfd, dropped messages counted and rate-limit logged.
class RouterDriverChannel : public CallChannel {
 public:
  ~RouterDriverChannel() override;

  const std::string& endpoint() const override { return endpoint_; }
  void send(std::size_t peer, const Message& m) override;
  std::optional<ChannelEvent> next(std::chrono::milliseconds timeout) override;
  void lost(std::size_t peer, std::string reason, std::vector<std::size_t> with = {}) override;
  void wake() override;
  std::uint64_t dropped() const override { return drops_.count(); }
  void forget_lost(std::size_t peer) override { events_.forget(peer); }

 protected:
  RouterDriverChannel(zmq::context_t& context, std::vector<std::string> identities);

  std::string endpoint_;
  zmq::socket_t router_;
  std::vector<std::string> identities_;

 private:
  std::unordered_map<std::string, std::size_t> by_identity_;
  ChannelEvents events_;
  DropLog drops_{"the control socket"};
};

// Local workers: for each worker a pair of pipes for the messages, one each way (a FrameStream,
// written and read by the driver's thread itself: no I/O thread between it and the kernel; a
// message sent to a worker that has not answered since the last one was written waits up to
// Flusher::kCoalesce, and the channel's flusher thread writes what waited in one system call)
// and one
// descriptor channel over which tensors of kShmThreshold bytes or more travel as shared memory
// (segments from the channel's pool, whose release acknowledgements ride in the framing). The
// worker's ends of both are handed to it when it is spawned (take_worker_ends); nothing is bound
// in the file system, so no other process can reach the channel.
class LocalDriverChannel : public CallChannel {
 public:
  // The descriptors a local worker finds its ends on, and the endpoint that says so.
  static constexpr int kShmFd = 3;
  static constexpr int kControlInFd = 4;   // the worker reads its driver's messages here
  static constexpr int kControlOutFd = 5;  // and writes its own here

  // `names[i]`: peer i's worker name (for errors). Throws TransportError when the pipes or socket
  // pairs cannot be made.
  explicit LocalDriverChannel(std::vector<std::string> names);
  ~LocalDriverChannel() override;

  struct WorkerEnds {
    Fd control_in;   // the worker's kControlInFd
    Fd control_out;  // the worker's kControlOutFd
    Fd shm;          // the worker's kShmFd
  };
  // The worker's ends of peer's channels, for the launcher to hand to that worker. Once per peer.
  WorkerEnds take_worker_ends(std::size_t peer);
  // New channels for peer (its worker was replaced): take_worker_ends gives their ends.
  void renew_worker_ends(std::size_t peer);

  // "fd:4,5": the worker reads its control channel on kControlInFd and writes it on
  // kControlOutFd.
  const std::string& endpoint() const override { return endpoint_; }
  void send(std::size_t peer, const Message& m) override;
  void send_each(const std::vector<std::size_t>& peers, const Message& m) override;
  std::optional<ChannelEvent> next(std::chrono::milliseconds timeout) override;
  void lost(std::size_t peer, std::string reason, std::vector<std::size_t> with = {}) override;
  void forget_lost(std::size_t peer) override { events_.forget(peer); }
  void wake() override { events_.wake(); }
  bool flush(std::chrono::milliseconds timeout) override;
  std::uint64_t dropped() const override { return drops_.count(); }
  EncodedValue adopt(const twk_value_v1& v) override { return adopt_to_shm(v, &pool_); }

 private:
  struct Peer;
  // A whole message already read from one of the peers, taken in turn; nullopt when none.
  std::optional<ChannelEvent> take_read();
  // Runs `write` (a send on p.writes) for `peer`; arms the flusher when something waits.
  template <class Write>
  void write_to(std::size_t peer, Peer& p, Write&& write);

  // What the flusher runs: every peer's waiting messages written; the write ends still full.
  std::vector<int> flush_waiting();

  std::string endpoint_;
  std::vector<std::string> names_;
  ShmPool pool_;  // before the channels, which point to it
  // Changed on the driver's thread only, under peers_mu_, which the flusher holds while it
  // writes (the driver's thread reads it without).
  std::vector<std::unique_ptr<Peer>> peers_;
  std::mutex peers_mu_;
  std::size_t turn_ = 0;              // the peer take_read looks at first
  std::optional<ChannelEvent> held_;  // a lost event taken, delivered once the sockets are read
  std::vector<pollfd> polled_;        // scratch for next()
  ChannelEvents events_;
  DropLog drops_{"the control channel"};
  // A message to a worker that has sent nothing since the last one it was sent waits here, up to
  // Flusher::kCoalesce. Last: stopped first, while the peers it writes to are still there.
  std::unique_ptr<Flusher> flusher_;
};

// Remote workers: a ZeroMQ ROUTER on TCP, bound to `host` on an ephemeral port, with CURVE when
// `security` has keys (the context's KeyGate admits the run's worker key) and heartbeats, so that
// a worker cut off from the driver is noticed on both sides. Tensors travel as zero-copy frames.
class TcpDriverChannel : public RouterDriverChannel {
 public:
  TcpDriverChannel(zmq::context_t& context, const std::string& host,
                   std::vector<std::string> identities, const SocketSecurity& security);
  EncodedValue adopt(const twk_value_v1& v) override { return copy_encoded(v); }
};

// Remote workers of a cluster without keys: a plain TCP listener on `host`, on an ephemeral port
// (endpoint "tcp+stream://HOST:PORT"). A worker connects once; its first message, its hello,
// says which worker the connection is (a later connection whose hello names the same worker
// takes over, as a ROUTER's handover; a first message that is not a hello of a worker of this
// run closes the connection). From then on a FrameStream per worker, written and read by the
// driver's thread, and by a flusher for what waits, as local workers' pipes: no ZeroMQ I/O thread
// on either side. Both ends keep TCP keepalive, so that an idle connection to a machine that is
// gone ends within about kHeartbeatTimeout (no user timeout: a peer that does not read for a
// while is alive). Tensors travel in the stream.
class StreamDriverChannel : public CallChannel {
 public:
  // Throws TransportError naming `host` when it cannot listen there.
  StreamDriverChannel(const std::string& host, std::vector<std::string> identities);
  ~StreamDriverChannel() override;

  const std::string& endpoint() const override { return endpoint_; }
  // A worker not connected yet, or whose connection is gone, is sent nothing: its loss comes
  // from its launcher (the agent that saw it exit, the head that saw its node die).
  void send(std::size_t peer, const Message& m) override;
  std::optional<ChannelEvent> next(std::chrono::milliseconds timeout) override;
  void lost(std::size_t peer, std::string reason, std::vector<std::size_t> with = {}) override;
  void forget_lost(std::size_t peer) override { events_.forget(peer); }
  void wake() override { events_.wake(); }
  bool flush(std::chrono::milliseconds timeout) override;
  std::uint64_t dropped() const override { return drops_.count(); }
  EncodedValue adopt(const twk_value_v1& v) override { return copy_encoded(v); }

  // Connections that have not said hello yet, at most; the oldest is closed for a new one.
  static constexpr std::size_t kMaxPending = 256;

 private:
  struct Conn;
  std::optional<ChannelEvent> take_read();
  void accept_pending();
  std::vector<int> flush_waiting();

  std::string endpoint_;
  std::vector<std::string> identities_;
  std::unordered_map<std::string, std::size_t> by_identity_;
  Fd listener_;
  // By peer; empty until it said hello. Changed on the driver's thread only, under peers_mu_,
  // which the flusher holds while it writes (the driver's thread reads it without).
  std::vector<std::unique_ptr<Conn>> peers_;
  std::mutex peers_mu_;
  std::deque<std::unique_ptr<Conn>> pending_;  // accepted, no hello yet
  std::size_t turn_ = 0;
  std::optional<ChannelEvent> held_;
  std::vector<pollfd> polled_;
  ChannelEvents events_;
  DropLog drops_{"the control socket"};
  std::unique_ptr<Flusher> flusher_;  // last: stopped first
};

// A local worker's end: its control stream (the pipes `from_driver` and `to_driver`) and
// descriptor channel `shm` (taken over; empty for none). `on_lost` runs (on the worker's thread)
// when the driver's end is gone: the driver died or closed it.
std::unique_ptr<WorkerLink> connect_local_worker(Fd from_driver, Fd to_driver, Fd shm,
                                                 std::function<void(const std::string&)> on_lost);

}  // namespace twinkle::transport

namespace twinkle::transport {

// A remote worker's end: a DEALER with `identity` connected to the driver's TCP `endpoint` with
// `security` and heartbeats. `on_lost` runs (on another thread) when the connection to the
// driver, once made, is gone: the driver died or the network between them failed.
// A remote worker's end of a StreamDriverChannel at `endpoint` ("tcp+stream://HOST:PORT"),
// connected within 10 s, with keepalive. `on_lost` runs (on a thread of the link's, even while
// the worker's thread is busy) when the connection, once made, is gone. Throws TransportError
// naming the endpoint when it cannot connect.
std::unique_ptr<WorkerLink> connect_stream_worker(const std::string& endpoint,
                                                  std::function<void(const std::string&)> on_lost);

// The scheme of a StreamDriverChannel's endpoint.
inline constexpr std::string_view kStreamScheme = "tcp+stream://";
// A TCP connection to the stream listener at `endpoint` (a StreamDriverChannel's, a remote
// worker's ServeSocket's), made within 10 s, non-blocking, with the streams' keepalive. Throws
// TransportError naming `who`, the endpoint and why; with `error`, sets it to the errno and
// returns no descriptor instead (a malformed endpoint still throws).
Fd connect_stream(const std::string& endpoint, const std::string& who = "the driver",
                  int* error = nullptr);
// A listening TCP socket on `host` (a numeric address) at a port the kernel picks, non-blocking;
// `endpoint` becomes its "tcp+stream://HOST:PORT". Throws TransportError naming `what`.
Fd listen_stream(const std::string& host, const std::string& what, std::string& endpoint);
// The next connection on `listener`, non-blocking, with the streams' keepalive and no Nagle
// delay; no descriptor (errno says why) when none waits. `from`: the peer's address.
Fd accept_stream(int listener, std::string* from = nullptr);

std::unique_ptr<WorkerLink> connect_tcp_worker(zmq::context_t& context, const std::string& endpoint,
                                               const std::string& identity,
                                               const SocketSecurity& security,
                                               std::function<void(const std::string&)> on_lost);

}  // namespace twinkle::transport
