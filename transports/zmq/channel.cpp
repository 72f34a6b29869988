#include "transports/zmq/channel.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

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

class LocalWorkerLink : public WorkerLink {
 public:
  LocalWorkerLink(zmq::context_t& context, const std::string& endpoint, const std::string& identity,
                  Fd shm)
      : socket_(make_socket(context, zmq::socket_type::dealer)) {
    socket_.set(zmq::sockopt::routing_id, identity);
    // Replies already queued still leave when the worker exits after its last one.
    socket_.set(zmq::sockopt::linger, 2000);
    socket_.connect(endpoint);
    if (shm) shm_ = std::make_unique<ShmChannel>(std::move(shm));
  }
  void send(const Message& m) override { send_message(socket_, m, nullptr, shm_.get()); }
  std::optional<Message> recv(std::chrono::milliseconds timeout) override {
    return recv_decoded(socket_, timeout, shm_.get(), drops_);
  }
  EncodedValue adopt(const twk_value_v1& v) override {
    return shm_ ? adopt_to_shm(v) : copy_encoded(v);
  }
  zmq::socket_ref socket() override { return socket_; }
  void drop(const std::string& why) override { drops_.drop(why); }

 private:
  zmq::socket_t socket_;
  std::unique_ptr<ShmChannel> shm_;
  DropLog drops_{"the worker's link to its driver"};
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
  zmq::socket_ref socket() override { return socket_; }
  void drop(const std::string& why) override { drops_.drop(why); }

 private:
  zmq::socket_t socket_;
  DropLog drops_{"the worker's link to its driver"};
  std::atomic<bool> connected_{false};
  std::unique_ptr<ConnectionWatch> watch_;
};

}  // namespace

Woke wait_readable(std::initializer_list<zmq::socket_ref> sockets, int fd,
                   std::chrono::milliseconds timeout) {
  pollfd fds[8];
  zmq::socket_ref socks[7];
  std::size_t n = 0;
  for (auto s : sockets) {
    if (n == 7) break;
    socks[n] = s;
    fds[n++] = pollfd{s.get(zmq::sockopt::fd), POLLIN, 0};
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
    (void)socks[i].get(zmq::sockopt::events);
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

ChannelEvent ChannelEvents::signalled() {
  std::uint64_t n;
  (void)!::read(wake_.get(), &n, sizeof n);
  if (auto e = take()) return std::move(*e);
  ChannelEvent w;
  w.kind = ChannelEvent::Kind::wake;
  return w;
}

RouterDriverChannel::~RouterDriverChannel() = default;

LocalDriverChannel::LocalDriverChannel(zmq::context_t& context,
                                       const std::filesystem::path& socket_path,
                                       std::vector<std::string> identities)
    : RouterDriverChannel(context, std::move(identities)) {
  const std::string path = socket_path.string();
  if (path.size() > kMaxSocketPath) {
    throw TransportError(fmt::format(
        "the control socket path {} is {} characters long, more than a Unix socket allows ({}); "
        "set TMPDIR to a shorter folder",
        path, path.size(), kMaxSocketPath));
  }
  endpoint_ = "ipc://" + path;
  try {
    router_.bind(endpoint_);
  } catch (const zmq::error_t& e) {
    throw TransportError(fmt::format("cannot bind the control socket {}: {}", endpoint_, e.what()));
  }
  for (std::size_t i = 0; i < identities_.size(); ++i) {
    FdPair pair = FdPair::seqpacket("a worker's shared-memory channel");
    shm_.push_back(std::make_unique<ShmChannel>(std::move(pair.first), &pool_));
    worker_ends_.push_back(std::move(pair.second));
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

LocalDriverChannel::~LocalDriverChannel() = default;

Fd LocalDriverChannel::take_worker_end(std::size_t peer) {
  return std::move(worker_ends_.at(peer));
}

void LocalDriverChannel::renew_worker_end(std::size_t peer) {
  FdPair pair = FdPair::seqpacket("a worker's shared-memory channel");
  shm_.at(peer) = std::make_unique<ShmChannel>(std::move(pair.first), &pool_);
  worker_ends_.at(peer) = std::move(pair.second);
}

void RouterDriverChannel::send(std::size_t peer, const Message& m) {
  try {
    send_message(router_, m, &identities_.at(peer), shm_of(peer));
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
      e.message = decode_message(std::move(frames), shm_of(it->second));
      return e;
    } catch (const TransportError& err) {
      drops_.drop(fmt::format("from worker {}: {}", identity, err.what()));
    }
  }
}

std::unique_ptr<WorkerLink> connect_local_worker(zmq::context_t& context,
                                                 const std::string& endpoint,
                                                 const std::string& identity, Fd shm) {
  return std::make_unique<LocalWorkerLink>(context, endpoint, identity, std::move(shm));
}

}  // namespace twinkle::transport

namespace twinkle::transport {

std::unique_ptr<WorkerLink> connect_tcp_worker(zmq::context_t& context, const std::string& endpoint,
                                               const std::string& identity,
                                               const SocketSecurity& security,
                                               std::function<void(const std::string&)> on_lost) {
  return std::make_unique<TcpWorkerLink>(context, endpoint, identity, security, std::move(on_lost));
}

}  // namespace twinkle::transport
