#include "transports/zmq/peers.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::transport {

namespace {

using Clock = std::chrono::steady_clock;

// As the driver's channel: no high-water marks (a caller that sends many calls before reading
// replies must not block on a worker that blocks on its replies), no linger at close.
void plain_options(zmq::socket_t& s) {
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::sndhwm, 0);
  s.set(zmq::sockopt::rcvhwm, 0);
}

// A SEQPACKET socket connected to (or bound at) `path`; an invalid Fd if that fails.
Fd unix_seqpacket(const std::string& path, bool bind_it) {
  sockaddr_un a{};
  if (path.size() >= sizeof a.sun_path) return Fd();
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  Fd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd) return Fd();
  auto* addr = reinterpret_cast<sockaddr*>(&a);
  if (bind_it ? (::bind(fd.get(), addr, sizeof a) != 0 || ::listen(fd.get(), 64) != 0)
              : ::connect(fd.get(), addr, sizeof a) != 0)
    return Fd();
  return fd;
}

}  // namespace

std::string shm_listener_path(const std::string& serve_endpoint) {
  if (!serve_endpoint.starts_with("ipc://")) return {};
  return serve_endpoint.substr(6) + ".fd";
}

ServeSocket::ServeSocket(zmq::context_t& context, const std::string& endpoint,
                         const SocketSecurity& security)
    : socket_(context, zmq::socket_type::router) {
  plain_options(socket_);
  socket_.set(zmq::sockopt::router_mandatory, 1);
  // A worker replaced after a restart connects under its predecessor's name, perhaps before
  // this socket saw the old connection go: the name goes to the new one.
  socket_.set(zmq::sockopt::router_handover, 1);
  if (endpoint.starts_with("tcp://")) {
    if (security.keys) secure_server(socket_, security);
    set_heartbeats(socket_, kHeartbeatInterval, kHeartbeatTimeout);
  }
  try {
    socket_.bind(endpoint);
  } catch (const zmq::error_t& e) {
    throw TransportError(fmt::format("cannot bind the socket for calls from other workers {}: {}",
                                     endpoint, e.what()));
  }
  endpoint_ = socket_.get(zmq::sockopt::last_endpoint);
  if (const std::string path = shm_listener_path(endpoint); !path.empty()) {
    listener_ = unix_seqpacket(path, true);
    if (!listener_) {
      throw TransportError(fmt::format("cannot listen on {} (shared memory between workers): {}",
                                       path, std::strerror(errno)));
    }
    listener_path_ = path;
  }
}

ServeSocket::~ServeSocket() {
  if (!listener_path_.empty()) ::unlink(listener_path_.c_str());
}

void ServeSocket::accept_pending() {
  if (!listener_) return;
  for (;;) {
    pollfd p{listener_.get(), POLLIN, 0};
    if (::poll(&p, 1, 0) != 1) return;
    Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd) return;
    // The caller writes its name right after connecting, before its first call.
    pollfd q{fd.get(), POLLIN, 0};
    char name[256];
    if (::poll(&q, 1, 1000) != 1) continue;
    const ssize_t n = ::recv(fd.get(), name, sizeof name, 0);
    if (n <= 0) continue;
    shm_[std::string(name, static_cast<std::size_t>(n))] =
        std::make_unique<ShmChannel>(std::move(fd), &pool_);
  }
}

ShmChannel* ServeSocket::shm_of(const std::string& caller) {
  accept_pending();
  auto it = shm_.find(caller);
  return it == shm_.end() ? nullptr : it->second.get();
}

std::optional<ServeSocket::Request> ServeSocket::recv(std::chrono::milliseconds timeout) {
  std::string from;
  for (;;) {
    try {
      auto frames = recv_frames(socket_, static_cast<int>(timeout.count()), &from);
      if (!frames) return std::nullopt;
      return Request{from, decode_message(std::move(*frames), shm_of(from))};
    } catch (const TransportError& e) {
      drops_.drop(fmt::format("from \"{}\": {}", from.substr(0, 64), e.what()));
      timeout = std::chrono::milliseconds(0);  // whatever else is there, without waiting again
    }
  }
}

void ServeSocket::reply(const std::string& to, const Message& m) {
  try {
    send_message(socket_, m, &to, shm_of(to));
  } catch (const zmq::error_t&) {
    // The caller is gone (its worker exited): nobody waits for this answer any more.
  }
}

PeerChannel::PeerChannel(zmq::context_t& context, std::string identity,
                         std::vector<std::string> names, std::vector<std::string> endpoints,
                         SocketSecurity security)
    : context_(context),
      identity_(std::move(identity)),
      names_(std::move(names)),
      endpoints_(std::move(endpoints)),
      security_(std::move(security)),
      sockets_(endpoints_.size()),
      shm_(endpoints_.size()) {}

PeerChannel::~PeerChannel() = default;

void PeerChannel::watch(Waitable w, std::function<void()> on_ready) {
  watched_.emplace_back(w, std::move(on_ready));
}

void PeerChannel::every(std::chrono::milliseconds interval, std::function<void()> tick) {
  tick_interval_ = interval;
  tick_ = std::move(tick);
}

