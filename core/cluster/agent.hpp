#pragma once

#include <atomic>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "core/runtime/run_as.hpp"
#include "transports/zmq/auth.hpp"

// A node agent (docs/ARCHITECTURE.md, Remote mode): registers this machine with the head,
// heartbeats, starts and stops a run's workers when its driver asks (with the same process spawner
// as local mode), relays their output lines and exits to the driver, keeps plugins by sha256 (no
// shared file system needed), and stops a run's workers when the head says its driver is gone.
namespace twinkle::core::cluster {

struct AgentOptions {
  std::string address;  // the head: tcp://HOST:PORT
  transport::SocketSecurity security;
  std::string node_id;                        // default: the host name
  std::optional<int> gpus;                    // declared GPUs (default: discovered)
  std::optional<int> cpus;                    // declared CPUs (default: this process's)
  std::map<std::string, std::string> labels;  // what groups may select
  std::string node_ip;               // the address peers reach this node on (default: the route's
                                     // source address towards the head)
  std::filesystem::path cache_dir;   // plugins by sha256
  std::filesystem::path exe;         // the twinkle binary that runs supervised drivers
  std::filesystem::path worker_exe;  // the worker binary (worker_binary())
  // Which account each member's workers run as (docs/ARCHITECTURE.md, Isolation); it needs root
  // and a cluster with keys. Each account gets its own copy of its plugins in
  // cache_dir/accounts/ACCOUNT. Not enabled: every worker runs as this process.
  RunAs run_as;
  std::function<void(const std::string&)> log;
};

class Agent {
 public:
  // Connects to the head and registers; throws ConfigError / TransportError when the head
  // refuses or does not answer, and ConfigError when --run-as cannot be honoured (not root, no
  // keys, a cache folder the accounts cannot reach).
  explicit Agent(AgentOptions options);
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;
  ~Agent();  // stops every worker it started

  // Serves until `stop` becomes true.
  void run(const std::atomic<bool>& stop);

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// "k=v,k2=v2" -> {k: v, k2: v2}; throws ConfigError naming `flag` for a malformed entry.
std::map<std::string, std::string> parse_labels(const std::string& text, const std::string& flag);

}  // namespace twinkle::core::cluster
