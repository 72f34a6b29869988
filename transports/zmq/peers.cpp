#include "transports/zmq/peers.hpp"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "transports/fd.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::transport {

namespace {

using Clock = std::chrono::steady_clock;

// A greeting: these four bytes, then the caller's name; its descriptors ride along.
constexpr char kGreeting[4] = {'T', 'W', 'K', 'G'};
constexpr std::size_t kMaxName = 255;
// The read end of the caller's call pipe, the write end of its reply pipe, its end of the
// descriptor channel.
constexpr std::size_t kGreetingFds = 3;

// What an epoll entry of a serve socket is: its data is the key << 2 | the kind.
enum Kind : std::uint64_t { kListener = 0, kGreeter = 1, kCaller = 2 };
std::uint64_t tag(std::uint64_t key, Kind kind) { return key << 2 | kind; }

// As the driver's channel: no high-water marks (a caller that sends many calls before reading
// replies must not block on a worker that blocks on its replies), no linger at close.
void plain_options(zmq::socket_t& s) {
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::sndhwm, 0);
  s.set(zmq::sockopt::rcvhwm, 0);
}

// A SEQPACKET socket bound at `path` and listening (non-blocking), or connected to it (blocking:
// a connection to a listener is made or refused at once); an invalid Fd with errno if that fails.
Fd unix_seqpacket(const std::string& path, bool bind_it) {
  sockaddr_un a{};
  if (path.size() >= sizeof a.sun_path) {
    errno = ENAMETOOLONG;
    return Fd();
  }
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  Fd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | (bind_it ? SOCK_NONBLOCK : 0), 0));
  if (!fd) return Fd();
  auto* addr = reinterpret_cast<sockaddr*>(&a);
  if (bind_it ? (::bind(fd.get(), addr, sizeof a) != 0 || ::listen(fd.get(), SOMAXCONN) != 0)
              : ::connect(fd.get(), addr, sizeof a) != 0)
    return Fd();
  return fd;
}

bool is_kind(int fd, mode_t kind) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 && (st.st_mode & S_IFMT) == kind;
}

void epoll_watch(int epoll, int fd, std::uint64_t data) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = data;
  if (::epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &ev) != 0)
    throw TransportError(
        fmt::format("cannot watch a connection between workers: {}", std::strerror(errno)));
}

}  // namespace

std::string local_serve_path(const std::string& serve_endpoint) {
  if (!serve_endpoint.starts_with("unix://")) return {};
  return serve_endpoint.substr(7);
}

// A caller's connection: a local one's call pipe read, its reply pipe written (by the worker's
// thread and the flusher, CoalescedWrites), its descriptor channel; a remote one's TCP stream,
// nameless until its greeting came.
struct ServeSocket::Caller {
  Caller(std::string who, Fd calls, Fd replies, Fd descriptors, ShmPool* pool)
      : name(std::move(who)),
        stream(std::move(calls), std::move(replies), false),
        shm(std::make_unique<ShmChannel>(std::move(descriptors), pool)),
        greeted(true) {}
  explicit Caller(Fd socket) : stream(std::move(socket)) {}
  std::string name;
  FrameStream stream;
  std::unique_ptr<ShmChannel> shm;  // local callers'
  bool greeted = false;
  CoalescedWrites writes;
};

// The name in a stream caller's first message, or nothing when it is not a greeting.
std::optional<std::string> greeting_name(const Frames& frames) {
  if (frames.size() != 1) return std::nullopt;
  const auto* data = static_cast<const char*>(frames[0].data());
  const std::size_t size = frames[0].size();
  if (size <= sizeof kGreeting || size > sizeof kGreeting + kMaxName ||
      std::memcmp(data, kGreeting, sizeof kGreeting) != 0)
    return std::nullopt;
  return std::string(data + sizeof kGreeting, size - sizeof kGreeting);
}

