#pragma once

#include <atomic>
#include <functional>
#include <string>

#include "core/cluster/security.hpp"

// The head of a cluster (docs/ARCHITECTURE.md, Remote mode): the node table and the reservations.
// Agents register and heartbeat; drivers reserve, renew their lease, and talk to the agents of
// their run through the head; `twinkle nodes` asks it for the tables. It keeps no state on disk: a
// restarted head rebuilds its tables from the agents, which re-register with the jobs they run.
namespace twinkle::core::cluster {

struct HeadOptions {
  std::string bind_host = "127.0.0.1";
  int port = 7100;  // 0: an ephemeral port (tests)
  HeadSecurity security;
  std::function<void(const std::string&)> log;  // one line per event
};

class Head {
 public:
  // Binds tcp://bind_host:port; throws TransportError naming the address when it cannot.
  explicit Head(HeadOptions options);
  Head(const Head&) = delete;
  Head& operator=(const Head&) = delete;
  ~Head();

  // The address members connect to (the bound one, with the actual port).
  const std::string& endpoint() const;
  // Serves until `stop` becomes true (checked at least every 250 ms).
  void run(const std::atomic<bool>& stop);

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace twinkle::core::cluster