zmq::socket_t& PeerChannel::connection(std::size_t peer) {
  auto& s = sockets_.at(peer);
  if (s) return *s;
  if (endpoints_[peer].empty()) {
    throw TransportError(
        fmt::format("worker {} has no address for calls between groups (it did not report one)",
                    names_.at(peer)));
  }
  auto socket = std::make_unique<zmq::socket_t>(context_, zmq::socket_type::dealer);
  plain_options(*socket);
  socket->set(zmq::sockopt::routing_id, identity_);
  if (endpoints_[peer].starts_with("tcp://")) {
    secure_client(*socket, security_);
    set_heartbeats(*socket, kHeartbeatInterval, kHeartbeatTimeout);
  }
  socket->connect(endpoints_[peer]);
  shm_[peer] = open_shm(peer);
  s = std::move(socket);
  open_.push_back(peer);
  return *s;
}

std::unique_ptr<ShmChannel> PeerChannel::open_shm(std::size_t peer) {
  const std::string path = shm_listener_path(endpoints_[peer]);
  if (path.empty()) return nullptr;
  Fd fd = unix_seqpacket(path, false);
  if (!fd || ::send(fd.get(), identity_.data(), identity_.size(), MSG_NOSIGNAL) !=
                 static_cast<ssize_t>(identity_.size()))
    return nullptr;  // plain frames then: slower, not wrong
  return std::make_unique<ShmChannel>(std::move(fd), &pool_);
}

void PeerChannel::send(std::size_t peer, const Message& m) {
  try {
    zmq::socket_t& socket = connection(peer);
    send_message(socket, m, nullptr, shm_[peer].get());
  } catch (const zmq::error_t& e) {
    throw TransportError(fmt::format("cannot reach worker {}: {}", names_.at(peer), e.what()));
  }
}

void PeerChannel::lost(std::size_t peer, std::string reason, std::vector<std::size_t> with) {
  events_.lost(peer, std::move(reason), std::move(with));
}

void PeerChannel::repoint(std::size_t peer, const std::string& endpoint) {
  if (peer >= endpoints_.size()) return;
  endpoints_[peer] = endpoint;
  sockets_[peer].reset();
  shm_[peer].reset();
  std::erase(open_, peer);
}

void PeerChannel::wake() { events_.wake(); }

std::optional<ChannelEvent> PeerChannel::next(std::chrono::milliseconds timeout) {
  const bool forever = timeout.count() < 0;
  const auto deadline = Clock::now() + (forever ? std::chrono::milliseconds(0) : timeout);
  auto next_tick = Clock::now() + tick_interval_;
  std::vector<pollfd> fds;
  for (;;) {
    if (tick_ && Clock::now() >= next_tick) {
      tick_();
      next_tick = Clock::now() + tick_interval_;
    }
    if (auto e = events_.take()) return e;
    // Replies first: every connection that has one.
    for (std::size_t peer : open_) {
      try {
        if (auto frames = recv_frames(*sockets_[peer], 0)) {
          ChannelEvent e;
          e.peer = peer;
          e.message = decode_message(std::move(*frames), shm_[peer].get());
          return e;
        }
      } catch (const TransportError& err) {
        drops_.drop(fmt::format("from worker {}: {}", names_[peer], err.what()));
        continue;
      }
    }
    long left = -1;
    if (!forever) {
      left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return std::nullopt;
    }
    if (tick_) {
      const long to_tick =
          std::chrono::duration_cast<std::chrono::milliseconds>(next_tick - Clock::now()).count() +
          1;
      left = left < 0 ? to_tick : std::min(left, to_tick);
    }
    // Not zmq::poll, which asks every socket for its events before and after it waits (two
    // system calls each, each time) and polls once more without waiting first. A connection's
    // receive just found nothing, so its descriptor signals what comes next (ARCHITECTURE.md,
    // Sockets). A watched socket may hold input its descriptor no longer signals (an operation on
    // it processed its commands): it is asked first. The watched sockets' handlers may queue
    // events (a lost worker) or answer requests themselves.
    bool ran = false;
    for (auto& [w, on_ready] : watched_) {
      if (w.socket && (w.socket.get(zmq::sockopt::events) & ZMQ_POLLIN)) {
        on_ready();
        ran = true;
      }
    }
    if (ran) continue;
    fds.clear();
    for (std::size_t peer : open_)
      fds.push_back({sockets_[peer]->get(zmq::sockopt::fd), POLLIN, 0});
    for (auto& [w, _] : watched_)
      fds.push_back({w.socket ? w.socket.get(zmq::sockopt::fd) : w.fd, POLLIN, 0});
    fds.push_back({events_.fd(), POLLIN, 0});
    int rc;
    while ((rc = ::poll(fds.data(), fds.size(), static_cast<int>(left))) < 0 && errno == EINTR) {
    }
    if (rc <= 0) continue;
    if (fds.back().revents) return events_.signalled();
    for (std::size_t i = 0; i < watched_.size(); ++i) {
      if (fds[open_.size() + i].revents) watched_[i].second();
    }
  }
}

}  // namespace twinkle::transport
