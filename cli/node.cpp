#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "cli/cluster_flags.hpp"
#include "cli/commands.hpp"
#include "cli/exit_codes.hpp"
#include "core/cluster/agent.hpp"
#include "core/cluster/head.hpp"
#include "core/cluster/head_link.hpp"
#include "core/cluster/security.hpp"
#include "core/runtime/spawner.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::cli {

namespace {

struct NodeStartOptions {
  bool head = false;
  int port = 7100;
  std::string bind;  // default: every interface with keys, loopback without
  bool no_agent = false;
  ClusterFlags cluster;
  std::string authorized_keys;
  std::optional<int> gpus;
  std::optional<int> cpus;
  std::string labels;
  std::string node_id;
  std::string node_ip;
  std::string cache_dir;
  bool daemon = false;
  std::string pid_file;
  std::string log_file;
};

std::string default_pid_file() { return (core::cluster::twinkle_home() / "node.pid").string(); }

void log_line(const std::string& who, const std::string& line) {
  const std::time_t t = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%H:%M:%S", std::localtime(&t));
  std::fprintf(stderr, "%s twinkle %s: %s\n", stamp, who.c_str(), line.c_str());
  std::fflush(stderr);
}

bool is_wildcard(const std::string& host) { return host == "0.0.0.0" || host == "*"; }

// The first IPv4 address of an interface that is up and not loopback: what a head that listens
// on every interface tells other nodes about its own agent.
std::string first_interface_address() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string out;
  for (ifaddrs* a = list; a && out.empty(); a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if ((ntohl(in->sin_addr.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &in->sin_addr, text, sizeof text);
    out = text;
  }
  freeifaddrs(list);
  return out;
}

// Detaches into the background: the parent returns only once the child says it started (or
// failed), so that `node start --daemon && twinkle nodes` works. Returns in the child, with the
// pipe to write "k" to once serving; a failure before that closes it, and the parent exits 1.
// On a failure the pipe must close only when this process exits, after main logged the error, so
// that the log says why by the time the parent exits: a failing holder releases it, not closes it.
Fd daemonize(const NodeStartOptions& o) {
  int fds[2];
  // Close-on-exec: a worker or srun that the daemon starts before it is ready must not hold the
  // write end, or the parent would wait for it instead of the daemon.
  if (pipe2(fds, O_CLOEXEC) != 0) throw Error("cannot create a pipe to start the daemon");
  Fd from_daemon(fds[0]);
  Fd ready(fds[1]);
  const pid_t pid = fork();
  if (pid < 0) throw Error("cannot fork the daemon");
  if (pid > 0) {
    ready.reset();
    char c = 0;
    const bool ok = read(from_daemon.get(), &c, 1) == 1 && c == 'k';
    std::exit(ok ? kExitOk : kExitJobFailed);
  }
  from_daemon.reset();
  try {
    setsid();
    const std::string log =
        o.log_file.empty() ? (core::cluster::twinkle_home() / "node.log").string() : o.log_file;
    std::filesystem::create_directories(std::filesystem::path(log).parent_path());
    FILE* f = std::freopen(log.c_str(), "a", stderr);
    if (!f) throw ConfigError(fmt::format("--log-file {}: cannot open it", log));
    std::freopen("/dev/null", "r", stdin);
    std::freopen("/dev/null", "w", stdout);
    const std::string pid_file = o.pid_file.empty() ? default_pid_file() : o.pid_file;
    std::filesystem::create_directories(std::filesystem::path(pid_file).parent_path());
    std::ofstream out(pid_file, std::ios::trunc);
    out << getpid() << "\n";
  } catch (...) {
    ready.release();
    throw;
  }
  return ready;
}

int run_node_start(NodeStartOptions o) {
  if (o.head == !o.cluster.address.empty()) {
    throw ConfigError(
        "node start: give either --head (run a cluster head) or --address tcp://HEAD:PORT (join "
        "one as a node)");
  }
  if (!o.head && o.no_agent) throw ConfigError("node start: --no-agent goes with --head");
  // Stop signals go to one waiting thread; every other thread blocks them.
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, s);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  Fd ready;
  if (o.daemon) ready = daemonize(o);

  std::atomic<bool> stop{false};
  std::unique_ptr<core::cluster::Head> head;
  std::thread head_thread;
  std::string address = o.cluster.address;
  auto cleanup = [&] {
    stop = true;
    if (head_thread.joinable()) head_thread.join();
  };
  try {
    if (o.head) {
      core::cluster::KeyOptions keys = o.cluster.keys;
      keys.authorized_keys = o.authorized_keys;
      core::cluster::HeadOptions ho;
      ho.security = core::cluster::head_security(keys, o.bind.empty() ? "127.0.0.1" : o.bind);
      if (o.bind.empty()) o.bind = ho.security.socket.secure() ? "0.0.0.0" : "127.0.0.1";
      ho.bind_host = o.bind;
      ho.port = o.port;
      ho.log = [](const std::string& l) { log_line("head", l); };
      const bool secure = ho.security.socket.secure();
      const std::string head_public = secure ? ho.security.socket.keys->public_key : "";
      head = std::make_unique<core::cluster::Head>(std::move(ho));
      log_line("head", fmt::format("listening on {} ({}); {}", head->endpoint(),
                                   secure ? "CURVE: members need a key in the allow-list"
                                          : "no keys: plaintext",
                                   o.no_agent ? "no agent on this machine (--no-agent)"
                                              : "this machine is a node too"));
      head_thread = std::thread([&] { head->run(stop); });
      const std::string port = head->endpoint().substr(head->endpoint().rfind(':') + 1);
      address = fmt::format("tcp://{}:{}", is_wildcard(o.bind) ? "127.0.0.1" : o.bind, port);
      if (o.node_ip.empty() && is_wildcard(o.bind)) o.node_ip = first_interface_address();
      // The head's own agent uses the head's key, which the head admits.
      if (secure) o.cluster.keys.head_key = head_public;
    }
    std::unique_ptr<core::cluster::Agent> agent;
    if (!o.no_agent) {
      core::cluster::AgentOptions ao;
      ao.address = address;
      ao.security = core::cluster::member_security(o.cluster.keys, address);
      ao.node_id = o.node_id;
      ao.gpus = o.gpus;
      ao.cpus = o.cpus;
      ao.labels = core::cluster::parse_labels(o.labels, "--labels");
      ao.node_ip = o.node_ip;
      ao.cache_dir = o.cache_dir.empty() ? core::cluster::twinkle_home() / "plugins"
                                         : std::filesystem::path(o.cache_dir);
      ao.exe = core::twinkle_binary();
      ao.log = [](const std::string& l) { log_line("agent", l); };
      agent = std::make_unique<core::cluster::Agent>(std::move(ao));
    }
    if (ready) {
      (void)!write(ready.get(), "k", 1);
      ready.reset();
    }
    int sig = 0;
    sigwait(&set, &sig);
    log_line(o.head ? "head" : "agent", fmt::format("stopping ({}){}",
                                                    sig == SIGTERM  ? "SIGTERM"
                                                    : sig == SIGINT ? "SIGINT"
                                                                    : "SIGHUP",
                                                    agent ? "; stopping this node's workers" : ""));
    agent.reset();
    cleanup();
  } catch (...) {
    cleanup();
    ready.release();  // see daemonize
    if (o.daemon) {
      std::error_code ec;
      std::filesystem::remove(o.pid_file.empty() ? default_pid_file() : o.pid_file, ec);
    }
    throw;
  }
  if (o.daemon) {
    std::error_code ec;
    std::filesystem::remove(o.pid_file.empty() ? default_pid_file() : o.pid_file, ec);
  }
  return kExitOk;
}

struct NodeStopOptions {
  std::string pid_file;
  double timeout_s = 15;
};

int run_node_stop(const NodeStopOptions& o) {
  const std::string file = o.pid_file.empty() ? default_pid_file() : o.pid_file;
  std::ifstream in(file);
  long pid = 0;
  if (!(in >> pid) || pid <= 1) {
    throw ConfigError(fmt::format(
        "{}: no pid file of a node started with --daemon (a node in the foreground stops with "
        "Ctrl-C or SIGTERM); pass --pid-file",
        file));
  }
  Fd fd(static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0)));
  if (!fd) {
    std::error_code ec;
    std::filesystem::remove(file, ec);
    fmt::print(stderr, "twinkle: node (pid {}) is not running; removed {}\n", pid, file);
    return kExitOk;
  }
  if (kill(static_cast<pid_t>(pid), SIGTERM) != 0) {
    throw Error(fmt::format("cannot signal the node (pid {}): {}", pid, std::strerror(errno)));
  }
  pollfd p{fd.get(), POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(o.timeout_s * 1000)) <= 0) {
    throw Error(
        fmt::format("the node (pid {}) did not stop within {:g} s of SIGTERM", pid, o.timeout_s));
  }
  fmt::print("twinkle: stopped the node (pid {})\n", pid);
  return kExitOk;
}

}  // namespace

