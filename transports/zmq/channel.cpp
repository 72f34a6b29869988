#include "transports/zmq/channel.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "transports/fd.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::transport {

namespace {

zmq::socket_t make_socket(zmq::context_t& context, zmq::socket_type type) {
  zmq::socket_t s(context, type);
  s.set(zmq::sockopt::linger, 0);
  // No high-water marks: a driver that sends many calls before reading replies must not block
  // on a worker that blocks on its replies (a deadlock).
  s.set(zmq::sockopt::sndhwm, 0);
  s.set(zmq::sockopt::rcvhwm, 0);
  return s;
}

// `send` for each of `peers`, each tried even when one before it threw; then the first
// TransportError is thrown (CallChannel::send_each).
template <class Send>
void each_peer(const std::vector<std::size_t>& peers, Send&& send) {
  std::exception_ptr first;
  for (const std::size_t peer : peers) {
    try {
      send(peer);
    } catch (const TransportError&) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

// The next message on a worker's DEALER; what does not decode is dropped into `drops`.
std::optional<Message> recv_decoded(zmq::socket_t& socket, std::chrono::milliseconds timeout,
                                    ShmChannel* shm, DropLog& drops) {
  auto frames = recv_frames(socket, static_cast<int>(timeout.count()));
  if (!frames) return std::nullopt;
  try {
    return decode_message(std::move(*frames), shm);
  } catch (const ProtocolError& e) {
    drops.drop(e.what());
    return std::nullopt;
  }
}

// Watches a socket for its end while the worker's thread may be busy in plugin code: the other
// end closed it (POLLRDHUP), reset it or stopped answering (POLLERR, POLLHUP: keepalive, TCP's
// retransmissions). Runs `on_end` once, on its own thread.
class HangupWatch {
 public:
  HangupWatch(int fd, std::function<void()> on_end) : stop_(::eventfd(0, EFD_CLOEXEC)) {
    if (!stop_)
      throw TransportError(fmt::format("cannot create an eventfd: {}", std::strerror(errno)));
    thread_ = std::thread([this, fd, on_end = std::move(on_end)] {
      pollfd p[2] = {{fd, POLLRDHUP, 0}, {stop_.get(), POLLIN, 0}};
      int rc;
      while ((rc = ::poll(p, 2, -1)) < 0 && errno == EINTR) {
      }
      if (rc > 0 && !p[1].revents && p[0].revents) on_end();
    });
  }
  ~HangupWatch() {
    const std::uint64_t one = 1;
    (void)!::write(stop_.get(), &one, sizeof one);
    thread_.join();
  }
  HangupWatch(const HangupWatch&) = delete;
  HangupWatch& operator=(const HangupWatch&) = delete;

 private:
  Fd stop_;
  std::thread thread_;
};

// A local worker's end of its driver's channel: the control stream, read and written by the
// worker's thread itself. Also a remote worker's end of a StreamDriverChannel: the same over its
// TCP socket, whose end a HangupWatch reports even while the worker's thread is busy. An answer
// sent after another one with nothing read from the driver in between (the worker took several
// calls in one read) waits up to Flusher::kCoalesce to be written with the next, by the link's
// flusher thread, which also writes what a full pipe did not take once it has room: the worker
// never blocks on its driver, and the driver reads whenever it waits.
class StreamWorkerLink : public WorkerLink {
 public:
  StreamWorkerLink(Fd from_driver, Fd to_driver, Fd shm,
                   std::function<void(const std::string&)> on_lost)
      : stream_(std::move(from_driver), std::move(to_driver)), on_lost_(std::move(on_lost)) {
    if (shm) shm_ = std::make_unique<ShmChannel>(std::move(shm));
    start_flusher();
  }
  StreamWorkerLink(Fd socket, const std::string& endpoint,
                   std::function<void(const std::string&)> on_lost)
      : stream_(std::move(socket)), on_lost_(std::move(on_lost)) {
    start_flusher();
    watch_ = std::make_unique<HangupWatch>(stream_.in_fd(), [this, endpoint] {
      lost(fmt::format("the connection to the driver at {} is gone", endpoint));
    });
  }
  ~StreamWorkerLink() override {
    watch_.reset();
    flusher_.reset();
    // What still waits goes before the worker exits (the driver reads until its workers exit).
    std::lock_guard lock(writes_.mu);
    try {
      if (stream_.has_output()) stream_.flush_wait(std::chrono::seconds(2));
    } catch (const TransportError&) {
    }
  }
  void send(const Message& m) override {
    if (stream_.closed()) return;  // the driver is gone (on_lost ran): nobody waits for this
    bool waits = false;
    try {
      waits = writes_.send(stream_, encode_message(m, shm_.get()));
    } catch (const TransportError& e) {
      lost(e.what());
      return;
    }
    if (waits) flusher_->arm();
  }
  std::optional<Message> recv(std::chrono::milliseconds timeout) override {
    using Clock = std::chrono::steady_clock;
    const auto deadline = timeout.count() > 0 ? Clock::now() + timeout : Clock::time_point{};
    for (;;) {
      if (auto m = recv_ready()) return m;
      if (stream_.closed()) return std::nullopt;
      long left = -1;
      if (timeout.count() >= 0) {
        left = std::max<long>(
            0,
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      }
      pollfd p{stream_.in_fd(), POLLIN, 0};
      int rc;
      do {
        rc = ::poll(&p, 1, static_cast<int>(left));
      } while (rc < 0 && errno == EINTR);
      if (rc <= 0 && left >= 0) return std::nullopt;
    }
  }
  std::optional<Message> recv_ready() override {
    for (;;) {
      bool read_data = false;
      try {
        auto m = stream_.recv_message(shm_.get(), &read_data);
        if (read_data) writes_.heard();
        if (!m) break;
        return m;
      } catch (const ProtocolError& e) {
        if (read_data) writes_.heard();
        drops_.drop(e.what());
      }
    }
    if (stream_.closed()) {
      lost(stream_.error().empty() ? "the driver closed its end of the control channel"
                                   : "the control channel broke: " + stream_.error());
    }
    return std::nullopt;
  }
  EncodedValue adopt(const twk_value_v1& v) override {
    return shm_ ? adopt_to_shm(v) : copy_encoded(v);
  }
  Waitable waitable() override { return Waitable::descriptor(stream_.in_fd()); }
  void drop(const std::string& why) override { drops_.drop(why); }

 private:
  void start_flusher() {
    flusher_ = std::make_unique<Flusher>([this] {
      std::vector<int> full;
      writes_.flush(stream_, full);  // a driver gone is found by the worker's next read
      return full;
    });
  }
  // From the worker's thread or the HangupWatch's: reported once.
  void lost(const std::string& why) {
    if (lost_reported_.exchange(true)) return;
    if (on_lost_) on_lost_(why);
  }

  FrameStream stream_;
  CoalescedWrites writes_;  // the stream's write side: the worker's thread and the flusher
  std::unique_ptr<ShmChannel> shm_;
  std::function<void(const std::string&)> on_lost_;
  std::atomic<bool> lost_reported_{false};
  DropLog drops_{"the worker's link to its driver"};
  std::unique_ptr<Flusher> flusher_;
  std::unique_ptr<HangupWatch> watch_;  // a remote worker's; last: stopped first
};

class TcpWorkerLink : public WorkerLink {
 public:
  TcpWorkerLink(zmq::context_t& context, const std::string& endpoint, const std::string& identity,
                const SocketSecurity& security, std::function<void(const std::string&)> on_lost)
      : socket_(make_socket(context, zmq::socket_type::dealer)) {
    socket_.set(zmq::sockopt::routing_id, identity);
    socket_.set(zmq::sockopt::linger, 2000);
    secure_client(socket_, security);
    set_heartbeats(socket_, kHeartbeatInterval, kHeartbeatTimeout);
    // A connection to the driver that was made and is gone means the driver died or the network
    // failed: the calls in flight are lost with it, so the worker must not wait for more.
    watch_ = std::make_unique<ConnectionWatch>(
        context, socket_,
        [this, endpoint, on_lost = std::move(on_lost)](ConnectionWatch::Event e, const std::string&,
                                                       const std::string& detail) {
          if (e == ConnectionWatch::Event::handshake_ok) {
            connected_ = true;
          } else if (e == ConnectionWatch::Event::disconnected && connected_.exchange(false)) {
            on_lost(fmt::format("the connection to the driver at {} is gone", endpoint));
          } else if (e == ConnectionWatch::Event::refused_auth ||
                     e == ConnectionWatch::Event::refused_protocol) {
            on_lost(fmt::format("the driver at {} refused this worker: {}", endpoint,
                                detail.empty() ? "its key is not the run's" : detail));
          }
        });
    socket_.connect(endpoint);
  }
  ~TcpWorkerLink() override { watch_.reset(); }
  void send(const Message& m) override { send_message(socket_, m); }
  std::optional<Message> recv(std::chrono::milliseconds timeout) override {
    return recv_decoded(socket_, timeout, nullptr, drops_);
  }
  EncodedValue adopt(const twk_value_v1& v) override { return copy_encoded(v); }
  Waitable waitable() override { return socket_; }
  void drop(const std::string& why) override { drops_.drop(why); }

 private:
  zmq::socket_t socket_;
  DropLog drops_{"the worker's link to its driver"};
  std::atomic<bool> connected_{false};
  std::unique_ptr<ConnectionWatch> watch_;
};

}  // namespace

Woke wait_readable(std::initializer_list<Waitable> waitables, int fd,
                   std::chrono::milliseconds timeout) {
  pollfd fds[8];
  zmq::socket_ref socks[7];
  std::size_t n = 0;
  for (const auto& w : waitables) {
    if (n == 7) break;
    socks[n] = w.socket;
    fds[n++] = pollfd{w.socket ? w.socket.get(zmq::sockopt::fd) : w.fd, POLLIN, 0};
  }
  std::size_t count = n;
  if (fd >= 0) fds[count++] = pollfd{fd, POLLIN, 0};
  int rc;
  do {
    rc = ::poll(fds, count, static_cast<int>(timeout.count()));
  } while (rc < 0 && errno == EINTR);
  Woke woke;
  if (rc <= 0) return woke;
  for (std::size_t i = 0; i < n; ++i) {
    if (!fds[i].revents) continue;
    // Processes the socket's commands (a pipe with new messages becomes readable).
    if (socks[i]) (void)socks[i].get(zmq::sockopt::events);
    woke.sockets |= 1u << i;
  }
  woke.fd = fd >= 0 && fds[count - 1].revents != 0;
  return woke;
}

RouterDriverChannel::RouterDriverChannel(zmq::context_t& context,
                                         std::vector<std::string> identities)
    : router_(make_socket(context, zmq::socket_type::router)), identities_(std::move(identities)) {
  router_.set(zmq::sockopt::router_mandatory, 1);
  // A connection that takes a worker's identity before the worker does (a stranger, or a worker
  // of an older build whose hello is dropped) must not keep it: the worker's own connection,
  // which comes later, takes it over, and its hello is the one that counts.
  router_.set(zmq::sockopt::router_handover, 1);
  for (std::size_t i = 0; i < identities_.size(); ++i) by_identity_.emplace(identities_[i], i);
}

ChannelEvents::ChannelEvents() {
  wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_)
    throw TransportError(fmt::format("cannot create an eventfd: {}", std::strerror(errno)));
}

void ChannelEvents::lost(std::size_t peer, std::string reason, std::vector<std::size_t> with) {
  {
    std::lock_guard lock(mu_);
    ChannelEvent e;
    e.kind = ChannelEvent::Kind::lost;
    e.peer = peer;
    e.reason = std::move(reason);
    e.with = std::move(with);
    pending_.push_back(std::move(e));
  }
  wake();
}

void ChannelEvents::wake() {
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void ChannelEvents::forget(std::size_t peer) {
  std::lock_guard lock(mu_);
  std::erase_if(pending_, [&](const ChannelEvent& e) {
    return e.kind == ChannelEvent::Kind::lost && e.peer == peer;
  });
}

std::optional<ChannelEvent> ChannelEvents::take() {
  std::lock_guard lock(mu_);
  if (pending_.empty()) return std::nullopt;
  ChannelEvent e = std::move(pending_.front());
  pending_.pop_front();
  return e;
}

void ChannelEvents::clear() {
  std::uint64_t n;
  (void)!::read(wake_.get(), &n, sizeof n);
}

ChannelEvent ChannelEvents::signalled() {
  std::uint64_t n;
  (void)!::read(wake_.get(), &n, sizeof n);
  if (auto e = take()) return std::move(*e);
  ChannelEvent w;
  w.kind = ChannelEvent::Kind::wake;
  return w;
}

RouterDriverChannel::~RouterDriverChannel() = default;

// One local worker's channels: the driver's ends, and the worker's until it is spawned.
struct LocalDriverChannel::Peer {
  explicit Peer(ShmPool* pool) {
    FdPair to_worker = FdPair::pipe("a worker's control channel");
    FdPair from_worker = FdPair::pipe("a worker's control channel");
    FdPair shm_pair = FdPair::seqpacket("a worker's shared-memory channel");
    stream =
        std::make_unique<FrameStream>(std::move(from_worker.first), std::move(to_worker.second));
    shm = std::make_unique<ShmChannel>(std::move(shm_pair.first), pool);
    ends = {std::move(to_worker.first), std::move(from_worker.second), std::move(shm_pair.second)};
  }
  std::unique_ptr<FrameStream> stream;
  std::unique_ptr<ShmChannel> shm;
  WorkerEnds ends;
  bool readable = false;  // the last poll said so, and no read emptied it since
  bool broken = false;    // its framing broke: reported once
  // The stream's write side: the driver's thread sends, and both it and the flusher write what
  // waits (Flusher::kCoalesce).
  CoalescedWrites writes;
  PolledStream polled() { return {stream.get(), &writes, &readable, &broken}; }
};

LocalDriverChannel::LocalDriverChannel(std::vector<std::string> names)
    : endpoint_(fmt::format("fd:{},{}", kControlInFd, kControlOutFd)), names_(std::move(names)) {
  for (std::size_t i = 0; i < names_.size(); ++i) peers_.push_back(std::make_unique<Peer>(&pool_));
  flusher_ = std::make_unique<Flusher>([this] { return flush_waiting(); });
}

LocalDriverChannel::~LocalDriverChannel() = default;

std::vector<int> LocalDriverChannel::flush_waiting() {
  std::vector<int> full;
  std::lock_guard peers(peers_mu_);
  for (auto& p : peers_) p->writes.flush(*p->stream, full);  // a worker gone: its launcher says so
  return full;
}

LocalDriverChannel::WorkerEnds LocalDriverChannel::take_worker_ends(std::size_t peer) {
  return std::move(peers_.at(peer)->ends);
}

void LocalDriverChannel::renew_worker_ends(std::size_t peer) {
  auto fresh = std::make_unique<Peer>(&pool_);
  std::unique_ptr<Peer> old;
  std::lock_guard lock(peers_mu_);
  old = std::exchange(peers_.at(peer), std::move(fresh));
}

// A worker whose end is gone has died (a worker whose link breaks exits): the launcher reports its
// loss, which fails or restarts what was sent to it, naming how it ended. What it is sent
// meanwhile goes nowhere, and is not the run's error. A worker that has not answered since the
// last message it was sent is busy with it (or the driver has not read its answer yet): this one
// waits for the next, up to Flusher::kCoalesce.
template <class Write>
void LocalDriverChannel::write_to(std::size_t peer, Peer& p, Write&& write) {
  bool waits = false;
  try {
    waits = write();
  } catch (const TransportError& e) {
    if (p.stream->peer_gone()) return;
    throw TransportError(fmt::format("cannot reach worker {}: {}", names_.at(peer), e.what()));
  }
  if (waits) flusher_->arm();
}

void LocalDriverChannel::send(std::size_t peer, const Message& m) {
  Peer& p = *peers_.at(peer);
  if (p.stream->peer_gone()) return;
  write_to(peer, p, [&] { return p.writes.send(*p.stream, encode_message(m, p.shm.get())); });
}

// One encoding for every worker that needs nothing of its own in it: a message without tensors
// (they may go through a worker's shared memory), to a worker with no released segments to name.
void LocalDriverChannel::send_each(const std::vector<std::size_t>& peers, const Message& m) {
  std::optional<Frames> shared;
  each_peer(peers, [&](std::size_t peer) {
    Peer& p = *peers_.at(peer);
    if (p.stream->peer_gone()) return;
    if (!shared) shared = encode_message(m);
    if (shared->size() > 1 || (p.shm && p.shm->has_released())) return send(peer, m);
    write_to(peer, p, [&] { return p.writes.send_shared(*p.stream, *shared); });
  });
}

void LocalDriverChannel::lost(std::size_t peer, std::string reason, std::vector<std::size_t> with) {
  events_.lost(peer, std::move(reason), std::move(with));
}

bool LocalDriverChannel::flush(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  bool all = true;
  for (auto& p : peers_) {
    std::lock_guard lock(p->writes.mu);
    if (!p->stream->has_output() || p->stream->closed()) continue;
    const auto left =
        std::max(std::chrono::milliseconds(0),
                 std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    try {
      all = p->stream->flush_wait(left) && all;
    } catch (const TransportError&) {
      // That worker is gone: its launcher reports it.
    }
  }
  return all;
}

std::optional<ChannelEvent> LocalDriverChannel::take_read() {
  for (std::size_t k = 0; k < peers_.size(); ++k) {
    const std::size_t i = (turn_ + k) % peers_.size();
    if (auto m = peers_[i]->polled().take(peers_[i]->shm.get(), drops_, names_[i])) {
      ChannelEvent e;
      e.peer = i;
      e.message = std::move(*m);
      turn_ = i + 1;
      return e;
    }
  }
  return std::nullopt;
}

std::optional<ChannelEvent> LocalDriverChannel::next(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const bool forever = timeout.count() < 0;
  // Read only once a poll is needed: what came already is taken without the clock.
  std::optional<Clock::time_point> until;
  for (;;) {
    if (auto e = take_read()) return e;
    // Read what the last poll found, until each of those sockets is empty.
    bool got = false;
    for (auto& p : peers_) got = p->polled().read_ready() || got;
    if (got) continue;
    // What a peer sent comes before the news that it is lost: a lost worker's last answers
    // count (the loss of a worker whose group restarts fails only the calls it did not answer).
    // So a lost event is delivered only once a poll found no peer with more to read.
    if (!held_) held_ = events_.take();
    if (!until) until = Clock::now() + (forever ? std::chrono::milliseconds(0) : timeout);
    const auto deadline = *until;
    const long left = poll_wait_ms(held_.has_value(), forever, deadline);
    // Two entries a peer: what it sent (POLLIN), and room for what waits for it (POLLOUT).
    polled_.clear();
    for (auto& p : peers_) p->polled().add_entries(polled_);
    polled_.push_back(pollfd{events_.fd(), POLLIN, 0});
    int rc;
    do {
      rc = ::poll(polled_.data(), polled_.size(), static_cast<int>(left));
    } while (rc < 0 && errno == EINTR);
    bool any = false;
    for (std::size_t i = 0; i < peers_.size() && rc > 0; ++i)
      any = peers_[i]->polled().polled(&polled_[2 * i]) || any;
    if (any) continue;
    if (held_) {
      // Its signal goes too (a later loss is taken before the next wait all the same).
      events_.clear();
      return std::exchange(held_, std::nullopt);
    }
    if (rc > 0 && (polled_.back().revents & POLLIN)) return events_.signalled();
    if (!forever && Clock::now() >= deadline) return std::nullopt;
  }
}

TcpDriverChannel::TcpDriverChannel(zmq::context_t& context, const std::string& host,
                                   std::vector<std::string> identities,
                                   const SocketSecurity& security)
    : RouterDriverChannel(context, std::move(identities)) {
  secure_server(router_, security);
  set_heartbeats(router_, kHeartbeatInterval, kHeartbeatTimeout);
  const std::string want = fmt::format("tcp://{}:*", host);
  try {
    router_.bind(want);
  } catch (const zmq::error_t& e) {
    throw TransportError(
        fmt::format("cannot bind the driver's socket {}: {}; is {} an address of this machine?",
                    want, e.what(), host));
  }
  endpoint_ = router_.get(zmq::sockopt::last_endpoint);
}

void RouterDriverChannel::send(std::size_t peer, const Message& m) {
  try {
    send_message(router_, m, &identities_.at(peer));
  } catch (const zmq::error_t& e) {
    throw TransportError(fmt::format("cannot reach worker {}: {}", identities_.at(peer), e.what()));
  }
}

void RouterDriverChannel::lost(std::size_t peer, std::string reason,
                               std::vector<std::size_t> with) {
  events_.lost(peer, std::move(reason), std::move(with));
}

void RouterDriverChannel::wake() { events_.wake(); }

std::optional<ChannelEvent> RouterDriverChannel::next(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const bool forever = timeout.count() < 0;
  const auto deadline = Clock::now() + (forever ? std::chrono::milliseconds(0) : timeout);
  for (;;) {
    // What a peer sent comes before the news that it is lost: a lost worker's last answers
    // count (the loss of a worker whose group restarts fails only the calls it did not answer).
    std::vector<zmq::message_t> frames;
    if (!zmq::recv_multipart(router_, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
      if (auto e = events_.take()) return e;
      long left = -1;
      if (!forever) {
        left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
        if (left <= 0) return std::nullopt;
      }
      if (wait_readable({router_}, events_.fd(), std::chrono::milliseconds(left)).fd)
        return events_.signalled();
      continue;
    }
    if (frames.empty()) continue;
    const std::string identity = frames.front().to_string();
    auto it = by_identity_.find(identity);
    if (it == by_identity_.end()) {
      drops_.drop(fmt::format("from an unknown peer \"{}\" (not a worker of this run)",
                              identity.substr(0, 64)));
      continue;
    }
    frames.erase(frames.begin());
    try {
      ChannelEvent e;
      e.peer = it->second;
      e.message = decode_message(std::move(frames));
      return e;
    } catch (const TransportError& err) {
      drops_.drop(fmt::format("from worker {}: {}", identity, err.what()));
    }
  }
}

void CallChannel::send_each(const std::vector<std::size_t>& peers, const Message& m) {
  each_peer(peers, [&](std::size_t peer) { send(peer, m); });
}

std::unique_ptr<WorkerLink> connect_local_worker(Fd from_driver, Fd to_driver, Fd shm,
                                                 std::function<void(const std::string&)> on_lost) {
  return std::make_unique<StreamWorkerLink>(std::move(from_driver), std::move(to_driver),
                                            std::move(shm), std::move(on_lost));
}

}  // namespace twinkle::transport

namespace twinkle::transport {

std::unique_ptr<WorkerLink> connect_stream_worker(const std::string& endpoint,
                                                  std::function<void(const std::string&)> on_lost) {
  return std::make_unique<StreamWorkerLink>(connect_stream(endpoint), endpoint, std::move(on_lost));
}

std::unique_ptr<WorkerLink> connect_tcp_worker(zmq::context_t& context, const std::string& endpoint,
                                               const std::string& identity,
                                               const SocketSecurity& security,
                                               std::function<void(const std::string&)> on_lost) {
  return std::make_unique<TcpWorkerLink>(context, endpoint, identity, security, std::move(on_lost));
}

}  // namespace twinkle::transport
