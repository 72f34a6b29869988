#include "transports/zmq/peers.hpp"

#include <sys/eventfd.h>
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

}  // namespace

ServeSocket::ServeSocket(zmq::context_t& context, const std::string& endpoint,
                         const SocketSecurity& security)
    : socket_(context, zmq::socket_type::router) {
  plain_options(socket_);
  socket_.set(zmq::sockopt::router_mandatory, 1);
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
}

std::optional<ServeSocket::Request> ServeSocket::recv(std::chrono::milliseconds timeout) {
  std::string from;
  try {
    auto m = recv_message(socket_, static_cast<int>(timeout.count()), &from);
    if (!m) return std::nullopt;
    return Request{std::move(from), std::move(*m)};
  } catch (const TransportError& e) {
    std::fprintf(stderr, "twinkle worker: dropped a message from worker \"%s\": %s\n",
                 from.substr(0, 64).c_str(), e.what());
    std::fflush(stderr);
    return std::nullopt;
  }
}

void ServeSocket::reply(const std::string& to, const Message& m) {
  try {
    send_message(socket_, m, &to);
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
      sockets_(endpoints_.size()) {
  wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_)
    throw TransportError(fmt::format("cannot create an eventfd: {}", std::strerror(errno)));
}

PeerChannel::~PeerChannel() = default;

void PeerChannel::watch(zmq::socket_ref socket, std::function<void()> on_ready) {
  watched_.emplace_back(socket, std::move(on_ready));
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
  s = std::move(socket);
  open_.push_back(peer);
  return *s;
}

void PeerChannel::send(std::size_t peer, const Message& m) {
  try {
    send_message(connection(peer), m);
  } catch (const zmq::error_t& e) {
    throw TransportError(fmt::format("cannot reach worker {}: {}", names_.at(peer), e.what()));
  }
}

void PeerChannel::lost(std::size_t peer, std::string reason) {
  ChannelEvent e;
  e.kind = ChannelEvent::Kind::lost;
  e.peer = peer;
  e.reason = std::move(reason);
  pending_.push_back(std::move(e));
  wake();
}

void PeerChannel::wake() {
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

std::optional<ChannelEvent> PeerChannel::next(std::chrono::milliseconds timeout) {
  const bool forever = timeout.count() < 0;
  const auto deadline = Clock::now() + (forever ? std::chrono::milliseconds(0) : timeout);
  auto next_tick = Clock::now() + tick_interval_;
  std::vector<zmq::pollitem_t> items;
  for (;;) {
    if (tick_ && Clock::now() >= next_tick) {
      tick_();
      next_tick = Clock::now() + tick_interval_;
    }
    if (!pending_.empty()) {
      ChannelEvent e = std::move(pending_.front());
      pending_.pop_front();
      return e;
    }
    // Replies first: every connection that has one.
    for (std::size_t peer : open_) {
      try {
        if (auto m = recv_message(*sockets_[peer], 0)) {
          ChannelEvent e;
          e.peer = peer;
          e.message = std::move(*m);
          return e;
        }
      } catch (const TransportError& err) {
        ++dropped_;
        std::fprintf(stderr, "twinkle worker %s: dropped a message from worker %s: %s\n",
                     identity_.c_str(), names_[peer].c_str(), err.what());
        std::fflush(stderr);
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
    items.clear();
    for (std::size_t peer : open_) items.push_back({sockets_[peer]->handle(), 0, ZMQ_POLLIN, 0});
    for (auto& [socket, _] : watched_) items.push_back({socket.handle(), 0, ZMQ_POLLIN, 0});
    items.push_back({nullptr, wake_.get(), ZMQ_POLLIN, 0});
    zmq::poll(items.data(), items.size(), std::chrono::milliseconds(left));
    if (items.back().revents & ZMQ_POLLIN) {
      std::uint64_t n;
      (void)!::read(wake_.get(), &n, sizeof n);
      if (pending_.empty()) {
        ChannelEvent w;
        w.kind = ChannelEvent::Kind::wake;
        return w;
      }
    }
    // The watched sockets' handlers run here; they may queue events (a lost worker) or answer
    // requests themselves.
    for (std::size_t i = 0; i < watched_.size(); ++i) {
      if (items[open_.size() + i].revents & ZMQ_POLLIN) watched_[i].second();
    }
  }
}

}  // namespace twinkle::transport