ServeSocket::ServeSocket(zmq::context_t& context, const std::string& endpoint,
                         const SocketSecurity& security) {
  if (const std::string path = local_serve_path(endpoint); !path.empty()) {
    if (path.size() > kMaxSocketPath) {
      throw TransportError(fmt::format(
          "cannot listen on {} for calls from other workers: the path is longer than a Unix "
          "socket's {} bytes (use a shorter run folder)",
          path, kMaxSocketPath));
    }
    listener_ = unix_seqpacket(path, true);
    if (!listener_) {
      throw TransportError(fmt::format("cannot listen on {} for calls from other workers: {}", path,
                                       std::strerror(errno)));
    }
    path_ = path;
    endpoint_ = endpoint;
    start_polling();
    return;
  }
  if (endpoint.starts_with(kStreamScheme)) {
    const std::string rest = endpoint.substr(kStreamScheme.size());
    const auto colon = rest.rfind(':');
    listener_ =
        listen_stream(rest.substr(0, colon), "the socket for calls from other workers", endpoint_);
    stream_ = true;
    start_polling();
    return;
  }
  router_ = std::make_unique<zmq::socket_t>(context, zmq::socket_type::router);
  plain_options(*router_);
  router_->set(zmq::sockopt::router_mandatory, 1);
  // A worker replaced after a restart connects under its predecessor's name, perhaps before
  // this socket saw the old connection go: the name goes to the new one.
  router_->set(zmq::sockopt::router_handover, 1);
  if (endpoint.starts_with("tcp://")) {
    if (security.keys) secure_server(*router_, security);
    set_heartbeats(*router_, kHeartbeatInterval, kHeartbeatTimeout);
  }
  try {
    router_->bind(endpoint);
  } catch (const zmq::error_t& e) {
    throw TransportError(fmt::format("cannot bind the socket for calls from other workers {}: {}",
                                     endpoint, e.what()));
  }
  endpoint_ = router_->get(zmq::sockopt::last_endpoint);
}

// Local and stream mode: one epoll descriptor over the listener and, later, every caller.
void ServeSocket::start_polling() {
  epoll_.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_)
    throw TransportError(fmt::format(
        "cannot create an epoll instance for calls from other workers: {}", std::strerror(errno)));
  epoll_watch(epoll_.get(), listener_.get(), tag(0, kListener));
  flusher_ = std::make_unique<Flusher>([this] { return flush_waiting(); });
}

ServeSocket::~ServeSocket() {
  flusher_.reset();
  if (router_) return;
  if (!path_.empty()) ::unlink(path_.c_str());
  // Replies a full pipe did not take yet go before the worker ends, for a moment at most.
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  for (auto& [key, c] : callers_) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    try {
      if (c->stream.has_output()) c->stream.flush_wait(left);
    } catch (const TransportError&) {
    }
  }
}

Waitable ServeSocket::waitable() {
  if (router_) return Waitable(*router_);
  return Waitable::descriptor(epoll_.get());
}

std::vector<int> ServeSocket::flush_waiting() {
  std::vector<int> full;
  std::lock_guard lock(callers_mu_);
  for (auto& [key, c] : callers_) c->writes.flush(c->stream, full);  // a caller gone: read next
  return full;
}

void ServeSocket::accept_greetings() {
  for (;;) {
    Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        drops_.drop(
            fmt::format("cannot accept a connection on {}: {}", path_, std::strerror(errno)));
      return;
    }
    if (greeting_.size() >= kMaxGreeting) {
      drops_.drop(fmt::format("a connection on {}: {} others have not greeted yet", path_,
                              greeting_.size()));
      continue;  // closed
    }
    const std::uint64_t key = ++next_key_;
    epoll_watch(epoll_.get(), fd.get(), tag(key, kGreeter));
    greeting_.emplace(key, std::move(fd));
    greet(key);  // a caller greets as soon as it connected: its greeting is usually there
  }
}

void ServeSocket::accept_streams() {
  for (;;) {
    std::string from;
    Fd fd = accept_stream(listener_.get(), &from);
    if (!fd) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        drops_.drop(
            fmt::format("cannot accept a connection on {}: {}", endpoint_, std::strerror(errno)));
      return;
    }
    const auto waiting = std::count_if(callers_.begin(), callers_.end(),
                                       [](const auto& c) { return !c.second->greeted; });
    if (static_cast<std::size_t>(waiting) >= kMaxGreeting) {
      drops_.drop(fmt::format("a connection from {} on {}: {} others have not greeted yet", from,
                              endpoint_, waiting));
      continue;  // closed
    }
    const std::uint64_t key = ++next_key_;
    auto caller = std::make_unique<Caller>(std::move(fd));
    epoll_watch(epoll_.get(), caller->stream.in_fd(), tag(key, kCaller));
    {
      std::lock_guard lock(callers_mu_);
      callers_.emplace(key, std::move(caller));
    }
    read_caller(key);  // a caller greets as soon as it connected
  }
}

