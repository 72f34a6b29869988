#include "transports/zmq/auth.hpp"

#include <arpa/inet.h>
#include <zmq.h>

#include <cstring>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::transport {

namespace {

// The ZAP domain every Twinkle CURVE server uses: ZeroMQ asks the context's handler only for
// sockets that name one.
constexpr const char* kZapDomain = "twinkle";

std::string z85(const zmq::message_t& key) {
  if (key.size() != 32) return "(malformed key)";
  char text[41] = {};
  zmq_z85_encode(text, static_cast<const std::uint8_t*>(key.data()), 32);
  return text;
}

}  // namespace

void secure_server(zmq::socket_t& socket, const SocketSecurity& security) {
  if (!security.keys) return;
  socket.set(zmq::sockopt::curve_server, 1);
  socket.set(zmq::sockopt::curve_secretkey, security.keys->secret_key);
  socket.set(zmq::sockopt::zap_domain, kZapDomain);
}

void secure_client(zmq::socket_t& socket, const SocketSecurity& security) {
  if (!security.keys) return;
  if (!is_z85_key(security.server_key)) {
    throw TransportError(
        "a CURVE client needs the server's public key (40 Z85 characters); none was given");
  }
  socket.set(zmq::sockopt::curve_serverkey, security.server_key);
  socket.set(zmq::sockopt::curve_publickey, security.keys->public_key);
  socket.set(zmq::sockopt::curve_secretkey, security.keys->secret_key);
}

void set_heartbeats(zmq::socket_t& socket, std::chrono::milliseconds interval,
                    std::chrono::milliseconds timeout) {
  socket.set(zmq::sockopt::heartbeat_ivl, static_cast<int>(interval.count()));
  socket.set(zmq::sockopt::heartbeat_timeout, static_cast<int>(timeout.count()));
  socket.set(zmq::sockopt::heartbeat_ttl, static_cast<int>(timeout.count()));
}

bool is_loopback_host(const std::string& host_in) {
  std::string host = host_in;
  if (host.starts_with("tcp://")) {
    host = host.substr(6);
    if (host.starts_with("[")) {
      host = host.substr(1, host.find(']') - 1);
    } else if (auto c = host.rfind(':'); c != std::string::npos) {
      host = host.substr(0, c);
    }
  }
  if (host == "localhost" || host == "::1") return true;
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) != 1) return false;
  return (ntohl(a.s_addr) >> 24) == 127;
}

// ----- KeyGate ----------------------------------------------------------------------------

std::string user_id(const zmq::message_t& frame) {
  const char* v = zmq_msg_gets(const_cast<zmq_msg_t*>(frame.handle()), "User-Id");
  return v ? v : "";
}

KeyGate::KeyGate(zmq::context_t& context, std::set<std::string> allowed, Log log,
                 std::map<std::string, std::string> names)
    : allowed_(std::move(allowed)),
      names_(std::move(names)),
      log_(std::move(log)),
      socket_(context, zmq::socket_type::rep) {
  socket_.set(zmq::sockopt::linger, 0);
  socket_.bind("inproc://zeromq.zap.01");
  thread_ = std::thread([this] { serve(); });
}

KeyGate::~KeyGate() {
  stop_ = true;
  thread_.join();
}

void KeyGate::allow(const std::string& key, const std::string& name) {
  std::lock_guard lock(mu_);
  allowed_.insert(key);
  if (!name.empty()) names_[key] = name;
}

void KeyGate::revoke(const std::string& key) {
  std::lock_guard lock(mu_);
  allowed_.erase(key);
  names_.erase(key);
}

void KeyGate::serve() {
  while (!stop_) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(100));
    if (!(item.revents & ZMQ_POLLIN)) continue;
    std::vector<zmq::message_t> req;
    if (!zmq::recv_multipart(socket_, std::back_inserter(req), zmq::recv_flags::dontwait)) continue;
    // version, request id, domain, address, routing id, mechanism, credentials...
    if (req.size() < 6) continue;
    const std::string address = req[3].to_string();
    const std::string mechanism = req[5].to_string();
    bool ok = false;
    std::string why, user = "member";
    if (mechanism == "CURVE" && req.size() >= 7) {
      const std::string key = z85(req[6]);
      std::lock_guard lock(mu_);
      ok = allowed_.count(key) > 0;
      if (auto n = names_.find(key); n != names_.end()) user = n->second;
      if (!ok) why = fmt::format("its public key {} is not in the allow-list", key);
    } else {
      why = fmt::format("it offered no key (mechanism {})", mechanism);
    }
    if (!ok && log_) log_(fmt::format("refused a connection from {}: {}", address, why));
    std::vector<zmq::message_t> rep;
    rep.emplace_back(std::string("1.0"));
    rep.emplace_back(req[1].data(), req[1].size());
    rep.emplace_back(std::string(ok ? "200" : "400"));
    rep.emplace_back(std::string(ok ? "OK" : "key not allowed"));
    rep.emplace_back(ok ? user : std::string());
    rep.emplace_back();
    zmq::send_multipart(socket_, rep);
  }
}

