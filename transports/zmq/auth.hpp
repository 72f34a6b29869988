#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "transports/zmq/curve.hpp"

// How TCP sockets authenticate (docs/ARCHITECTURE.md, Security): CurveZMQ servers that admit only
// allow-listed public keys, clients that pin the server's public key, and the checks that turn a
// refused handshake into a message that names the fix.
namespace twinkle::transport {

// Every TCP connection of a cluster sends a heartbeat this often, and a peer silent for
// kHeartbeatTimeout is disconnected (docs/ARCHITECTURE.md, Liveness).
inline constexpr std::chrono::milliseconds kHeartbeatInterval{500};
inline constexpr std::chrono::milliseconds kHeartbeatTimeout{3000};

// One socket's side of CURVE: with `keys` the socket encrypts and authenticates; without, it is
// plaintext (only allowed on loopback). A client also needs the server's public key.
struct SocketSecurity {
  std::optional<KeyPair> keys;
  std::string server_key;  // clients: the server's public key (Z85)

  bool secure() const { return keys.has_value(); }
};

// Makes `socket` a CURVE server (before bind) or a CURVE client (before connect); plaintext
// security leaves it as it is.
void secure_server(zmq::socket_t& socket, const SocketSecurity& security);
void secure_client(zmq::socket_t& socket, const SocketSecurity& security);

// Heartbeats on a TCP connection: a peer silent for `timeout` is disconnected, even when the
// network drops packets without a word.
void set_heartbeats(zmq::socket_t& socket, std::chrono::milliseconds interval,
                    std::chrono::milliseconds timeout);

// True for tcp://127.x.x.x, tcp://localhost and tcp://[::1] endpoints and bind addresses.
bool is_loopback_host(const std::string& host);

// The "User-Id" a KeyGate gave the connection `frame` came on; "" when none (plaintext).
std::string user_id(const zmq::message_t& frame);

// The ZeroMQ authentication handler (ZAP) of one context: CURVE server sockets of `context` admit
// a client only when its public key is allowed. Every refusal is logged through `log` with the
// peer's address. Create it before any server socket of the context binds. A connection admitted
// with a key in `names` carries that name as its messages' "User-Id" property; others "member".
class KeyGate {
 public:
  using Log = std::function<void(const std::string&)>;
  KeyGate(zmq::context_t& context, std::set<std::string> allowed, Log log,
          std::map<std::string, std::string> names = {});
  KeyGate(const KeyGate&) = delete;
  KeyGate& operator=(const KeyGate&) = delete;
  ~KeyGate();

  // Admits `key` from now on (its connections named `name`, when given). Thread-safe.
  void allow(const std::string& key, const std::string& name = "");
  // Admits `key` no more; a connection it has stays. Thread-safe.
  void revoke(const std::string& key);

 private:
  void serve();

  std::mutex mu_;
  std::set<std::string> allowed_;
  std::map<std::string, std::string> names_;
  Log log_;
  zmq::socket_t socket_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Watches one socket's connections through a ZeroMQ monitor, on a thread of its own. Attach it
// before the socket binds or connects.
class ConnectionWatch {
 public:
  enum class Event { connected, handshake_ok, refused_auth, refused_protocol, disconnected };
  // `on_event` runs on the watch's thread with the event, the peer's address (when known) and a
  // detail.
  using Handler = std::function<void(Event, const std::string& address, const std::string&)>;
  ConnectionWatch(zmq::context_t& context, zmq::socket_t& socket, Handler on_event);
  ConnectionWatch(const ConnectionWatch&) = delete;
  ConnectionWatch& operator=(const ConnectionWatch&) = delete;
  // Stops the socket's monitor too: libzmq blocks a socket whose monitor events nobody reads.
  // Destroy it on the socket's thread, before the socket.
  ~ConnectionWatch();

 private:
  void* socket_;
  zmq::socket_t monitor_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Waits up to `timeout` for the first handshake of `socket` (watched from before its connect)
// and throws TransportError naming the fix when the server refused it or never answered.
// `what` names the server ("the head at tcp://10.0.0.1:7100").
class HandshakeCheck {
 public:
  HandshakeCheck(zmq::context_t& context, zmq::socket_t& socket);
  void wait(std::chrono::milliseconds timeout, const std::string& what,
            const SocketSecurity& security);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<ConnectionWatch::Event> first_;
  std::string detail_;
  ConnectionWatch watch_;
};

}  // namespace twinkle::transport