void ServeSocket::name_caller(std::uint64_t key, const std::string& name) {
  // A worker replaced after a restart greets under its predecessor's name: the name goes to the
  // new connection, and the old one (of a worker gone or going) is closed.
  if (auto old = by_name_.find(name); old != by_name_.end() && old->second != key)
    close_caller(old->second);
  std::lock_guard lock(callers_mu_);
  by_name_[name] = key;
}

void ServeSocket::greet(std::uint64_t key) {
  auto it = greeting_.find(key);
  if (it == greeting_.end()) return;
  char buf[sizeof kGreeting + kMaxName + 1];
  std::vector<Fd> fds;
  const ssize_t n = receive_with_fds(it->second.get(), buf, fds, kGreetingFds, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;  // not yet
  const int err = errno;
  // One message a connection: read or not, it is done with (closing it leaves the epoll set).
  Fd done = std::move(it->second);
  greeting_.erase(it);
  if (n == 0) return;  // closed without a word
  const auto size = static_cast<std::size_t>(n);
  std::string why;
  if (n < 0) {
    why = err == EMSGSIZE ? "longer than a greeting" : std::strerror(err);
  } else if (size <= sizeof kGreeting || std::memcmp(buf, kGreeting, sizeof kGreeting) != 0) {
    why = "not a greeting (is another program talking to this socket?)";
  } else if (fds.size() != kGreetingFds || !is_kind(fds[0].get(), S_IFIFO) ||
             !is_kind(fds[1].get(), S_IFIFO) || !is_kind(fds[2].get(), S_IFSOCK)) {
    why = "a greeting without its two pipes and socket";
  }
  if (!why.empty()) {
    drops_.drop(fmt::format("a connection on {}: {}", path_, why));
    return;
  }
  std::string name(buf + sizeof kGreeting, size - sizeof kGreeting);
  auto caller = std::make_unique<Caller>(name, std::move(fds[0]), std::move(fds[1]),
                                         std::move(fds[2]), &pool_);
  epoll_watch(epoll_.get(), caller->stream.in_fd(), tag(key, kCaller));
  {
    std::lock_guard lock(callers_mu_);
    callers_.emplace(key, std::move(caller));
  }
  name_caller(key, name);
  read_caller(key);  // what it sent already
}

void ServeSocket::read_caller(std::uint64_t key) {
  auto it = callers_.find(key);
  if (it == callers_.end()) return;
  Caller& c = *it->second;
  for (;;) {
    bool read_data = false;
    auto frames = c.stream.recv(&read_data);
    if (read_data) c.writes.heard();
    if (!frames) break;
    if (!c.greeted) {
      auto name = greeting_name(*frames);
      if (!name) {
        drops_.drop(
            fmt::format("a connection on {}: its first message is not a greeting (is "
                        "another program talking to this socket?)",
                        endpoint_));
        close_caller(key);
        return;
      }
      c.name = std::move(*name);
      c.greeted = true;
      name_caller(key, c.name);
      continue;
    }
    try {
      ready_.push_back(Request{c.name, decode_message(std::move(*frames), c.shm.get())});
    } catch (const TransportError& e) {
      drops_.drop(fmt::format("from \"{}\": {}", c.name.substr(0, 64), e.what()));
    }
  }
  if (!c.stream.closed()) return;
  if (!c.stream.error().empty())
    drops_.drop(fmt::format("from \"{}\": {}", c.name.substr(0, 64), c.stream.error()));
  close_caller(key);
}

void ServeSocket::close_caller(std::uint64_t key) {
  auto it = callers_.find(key);
  if (it == callers_.end()) return;
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, it->second->stream.in_fd(), nullptr);
  std::unique_ptr<Caller> gone;
  {
    std::lock_guard lock(callers_mu_);
    gone = std::move(it->second);
    callers_.erase(it);
    if (auto n = by_name_.find(gone->name); n != by_name_.end() && n->second == key)
      by_name_.erase(n);
  }
}

