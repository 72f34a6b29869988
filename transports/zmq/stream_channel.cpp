// StreamDriverChannel: the driver's end of remote workers' control channels in a cluster without
// keys, a FrameStream over one TCP connection per worker (docs/ARCHITECTURE.md, Sockets).
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "transports/zmq/channel.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::transport {

namespace {

using Clock = std::chrono::steady_clock;

// No Nagle delay (every message is a whole call or reply), and an idle connection to a machine
// that is gone ends within about kHeartbeatTimeout (keepalive probes, answered by the peer's
// kernel). No TCP_USER_TIMEOUT: a peer that does not read (a worker in a long call, a driver
// busy in its entry) leaves the sender a full window, and a user timeout would end that live
// connection after it (measured: 3.5 s with 3 s); a machine gone while data waits is found by
// TCP's retransmissions, and sooner by the head (a DEAD node).
void tune_socket(int fd) {
  const int one = 1;
  const int idle = 1, interval = 1, count = 2;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  (void)::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
}

// HOST and PORT of "tcp+stream://HOST:PORT" ("[V6]:PORT" too); false when it is not one.
bool split_endpoint(const std::string& endpoint, std::string& host, std::string& port) {
  if (!endpoint.starts_with(kStreamScheme)) return false;
  std::string rest = endpoint.substr(kStreamScheme.size());
  const auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == rest.size()) return false;
  host = rest.substr(0, colon);
  port = rest.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return true;
}