// ----- ConnectionWatch --------------------------------------------------------------------

ConnectionWatch::ConnectionWatch(zmq::context_t& context, zmq::socket_t& socket, Handler on_event)
    : socket_(socket.handle()), monitor_(context, zmq::socket_type::pair) {
  const std::string endpoint = fmt::format("inproc://twinkle-watch-{}", fmt::ptr(this));
  if (zmq_socket_monitor(socket.handle(), endpoint.c_str(),
                         ZMQ_EVENT_CONNECTED | ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED |
                             ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                             ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                             ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_MONITOR_STOPPED) !=
      0) {
    throw TransportError(
        fmt::format("cannot watch a socket's connections: {}", zmq_strerror(zmq_errno())));
  }
  monitor_.set(zmq::sockopt::linger, 0);
  monitor_.connect(endpoint);
  thread_ = std::thread([this, on_event = std::move(on_event)] {
    while (!stop_) {
      zmq::pollitem_t item{monitor_.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(100));
      if (!(item.revents & ZMQ_POLLIN)) continue;
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(monitor_, std::back_inserter(frames), zmq::recv_flags::dontwait) ||
          frames.size() < 2 || frames[0].size() < 6) {
        continue;
      }
      std::uint16_t event;
      std::uint32_t value;
      std::memcpy(&event, frames[0].data(), 2);
      std::memcpy(&value, static_cast<const char*>(frames[0].data()) + 2, 4);
      const std::string address = frames[1].to_string();
      switch (event) {
        case ZMQ_EVENT_CONNECTED:
        case ZMQ_EVENT_ACCEPTED: on_event(Event::connected, address, ""); break;
        case ZMQ_EVENT_HANDSHAKE_SUCCEEDED: on_event(Event::handshake_ok, address, ""); break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
          on_event(Event::refused_auth, address, fmt::format("status {}", value));
          break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
          on_event(Event::refused_protocol, address,
                   value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
                       ? "one side uses CURVE keys and the other does not"
                   : value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC
                       ? "the keys do not match (a client pinned another server key)"
                       : fmt::format("ZMTP protocol error 0x{:x}", value));
          break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
          // The value is an errno: the peer hung up during the handshake, which is what a client
          // without keys (or with another server's key) does when it meets a CURVE server.
          on_event(Event::refused_protocol, address,
                   fmt::format("the handshake failed ({}): a peer without keys, or one that "
                               "pinned another server's key",
                               zmq_strerror(static_cast<int>(value))));
          break;
        case ZMQ_EVENT_DISCONNECTED: on_event(Event::disconnected, address, ""); break;
        default: break;
      }
    }
  });
}

ConnectionWatch::~ConnectionWatch() {
  // Stopping the monitor sends MONITOR_STOPPED, which wakes the thread at once to see stop_.
  stop_ = true;
  zmq_socket_monitor(socket_, nullptr, 0);
  thread_.join();
}

// ----- HandshakeCheck ---------------------------------------------------------------------

HandshakeCheck::HandshakeCheck(zmq::context_t& context, zmq::socket_t& socket)
    : watch_(
          context, socket,
          [this](ConnectionWatch::Event e, const std::string&, const std::string& detail) {
            if (e == ConnectionWatch::Event::connected || e == ConnectionWatch::Event::disconnected)
              return;
            std::lock_guard lock(mu_);
            if (first_) return;
            first_ = e;
            detail_ = detail;
            cv_.notify_all();
          }) {}

void HandshakeCheck::wait(std::chrono::milliseconds timeout, const std::string& what,
                          const SocketSecurity& security) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, timeout, [this] { return first_.has_value(); });
  if (first_ == ConnectionWatch::Event::handshake_ok) return;
  if (first_ == ConnectionWatch::Event::refused_auth) {
    throw TransportError(fmt::format(
        "{} refused this member's key ({}): add this member's public key (twinkle.pub) to its "
        "allow-list (authorized_keys)",
        what, detail_));
  }
  if (first_ == ConnectionWatch::Event::refused_protocol) {
    if (!security.secure()) {
      throw TransportError(fmt::format(
          "{} refused the connection: it uses keys and this side has no key; create one with "
          "`twinkle keygen`, put its twinkle.pub in the head's allow-list, and pass the head's "
          "public key with --head-key",
          what));
    }
    throw TransportError(
        fmt::format("{} refused the connection: {}; check that the head's public key given here "
                    "(--head-key) is the head's own",
                    what, detail_));
  }
  throw TransportError(fmt::format(
      "no answer from {} within {} s: is it running and reachable{}?", what,
      std::chrono::duration_cast<std::chrono::seconds>(timeout).count(),
      security.secure() ? ", and is the head key given here (--head-key) the head's own"
                        : "; if it uses keys, this side needs one too (twinkle keygen, --key, "
                          "--head-key)"));
}

}  // namespace twinkle::transport