void ServeSocket::poll_local(std::chrono::milliseconds timeout) {
  const bool forever = timeout.count() < 0;
  const auto deadline = Clock::now() + (forever ? std::chrono::milliseconds(0) : timeout);
  epoll_event events[16];
  for (;;) {
    int wait_ms = -1;
    if (!forever) {
      wait_ms = static_cast<int>(std::max<long>(
          0,
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
    }
    int n;
    while ((n = ::epoll_wait(epoll_.get(), events, 16, wait_ms)) < 0 && errno == EINTR) {
    }
    for (int i = 0; i < n; ++i) {
      const std::uint64_t key = events[i].data.u64 >> 2;
      switch (events[i].data.u64 & 3) {
        case kListener: stream_ ? accept_streams() : accept_greetings(); break;
        case kGreeter: greet(key); break;
        default:
          read_caller(key);  // one closed by an earlier event of this batch is no longer there
      }
    }
    if (!ready_.empty() || n < 0 || wait_ms == 0) return;
    if (!forever && Clock::now() >= deadline) return;
  }
}

std::optional<ServeSocket::Request> ServeSocket::recv(std::chrono::milliseconds timeout) {
  if (!router_) {
    if (ready_.empty()) poll_local(timeout);
    if (ready_.empty()) return std::nullopt;
    Request r = std::move(ready_.front());
    ready_.pop_front();
    return r;
  }
  std::string from;
  for (;;) {
    try {
      auto frames = recv_frames(*router_, static_cast<int>(timeout.count()), &from);
      if (!frames) return std::nullopt;
      return Request{from, decode_message(std::move(*frames))};
    } catch (const TransportError& e) {
      drops_.drop(fmt::format("from \"{}\": {}", from.substr(0, 64), e.what()));
      timeout = std::chrono::milliseconds(0);  // whatever else is there, without waiting again
    }
  }
}

void ServeSocket::reply(const std::string& to, const Message& m) {
  if (router_) {
    try {
      send_message(*router_, m, &to);
    } catch (const zmq::error_t&) {
      // The caller is gone (its worker exited): nobody waits for this answer any more.
    }
    return;
  }
  auto it = by_name_.find(to);
  if (it == by_name_.end()) return;  // gone, as above
  Caller& c = *callers_.at(it->second);
  bool waits = false;
  try {
    waits = c.writes.send(c.stream, encode_message(m, c.shm.get()));
  } catch (const TransportError&) {
    return;  // gone: its end of the stream is read next
  }
  if (waits) flusher_->arm();
}

// A connection to a worker: a DEALER (remote), or the two pipes and the descriptor channel that
// a greeting handed over (local).
struct PeerChannel::Connection {
  std::unique_ptr<zmq::socket_t> socket;
  std::unique_ptr<FrameStream> stream;
  std::unique_ptr<ShmChannel> shm;
  CoalescedWrites writes;  // the stream's: the worker's thread and the flusher
};

PeerChannel::PeerChannel(zmq::context_t& context, std::string identity,
                         std::vector<std::string> names, std::vector<std::string> endpoints,
                         SocketSecurity security)
    : context_(context),
      identity_(std::move(identity)),
      names_(std::move(names)),
      endpoints_(std::move(endpoints)),
      security_(std::move(security)),
      connections_(endpoints_.size()),
      flusher_(std::make_unique<Flusher>([this] { return flush_waiting(); })) {}

PeerChannel::~PeerChannel() { flusher_.reset(); }

void PeerChannel::watch(Waitable w, std::function<void()> on_ready) {
  watched_.emplace_back(w, std::move(on_ready));
}

void PeerChannel::every(std::chrono::milliseconds interval, std::function<void()> tick) {
  tick_interval_ = interval;
  tick_ = std::move(tick);
}

std::vector<int> PeerChannel::flush_waiting() {
  std::vector<int> full;
  std::lock_guard lock(connections_mu_);
  for (auto& c : connections_) {
    if (c && c->stream) c->writes.flush(*c->stream, full);
  }
  return full;
}

std::unique_ptr<PeerChannel::Connection> PeerChannel::connect_local(std::size_t peer,
                                                                    const std::string& path) {
  auto gone = [](int err) { return err == ENOENT || err == ECONNREFUSED || err == EPIPE; };
  Fd socket = unix_seqpacket(path, false);
  if (!socket) {
    if (gone(errno)) return nullptr;
    throw TransportError(fmt::format("cannot reach worker {} at {}: {}", names_.at(peer), path,
                                     std::strerror(errno)));
  }
  FdPair calls = FdPair::pipe("calls to another worker");
  FdPair replies = FdPair::pipe("replies from another worker");
  FdPair descriptors = FdPair::seqpacket("shared memory between workers");
  std::string greeting(kGreeting, sizeof kGreeting);
  greeting += identity_;
  const int theirs[kGreetingFds] = {calls.first.get(), replies.second.get(),
                                    descriptors.second.get()};
  if (send_with_fds(socket.get(), greeting.data(), greeting.size(), theirs) < 0) {
    if (gone(errno) || errno == ECONNRESET) return nullptr;
    throw TransportError(fmt::format("cannot reach worker {} at {}: {}", names_.at(peer), path,
                                     std::strerror(errno)));
  }
  auto c = std::make_unique<Connection>();
  c->stream =
      std::make_unique<FrameStream>(std::move(replies.first), std::move(calls.second), false);
  c->shm = std::make_unique<ShmChannel>(std::move(descriptors.first), &pool_);
  return c;
}

std::unique_ptr<PeerChannel::Connection> PeerChannel::connect_remote(std::size_t peer) {
  if (endpoints_[peer].starts_with(kStreamScheme)) {
    // Refused: the worker is gone (its loss or replacement comes from the driver, as for a local
    // one); a machine that does not answer within 10 s fails the call, naming it.
    int err = 0;
    Fd socket = connect_stream(endpoints_[peer], "worker " + names_.at(peer), &err);
    if (!socket) {
      if (err == ECONNREFUSED || err == ECONNRESET) return nullptr;
      throw TransportError(fmt::format("cannot reach worker {} at {}: {}", names_.at(peer),
                                       endpoints_[peer], std::strerror(err)));
    }
    auto c = std::make_unique<Connection>();
    c->stream = std::make_unique<FrameStream>(std::move(socket));
    std::string greeting(kGreeting, sizeof kGreeting);
    greeting += identity_;
    Frames hello;
    hello.emplace_back(greeting.data(), greeting.size());
    try {
      c->stream->send(std::move(hello));  // the first of what this connection sends
    } catch (const TransportError&) {
      return nullptr;  // closed at once: gone, as above
    }
    return c;
  }
  auto c = std::make_unique<Connection>();
  c->socket = std::make_unique<zmq::socket_t>(context_, zmq::socket_type::dealer);
  zmq::socket_t& s = *c->socket;
  plain_options(s);
  s.set(zmq::sockopt::routing_id, identity_);
  if (endpoints_[peer].starts_with("tcp://")) {
    secure_client(s, security_);
    set_heartbeats(s, kHeartbeatInterval, kHeartbeatTimeout);
  }
  s.connect(endpoints_[peer]);
  return c;
}

PeerChannel::Connection* PeerChannel::connection(std::size_t peer) {
  auto& c = connections_.at(peer);
  if (c) return c.get();
  if (endpoints_[peer].empty()) {
    throw TransportError(
        fmt::format("worker {} has no address for calls between groups (it did not report one)",
                    names_.at(peer)));
  }
  const std::string path = local_serve_path(endpoints_[peer]);
  auto made = path.empty() ? connect_remote(peer) : connect_local(peer, path);
  if (!made) return nullptr;
  std::lock_guard lock(connections_mu_);
  c = std::move(made);
  open_.push_back(peer);
  return c.get();
}

void PeerChannel::close(std::size_t peer) {
  std::unique_ptr<Connection> gone;
  std::lock_guard lock(connections_mu_);
  gone = std::move(connections_.at(peer));
  std::erase(open_, peer);
}

void PeerChannel::send(std::size_t peer, const Message& m) {
  Connection* c = connection(peer);
  // A local worker that is gone (its socket refused the connection, or its end of the stream
  // closed): the driver reports its loss, or its replacement (repoint), which fails or answers
  // what was sent to it. What it is sent meanwhile goes nowhere.
  if (!c) return;
  if (c->socket) {
    try {
      send_message(*c->socket, m);
    } catch (const zmq::error_t& e) {
      throw TransportError(fmt::format("cannot reach worker {}: {}", names_.at(peer), e.what()));
    }
    return;
  }
  if (c->stream->peer_gone()) return;
  bool waits = false;
  try {
    waits = c->writes.send(*c->stream, encode_message(m, c->shm.get()));
  } catch (const TransportError& e) {
    if (c->stream->peer_gone()) return;
    throw TransportError(fmt::format("cannot reach worker {}: {}", names_.at(peer), e.what()));
  }
  if (waits) flusher_->arm();
}

bool PeerChannel::flush(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (std::size_t peer : open_) {
    Connection& c = *connections_[peer];
    if (!c.stream) continue;
    std::lock_guard lock(c.writes.mu);
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (timeout.count() < 0) left = std::chrono::milliseconds(-1);
    try {
      if (!c.stream->flush_wait(left)) return false;
    } catch (const TransportError&) {
      // The worker is gone: what it was sent goes nowhere (send's rule).
    }
  }
  return true;
}

void PeerChannel::lost(std::size_t peer, std::string reason, std::vector<std::size_t> with) {
  events_.lost(peer, std::move(reason), std::move(with));
}

void PeerChannel::repoint(std::size_t peer, const std::string& endpoint) {
  if (peer >= endpoints_.size()) return;
  endpoints_[peer] = endpoint;
  close(peer);
}

void PeerChannel::wake() { events_.wake(); }

std::optional<ChannelEvent> PeerChannel::read_replies() {
  for (std::size_t i = 0; i < open_.size();) {
    const std::size_t peer = open_[i];
    Connection& c = *connections_[peer];
    std::optional<Frames> frames;
    if (c.socket) {
      frames = recv_frames(*c.socket, 0);
    } else {
      bool read_data = false;
      frames = c.stream->recv(&read_data);
      if (read_data) c.writes.heard();
    }
    if (frames) {
      try {
        ChannelEvent e;
        e.peer = peer;
        e.message = decode_message(std::move(*frames), c.shm.get());
        return e;
      } catch (const TransportError& err) {
        drops_.drop(fmt::format("from worker {}: {}", names_[peer], err.what()));
        continue;  // the same connection again: it may hold more
      }
    }
    if (c.stream && c.stream->closed()) {
      // The worker ended (its loss or replacement comes from the driver), or its stream broke.
      if (!c.stream->error().empty())
        drops_.drop(fmt::format("from worker {}: {}", names_[peer], c.stream->error()));
      close(peer);  // open_[i] is the next one now
      continue;
    }
    ++i;
  }
  return std::nullopt;
}

std::optional<ChannelEvent> PeerChannel::next(std::chrono::milliseconds timeout) {
  const bool forever = timeout.count() < 0;
  const auto deadline = Clock::now() + (forever ? std::chrono::milliseconds(0) : timeout);
  auto next_tick = Clock::now() + tick_interval_;
  for (;;) {
    if (tick_ && Clock::now() >= next_tick) {
      tick_();
      next_tick = Clock::now() + tick_interval_;
    }
    if (auto e = events_.take()) return e;
    // Replies first: every connection that has one.
    if (auto e = read_replies()) return e;
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
    // Sockets). A watched ZeroMQ socket may hold input its descriptor no longer signals (an
    // operation on it processed its commands): it is asked first. The watched sockets' handlers
    // may queue events (a lost worker) or answer requests themselves.
    bool ran = false;
    for (auto& [w, on_ready] : watched_) {
      if (w.socket && (w.socket.get(zmq::sockopt::events) & ZMQ_POLLIN)) {
        on_ready();
        ran = true;
      }
    }
    if (ran) continue;
    fds_.clear();
    for (std::size_t peer : open_) {
      const Connection& c = *connections_[peer];
      fds_.push_back({c.socket ? c.socket->get(zmq::sockopt::fd) : c.stream->in_fd(), POLLIN, 0});
    }
    for (auto& [w, _] : watched_)
      fds_.push_back({w.socket ? w.socket.get(zmq::sockopt::fd) : w.fd, POLLIN, 0});
    fds_.push_back({events_.fd(), POLLIN, 0});
    const std::size_t connections = open_.size();
    int rc;
    while ((rc = ::poll(fds_.data(), fds_.size(), static_cast<int>(left))) < 0 && errno == EINTR) {
    }
    if (rc <= 0) continue;
    if (fds_.back().revents) return events_.signalled();
    for (std::size_t i = 0; i < watched_.size(); ++i) {
      if (fds_[connections + i].revents) watched_[i].second();
    }
  }
}

}  // namespace twinkle::transport