void setup_node(CLI::App& app, Action& action) {
  auto* node = app.add_subcommand("node", "Run a cluster head or a node agent (remote mode)");
  node->require_subcommand(1);

  auto o = std::make_shared<NodeStartOptions>();
  auto* start = node->add_subcommand(
      "start", "Start a head (--head) or join a cluster as a node (--address); foreground");
  start->add_flag("--head", o->head, "Run the cluster's head (this machine is a node too)");
  start->add_option("--port", o->port, "The head's TCP port")->check(CLI::Range(0, 65535));
  start->add_option("--bind", o->bind,
                    "The address the head listens on (default: 0.0.0.0 with keys, 127.0.0.1 "
                    "without; beyond loopback keys are needed)");
  start->add_flag("--no-agent", o->no_agent, "Keep the head's machine out of the cluster's nodes");
  add_cluster_flags(start, o->cluster);
  start->add_option("--authorized-keys", o->authorized_keys,
                    "The head's allow-list of members' public keys (default: "
                    "TWINKLE_AUTHORIZED_KEYS, else ~/.twinkle/authorized_keys)");
  start->add_option("--gpus", o->gpus, "GPUs this node offers (default: those found)")
      ->check(CLI::Range(0, 1 << 16));
  start->add_option("--cpus", o->cpus, "CPUs this node offers (default: those found)")
      ->check(CLI::Range(1, 1 << 20));
  start->add_option("--labels", o->labels, "Labels groups may select: k=v,k2=v2");
  start->add_option("--node-id", o->node_id, "This node's id (default: the host name)");
  start->add_option("--node-ip", o->node_ip,
                    "The address other nodes and drivers reach this node on (default: the "
                    "source address of the route to the head)");
  start->add_option("--cache-dir", o->cache_dir,
                    "Where plugins are kept by sha256 (default ~/.twinkle/plugins)");
  start->add_flag("--daemon", o->daemon, "Run in the background (see --pid-file, --log-file)");
  start->add_option("--pid-file", o->pid_file, "With --daemon (default ~/.twinkle/node.pid)");
  start->add_option("--log-file", o->log_file, "With --daemon (default ~/.twinkle/node.log)");
  start->callback([o, &action] { action = [o] { return run_node_start(*o); }; });

  auto so = std::make_shared<NodeStopOptions>();
  auto* stop = node->add_subcommand("stop", "Stop a node started with --daemon");
  stop->add_option("--pid-file", so->pid_file, "Its pid file (default ~/.twinkle/node.pid)");
  stop->add_option("--timeout", so->timeout_s, "Seconds to wait for it to stop")
      ->check(CLI::Range(0.1, 3600.0));
  stop->callback([so, &action] { action = [so] { return run_node_stop(*so); }; });
}

}  // namespace twinkle::cli