std::string address_text(const sockaddr_storage& a) {
  char host[NI_MAXHOST], port[NI_MAXSERV];
  if (::getnameinfo(reinterpret_cast<const sockaddr*>(&a), sizeof a, host, sizeof host, port,
                    sizeof port, NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  return a.ss_family == AF_INET6 ? fmt::format("[{}]:{}", host, port)
                                 : fmt::format("{}:{}", host, port);
}

}  // namespace

// One worker's connection (or one that has not said hello yet).
struct StreamDriverChannel::Conn {
  explicit Conn(Fd socket) : stream(std::move(socket)) {}
  FrameStream stream;
  CoalescedWrites writes;  // the driver's thread and the flusher
  bool readable = false;   // the last poll said so, and no read emptied it since
  bool broken = false;     // its framing broke: reported once
  PolledStream polled() { return {&stream, &writes, &readable, &broken}; }
};

Fd listen_stream(const std::string& host, const std::string& what, std::string& endpoint) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string bare =
      host.size() > 2 && host.front() == '[' ? host.substr(1, host.size() - 2) : host;
  if (const int rc = ::getaddrinfo(bare.c_str(), "0", &hints, &found); rc != 0) {
    throw TransportError(fmt::format("cannot bind {} on {}: {}; is {} an address of this machine?",
                                     what, host, ::gai_strerror(rc), host));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  Fd listener(::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  const int one = 1;
  if (!listener || ::setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      ::bind(listener.get(), found->ai_addr, found->ai_addrlen) != 0 ||
      ::listen(listener.get(), SOMAXCONN) != 0) {
    throw TransportError(fmt::format("cannot bind {} on {}: {}; is {} an address of this machine?",
                                     what, host, std::strerror(errno), host));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&bound), &len);
  endpoint = std::string(kStreamScheme) + address_text(bound);
  return listener;
}

Fd accept_stream(int listener, std::string* from) {
  sockaddr_storage peer{};
  socklen_t len = sizeof peer;
  Fd fd(
      ::accept4(listener, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (fd) {
    tune_socket(fd.get());
    if (from) *from = address_text(peer);
  }
  return fd;
}

StreamDriverChannel::StreamDriverChannel(const std::string& host,
                                         std::vector<std::string> identities)
    : identities_(std::move(identities)), peers_(identities_.size()) {
  for (std::size_t i = 0; i < identities_.size(); ++i) by_identity_.emplace(identities_[i], i);
  listener_ = listen_stream(host, "the driver's socket", endpoint_);
  flusher_ = std::make_unique<Flusher>([this] { return flush_waiting(); });
}

StreamDriverChannel::~StreamDriverChannel() = default;

std::vector<int> StreamDriverChannel::flush_waiting() {
  std::vector<int> full;
  std::lock_guard lock(peers_mu_);
  for (auto& p : peers_) {
    if (p) p->writes.flush(p->stream, full);  // a worker gone: its launcher says so
  }
  return full;
}

void StreamDriverChannel::send(std::size_t peer, const Message& m) {
  Conn* p = peers_.at(peer).get();
  if (!p || p->stream.peer_gone()) return;
  bool waits = false;
  try {
    waits = p->writes.send(p->stream, encode_message(m));
  } catch (const TransportError& e) {
    if (p->stream.peer_gone()) return;
    throw TransportError(fmt::format("cannot reach worker {}: {}", identities_.at(peer), e.what()));
  }
  if (waits) flusher_->arm();
}

void StreamDriverChannel::lost(std::size_t peer, std::string reason,
                               std::vector<std::size_t> with) {
  events_.lost(peer, std::move(reason), std::move(with));
}

bool StreamDriverChannel::flush(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  bool all = true;
  for (auto& p : peers_) {
    if (!p) continue;
    std::lock_guard lock(p->writes.mu);
    if (!p->stream.has_output() || p->stream.closed()) continue;
    const auto left =
        std::max(std::chrono::milliseconds(0),
                 std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    try {
      all = p->stream.flush_wait(left) && all;
    } catch (const TransportError&) {
      // That worker is gone: its launcher reports it.
    }
  }
  return all;
}

void StreamDriverChannel::accept_pending() {
  for (;;) {
    std::string from;
    Fd fd = accept_stream(listener_.get(), &from);
    if (!fd) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        drops_.drop(fmt::format("cannot accept a connection: {}", std::strerror(errno)));
      return;
    }
    if (pending_.size() >= kMaxPending) {
      drops_.drop(fmt::format("a connection from {} closed: {} others have not said hello", from,
                              pending_.size()));
      pending_.pop_front();
    }
    pending_.push_back(std::make_unique<Conn>(std::move(fd)));
    pending_.back()->readable = true;  // a worker says hello at once
  }
}

std::optional<ChannelEvent> StreamDriverChannel::take_read() {
  // A connection's first message is a hello naming a worker of this run, or the connection goes.
  for (auto it = pending_.begin(); it != pending_.end();) {
    Conn& c = **it;
    auto frames = c.stream.take();
    if (!frames) {
      if (!c.stream.closed()) {
        ++it;
        continue;
      }
      if (!c.stream.error().empty())  // not Twinkle's framing
        drops_.drop(fmt::format("from a new connection: {}; it is closed", c.stream.error()));
      it = pending_.erase(it);
      continue;
    }
    std::string why;
    try {
      Message m = decode_message(std::move(*frames));
      const auto* hello = m.get<proto::Hello>();
      auto known = hello ? by_identity_.find(hello->name) : by_identity_.end();
      if (known != by_identity_.end()) {
        const std::size_t peer = known->second;
        {
          std::lock_guard lock(peers_mu_);
          // A worker's connection replaces whatever said hello under its name before.
          peers_[peer] = std::move(*it);
        }
        pending_.erase(it);
        ChannelEvent e;
        e.peer = peer;
        e.message = std::move(m);
        return e;
      }
      why = hello ? fmt::format("a hello from \"{}\", not a worker of this run",
                                hello->name.substr(0, 64))
                  : fmt::format("a {} message before any hello", to_string(m.type()));
    } catch (const TransportError& err) {
      why = err.what();
    }
    drops_.drop(fmt::format("from a new connection: {}; it is closed", why));
    it = pending_.erase(it);
  }
  for (std::size_t k = 0; k < peers_.size(); ++k) {
    const std::size_t i = (turn_ + k) % peers_.size();
    if (!peers_[i]) continue;
    if (auto m = peers_[i]->polled().take(nullptr, drops_, identities_[i])) {
      ChannelEvent e;
      e.peer = i;
      e.message = std::move(*m);
      turn_ = i + 1;
      return e;
    }
  }
  return std::nullopt;
}

std::optional<ChannelEvent> StreamDriverChannel::next(std::chrono::milliseconds timeout) {
  const bool forever = timeout.count() < 0;
  const auto deadline = Clock::now() + (forever ? std::chrono::milliseconds(0) : timeout);
  for (;;) {
    if (auto e = take_read()) return e;
    // Read what the last poll found, until each of those sockets is empty.
    bool got = false;
    for (auto& p : peers_) got = (p && p->polled().read_ready()) || got;
    for (auto& c : pending_) got = c->polled().read_ready() || got;
    if (got) continue;
    // What a peer sent comes before the news that it is lost (as LocalDriverChannel::next).
    if (!held_) held_ = events_.take();
    const long left = poll_wait_ms(held_.has_value(), forever, deadline);
    // Two entries a peer (what it sent; room for what waits for it), one a pending connection,
    // the listener, the events.
    polled_.clear();
    for (auto& p : peers_) (p ? p->polled() : PolledStream{}).add_entries(polled_);
    for (auto& c : pending_) polled_.push_back(pollfd{c->stream.in_fd(), POLLIN, 0});
    polled_.push_back(pollfd{listener_.get(), POLLIN, 0});
    polled_.push_back(pollfd{events_.fd(), POLLIN, 0});
    int rc;
    do {
      rc = ::poll(polled_.data(), polled_.size(), static_cast<int>(left));
    } while (rc < 0 && errno == EINTR);
    bool any = false;
    for (std::size_t i = 0; i < peers_.size() && rc > 0; ++i)
      any = (peers_[i] && peers_[i]->polled().polled(&polled_[2 * i])) || any;
    const std::size_t base = 2 * peers_.size();
    for (std::size_t i = 0; i < pending_.size() && rc > 0; ++i) {
      if (polled_[base + i].revents) any = pending_[i]->readable = true;
    }
    if (rc > 0 && polled_[polled_.size() - 2].revents) {
      accept_pending();
      any = true;
    }
    if (any) continue;
    if (held_) {
      events_.clear();
      return std::exchange(held_, std::nullopt);
    }
    if (rc > 0 && (polled_.back().revents & POLLIN)) return events_.signalled();
    if (!forever && Clock::now() >= deadline) return std::nullopt;
  }
}

Fd connect_stream(const std::string& endpoint, const std::string& who, int* error) {
  std::string host, port;
  if (!split_endpoint(endpoint, host, port))
    throw TransportError(fmt::format("{}: not a tcp+stream://HOST:PORT endpoint", endpoint));
  auto fail = [&](int err, const char* text) {
    if (error) {
      *error = err;
      return Fd();
    }
    throw TransportError(fmt::format("cannot reach {} at {}: {}", who, endpoint, text));
  };
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0)
    return fail(EHOSTUNREACH, ::gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  Fd fd(::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return fail(errno, std::strerror(errno));
  tune_socket(fd.get());
  int err = 0;
  if (::connect(fd.get(), found->ai_addr, found->ai_addrlen) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      pollfd p{fd.get(), POLLOUT, 0};
      int rc;
      while ((rc = ::poll(&p, 1, 10000)) < 0 && errno == EINTR) {
      }
      socklen_t len = sizeof err;
      if (rc == 0) {
        err = ETIMEDOUT;
      } else if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
        err = errno;
      }
    }
  }
  if (err != 0) return fail(err, std::strerror(err));
  return fd;
}

}  // namespace twinkle::transport
