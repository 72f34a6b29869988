#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <zmq.hpp>

#include "transports/communicator.hpp"
#include "transports/zmq/auth.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::transport {

// The driver's rendezvous store: a thread that serves kv_set / kv_get messages on its own ROUTER
// socket next to the control socket, so that workers can rendezvous while the driver's own thread
// is busy in plugin code. A get for a key not set yet is answered when the key is set.
class KvServer {
 public:
  // Binds `endpoint` ("tcp://HOST:*" for an ephemeral port; endpoint() tells which), with CURVE
  // when `security` has keys.
  KvServer(zmq::context_t& context, const std::string& endpoint,
           const SocketSecurity& security = {});
  KvServer(const KvServer&) = delete;
  KvServer& operator=(const KvServer&) = delete;
  ~KvServer();  // stops and joins the thread

  const std::string& endpoint() const { return endpoint_; }

  // Keys that start with one of `prefixes` will never be set (their members were replaced): a
  // get waiting for one, or asking for one from now on, is answered with `reason` as its error.
  // Thread-safe.
  void retire(std::vector<std::string> prefixes, std::string reason);

 private:
  void serve(zmq::socket_t& socket);

  std::string endpoint_;
  zmq::context_t& context_;
  std::atomic<bool> stop_{false};
  std::mutex retire_mu_;
  std::vector<std::pair<std::string, std::string>> retiring_;  // prefix, reason (retire_mu_)
  Fd wake_;  // eventfd: the destructor wakes the thread
  std::thread thread_;
};

// A worker's client of the KvServer. Thread-safe (one request at a time).
class KvClient : public KvStore {
 public:
  KvClient(zmq::context_t& context, const std::string& endpoint,
           const SocketSecurity& security = {});
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;

 private:
  std::mutex mu_;
  zmq::socket_t socket_;
  std::uint64_t next_id_ = 0;
};

}  // namespace twinkle::transport
