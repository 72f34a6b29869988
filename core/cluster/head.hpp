#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/cluster/security.hpp"
#include "core/runtime/run_as.hpp"

// The head of a cluster (docs/ARCHITECTURE.md, Remote mode): the node table and the reservations.
// Agents register and heartbeat; drivers reserve, renew their lease, and talk to the agents of
// their run through the head; `twinkle nodes` asks it for the tables. Its node table and
// reservations live in memory only: a restarted head rebuilds them from the agents, which
// re-register with the jobs they run. Its job service (submitted jobs, the queue, history) keeps
// everything in `state_dir` (docs/ARCHITECTURE.md, Job service).
namespace twinkle::core::cluster {

struct HeadOptions {
  std::string bind_host = "127.0.0.1";
  int port = 7100;  // 0: an ephemeral port (tests)
  HeadSecurity security;
  std::function<void(const std::string&)> log;  // one line per event
  // The job service: "" for none (tests of the node table alone).
  std::filesystem::path state_dir;
  int keep_jobs = 10000;
  std::uint64_t job_log_cap = 64ull << 20;
  std::uint64_t max_upload = 5ull << 28;  // bytes of one archive (a client's 1 GiB and headers)
  std::filesystem::path exe;              // the twinkle binary submitted jobs' drivers run
  // Which account each member's submitted jobs run as (--run-as; docs/ARCHITECTURE.md,
  // Isolation): their folders are given to it, their supervisors and drivers become it.
  RunAs run_as;
  // The teams' quotas (docs/ARCHITECTURE.md, Teams and quotas): read at start (a ConfigError
  // with file:line:col when malformed) and again on reload_quotas(); "" for none.
  std::filesystem::path quotas_file;
  // The node id of this machine's own agent ("" with --no-agent): submitted jobs' drivers run
  // here, and each takes one of its CPUs.
  std::string local_node;
  // The web dashboard (docs/ARCHITECTURE.md, Dashboard) on dashboard_host:dashboard_port;
  // dashboard_port < 0: none.
  std::string dashboard_host = "127.0.0.1";
  int dashboard_port = -1;
  double dashboard_link_s = 60;  // how long a login link is good for
  // HTTPS with this certificate and key (PEM); both empty: HTTP, which only loopback may use.
  std::filesystem::path dashboard_tls_cert, dashboard_tls_key;
  std::vector<std::string> dashboard_names;  // more names of the dashboard (--dashboard-name)
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
  // The dashboard's address ("http://127.0.0.1:PORT"), "" without one.
  std::string dashboard_url() const;
  // Serves until `stop` becomes true (checked at least every 250 ms).
  void run(const std::atomic<bool>& stop);
  // From any thread (SIGHUP): the head's thread reads the quotas file again; a malformed one is
  // logged and the quotas stay as they were.
  void reload_quotas();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace twinkle::core::cluster
