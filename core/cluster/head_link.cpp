#include "core/cluster/head_link.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core::cluster {

std::string endpoint_host(const std::string& endpoint) {
  std::string h = endpoint.starts_with("tcp://") ? endpoint.substr(6) : endpoint;
  if (h.starts_with("[")) return h.substr(1, h.find(']') - 1);
  if (auto c = h.rfind(':'); c != std::string::npos) h = h.substr(0, c);
  return h;
}

std::string route_source_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res) {
    throw TransportError(fmt::format("cannot resolve {}: is the head's address right?", host));
  }
  Fd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  // Connecting a UDP socket sends nothing: it only picks the route, and with it the source.
  const int rc = fd ? ::connect(fd.get(), res->ai_addr, res->ai_addrlen) : -1;
  freeaddrinfo(res);
  sockaddr_in local{};
  socklen_t len = sizeof local;
  if (rc != 0 || ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) {
    throw TransportError(fmt::format("no route to {}: {}", host, std::strerror(errno)));
  }
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &local.sin_addr, text, sizeof text);
  return text;
}

HeadLink::HeadLink(const std::string& address, const transport::SocketSecurity& security,
                   const std::string& identity, std::chrono::milliseconds handshake)
    : address_(address), socket_(context_, zmq::socket_type::dealer) {
  socket_.set(zmq::sockopt::linger, 0);
  socket_.set(zmq::sockopt::routing_id, identity);
  // While the head is away, messages queue up to this many, then new ones are dropped.
  socket_.set(zmq::sockopt::sndhwm, 10000);
  socket_.set(zmq::sockopt::rcvhwm, 0);
  socket_.set(zmq::sockopt::reconnect_ivl, 100);
  socket_.set(zmq::sockopt::reconnect_ivl_max, 1000);
  transport::secure_client(socket_, security);
  transport::set_heartbeats(socket_, transport::kHeartbeatInterval, transport::kHeartbeatTimeout);
  wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_)
    throw TransportError(fmt::format("cannot create an eventfd: {}", std::strerror(errno)));
  {
    transport::HandshakeCheck check(context_, socket_);
    try {
      socket_.connect(address);
    } catch (const zmq::error_t& e) {
      throw TransportError(fmt::format("{}: not an address to connect to ({}); use tcp://HOST:PORT",
                                       address, e.what()));
    }
    check.wait(handshake, fmt::format("the head at {}", address), security);
  }
}

HeadLink::~HeadLink() { stop(std::chrono::milliseconds(0)); }

Message HeadLink::request(const Message& m, MsgType expect, std::chrono::milliseconds timeout) {
  auto failed = [&] {
    return TransportError(fmt::format(
        "the head at {} did not answer a {} within {} s", address_, transport::to_string(m.type()),
        std::chrono::duration_cast<std::chrono::seconds>(timeout).count()));
  };
  if (thread_.joinable()) {
    // The link's thread owns the socket: the answer comes through it.
    if (m.id == 0) throw TransportError("a request to the head after start() needs an id");
    std::future<Message> answer;
    {
      std::lock_guard lock(mu_);
      Waiting& w = waiting_[m.id];
      w.expect = expect;
      answer = w.answer.get_future();
    }
    post(m);
    if (answer.wait_for(timeout) == std::future_status::ready) return answer.get();
    std::lock_guard lock(mu_);
    waiting_.erase(m.id);
    throw failed();
  }
  transport::send_message(socket_, m);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    std::optional<Message> r;
    try {
      auto frames = transport::recv_frames(socket_, static_cast<int>(left.count()));
      if (!frames) continue;
      r = transport::decode_cluster_message(std::move(*frames));
    } catch (const TransportError& e) {
      drops_.drop(e.what());
      continue;
    }
    if (r->type() == expect && (m.id == 0 || r->id == m.id)) return std::move(*r);
  }
  throw failed();
}

bool HeadLink::answered(Message& m) {
  if (m.id == 0) return false;
  std::lock_guard lock(mu_);
  auto it = waiting_.find(m.id);
  if (it == waiting_.end() || it->second.expect != m.type()) return false;
  it->second.answer.set_value(std::move(m));
  waiting_.erase(it);
  return true;
}

void HeadLink::start(Handler on_message, Beat beat) {
  on_message_ = std::move(on_message);
  beat_ = std::move(beat);
  thread_ = std::thread([this] { loop(); });
}

void HeadLink::post(Message m) {
  {
    std::lock_guard lock(mu_);
    outbox_.push_back(std::move(m));
  }
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void HeadLink::flush_outbox() {
  std::deque<Message> out;
  {
    std::lock_guard lock(mu_);
    out.swap(outbox_);
  }
  for (const auto& m : out) {
    try {
      // Never blocks: when the head is away and the queue is full the message is dropped (an
      // output line, a heartbeat), never the thread.
      auto frames = transport::encode_message(m);
      for (std::size_t i = 0; i < frames.size(); ++i) {
        auto flags = zmq::send_flags::dontwait;
        if (i + 1 < frames.size()) flags = flags | zmq::send_flags::sndmore;
        if (!socket_.send(frames[i], flags)) break;
      }
    } catch (const zmq::error_t&) {
    }
  }
}

void HeadLink::loop() {
  using Clock = std::chrono::steady_clock;
  auto next_beat = Clock::now();
  while (!stop_) {
    if (Clock::now() >= next_beat) {
      if (beat_) {
        if (auto b = beat_()) post(std::move(*b));
      }
      next_beat = Clock::now() + transport::kHeartbeatInterval;
    }
    flush_outbox();
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(next_beat - Clock::now());
    zmq::pollitem_t items[2] = {{socket_.handle(), 0, ZMQ_POLLIN, 0},
                                {nullptr, wake_.get(), ZMQ_POLLIN, 0}};
    zmq::poll(items, 2, std::max(left, std::chrono::milliseconds(0)));
    if (items[1].revents & ZMQ_POLLIN) {
      std::uint64_t n;
      (void)!::read(wake_.get(), &n, sizeof n);
    }
    for (;;) {
      std::optional<Message> m;
      try {
        auto frames = transport::recv_frames(socket_, 0);
        if (!frames) break;
        m = transport::decode_cluster_message(std::move(*frames));
      } catch (const TransportError& e) {
        drops_.drop(e.what());
        continue;
      }
      if (answered(*m)) continue;
      if (on_message_) on_message_(*m);
    }
  }
  flush_outbox();
}

void HeadLink::stop(std::chrono::milliseconds linger) {
  if (thread_.joinable()) {
    stop_ = true;
    const std::uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
    thread_.join();
  } else {
    flush_outbox();
  }
  socket_.set(zmq::sockopt::linger, static_cast<int>(linger.count()));
}

std::string HeadLink::local_address() const {
  return route_source_address(endpoint_host(address_));
}

}  // namespace twinkle::core::cluster
