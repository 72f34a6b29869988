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
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/cluster_flags.hpp"
#include "cli/commands.hpp"
#include "cli/exit_codes.hpp"
#include "core/cluster/agent.hpp"
#include "core/cluster/head.hpp"
#include "core/cluster/head_link.hpp"
#include "core/cluster/security.hpp"
#include "core/job/resources.hpp"
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
  std::string state_dir;
  int keep_jobs = 10000;
  int job_log_mb = 64;
  std::string dashboard;  // [ADDR:]PORT
  std::string tls_cert, tls_key;
  std::vector<std::string> dashboard_names;
  std::string quotas;  // the teams' quotas file
  std::string run_as;  // member=account,... or auto
};

// --dashboard [ADDR:]PORT: ADDR defaults to 127.0.0.1; any other address only over TLS.
std::pair<std::string, int> dashboard_address(const std::string& text, bool tls) {
  const auto colon = text.rfind(':');
  std::string host = colon == std::string::npos ? "127.0.0.1" : text.substr(0, colon);
  const std::string port = colon == std::string::npos ? text : text.substr(colon + 1);
  if (host == "localhost") host = "127.0.0.1";
  char* end = nullptr;
  const long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || p < 0 || p > 65535) {
    throw ConfigError(fmt::format(
        "--dashboard {}: not [ADDR:]PORT (e.g. --dashboard 8265, or 0 for any free port)", text));
  }
  if (host.empty()) host = "0.0.0.0";
  if (host != "127.0.0.1" && !tls) {
    throw ConfigError(fmt::format(
        "--dashboard {}: without TLS the dashboard serves loopback only (127.0.0.1); give "
        "--tls-cert FILE --tls-key FILE to serve it on {} over HTTPS, or reach it from elsewhere "
        "through SSH: ssh -L {}:127.0.0.1:{} HEAD",
        text, host, p == 0 ? 8265 : p, p == 0 ? 8265 : p));
  }
  return {host, static_cast<int>(p)};
}

std::string default_pid_file() { return (core::cluster::twinkle_home() / "node.pid").string(); }

// Where a node in the foreground says it runs, so that `twinkle node stop` finds it too.
std::filesystem::path foreground_pid_file(pid_t pid) {
  return core::cluster::twinkle_home() / "nodes" / fmt::format("{}.pid", pid);
}

void log_line(const std::string& who, const std::string& line) {
  const std::time_t t = std::time(nullptr);
  char stamp[32];
  std::tm tm{};
  localtime_r(&t, &tm);  // the head's, the agent's and the dashboard's threads all log
  std::strftime(stamp, sizeof stamp, "%H:%M:%S", &tm);
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
  if (!o.head && !o.quotas.empty()) throw ConfigError("node start: --quotas goes with --head");
  const core::RunAs run_as = core::RunAs::parse(o.run_as);
  if (run_as.enabled() && geteuid() != 0) {
    throw ConfigError(
        "--run-as: this node must run as root to start jobs as other accounts; start it as root, "
        "or without --run-as (then every job runs as this account)");
  }
  // Stop signals go to one waiting thread; every other thread blocks them.
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, s);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  Fd ready;
  if (o.daemon) ready = daemonize(o);
  std::filesystem::path own_pid_file;
  if (!o.daemon) {
    own_pid_file = foreground_pid_file(getpid());
    std::error_code ec;
    std::filesystem::create_directories(own_pid_file.parent_path(), ec);
    std::ofstream(own_pid_file, std::ios::trunc) << getpid() << "\n";
  }
  struct RemoveOnExit {
    std::filesystem::path file;
    ~RemoveOnExit() {
      std::error_code ec;
      if (!file.empty()) std::filesystem::remove(file, ec);
    }
  } remove_own{own_pid_file};

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
      ho.state_dir = o.state_dir.empty() ? core::cluster::twinkle_home() / "head"
                                         : std::filesystem::path(o.state_dir);
      ho.keep_jobs = o.keep_jobs;
      ho.job_log_cap = static_cast<std::uint64_t>(o.job_log_mb) << 20;
      ho.exe = core::twinkle_binary();
      ho.run_as = run_as;
      if (run_as.enabled() && !ho.security.socket.secure()) {
        throw ConfigError(
            "--run-as needs a cluster with keys: without them the head cannot know who a driver "
            "is, and anyone could claim to be any member; give the head a key and an allow-list "
            "(twinkle keygen)");
      }
      if (!o.quotas.empty()) ho.quotas_file = std::filesystem::absolute(o.quotas);
      if (o.dashboard.empty() &&
          (!o.tls_cert.empty() || !o.tls_key.empty() || !o.dashboard_names.empty()))
        throw ConfigError(
            "--tls-cert, --tls-key and --dashboard-name are the dashboard's: give --dashboard "
            "too");
      if (!o.dashboard.empty()) {
        if (o.tls_cert.empty() != o.tls_key.empty())
          throw ConfigError("--tls-cert and --tls-key go together: give both, or neither");
        std::tie(ho.dashboard_host, ho.dashboard_port) =
            dashboard_address(o.dashboard, !o.tls_cert.empty());
        if (!o.tls_cert.empty()) {
          ho.dashboard_tls_cert = std::filesystem::absolute(o.tls_cert);
          ho.dashboard_tls_key = std::filesystem::absolute(o.tls_key);
        }
        for (const auto& n : o.dashboard_names) {
          if (n.empty() || n.find_first_of(":/ ") != std::string::npos)
            throw ConfigError(fmt::format(
                "--dashboard-name \"{}\": a host name (the certificate's, e.g. head.example.org), "
                "without a port",
                n));
        }
        ho.dashboard_names = o.dashboard_names;
        if (const char* t = std::getenv("TWINKLE_TEST_DASHBOARD_LINK_S"))
          ho.dashboard_link_s = std::atof(t);
      }
      if (!o.no_agent) {
        // The head's own agent, by the id it will register with (the host name by default).
        if (o.node_id.empty()) o.node_id = core::discover_local().hostname;
        ho.local_node = o.node_id;
      }
      const bool secure = ho.security.socket.secure();
      const std::string head_public = secure ? ho.security.socket.keys->public_key : "";
      head = std::make_unique<core::cluster::Head>(std::move(ho));
      log_line("head", fmt::format("listening on {} ({}); {}", head->endpoint(),
                                   secure ? "CURVE: members need a key in the allow-list"
                                          : "no keys: plaintext",
                                   o.no_agent ? "no agent on this machine (--no-agent)"
                                              : "this machine is a node too"));
      if (!head->dashboard_url().empty()) {
        log_line("head", fmt::format("dashboard on {}/ (log in with `twinkle dashboard`)",
                                     head->dashboard_url()));
      }
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
      ao.worker_exe = core::worker_binary(ao.exe);
      ao.run_as = run_as;
      ao.log = [](const std::string& l) { log_line("agent", l); };
      agent = std::make_unique<core::cluster::Agent>(std::move(ao));
    }
    if (ready) {
      (void)!write(ready.get(), "k", 1);
      ready.reset();
    }
    int sig = 0;
    sigwait(&set, &sig);
    // A head with a quotas file reads it again on SIGHUP (and goes on); other nodes stop.
    while (sig == SIGHUP && head && !o.quotas.empty()) {
      log_line("head", fmt::format("SIGHUP: reading the quotas file {} again", o.quotas));
      head->reload_quotas();
      sigwait(&set, &sig);
    }
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

// True when `pid` runs `twinkle node start` (and not some process that took its pid since).
bool is_node_process(long pid) {
  std::ifstream in(fmt::format("/proc/{}/cmdline", pid), std::ios::binary);
  std::string cmd((std::istreambuf_iterator<char>(in)), {});
  return cmd.find(std::string("node\0start", 10)) != std::string::npos;
}

// Stops the node of `file` (SIGTERM, then waits); false when none runs there (the file is
// removed then).
bool stop_node(const std::string& file, double timeout_s) {
  std::ifstream in(file);
  long pid = 0;
  if (!(in >> pid) || pid <= 1) return false;
  Fd fd = open_pidfd(static_cast<pid_t>(pid));
  if (!fd || !is_node_process(pid)) {
    std::error_code ec;
    std::filesystem::remove(file, ec);
    return false;
  }
  if (kill(static_cast<pid_t>(pid), SIGTERM) != 0) {
    throw Error(fmt::format("cannot signal the node (pid {}): {}", pid, std::strerror(errno)));
  }
  pollfd p{fd.get(), POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(timeout_s * 1000)) <= 0) {
    throw Error(
        fmt::format("the node (pid {}) did not stop within {:g} s of SIGTERM", pid, timeout_s));
  }
  fmt::print("twinkle: stopped the node (pid {})\n", pid);
  return true;
}

int run_node_stop(const NodeStopOptions& o) {
  if (!o.pid_file.empty()) {
    std::ifstream in(o.pid_file);
    long pid = 0;
    if (!(in >> pid) || pid <= 1) {
      throw ConfigError(fmt::format(
          "{}: no pid file of a node started with --daemon; without --pid-file, `twinkle node "
          "stop` stops every node of this user on this machine",
          o.pid_file));
    }
    if (!stop_node(o.pid_file, o.timeout_s)) {
      fmt::print(stderr, "twinkle: node (pid {}) is not running; removed {}\n", pid, o.pid_file);
    }
    return kExitOk;
  }
  // Every node of this user here, in the background (node.pid) or in the foreground (nodes/).
  std::vector<std::string> files = {default_pid_file()};
  std::error_code ec;
  for (const auto& e :
       std::filesystem::directory_iterator(core::cluster::twinkle_home() / "nodes", ec)) {
    if (e.path().extension() == ".pid") files.push_back(e.path().string());
  }
  int stopped = 0;
  std::vector<std::string> failed;  // each node is tried, whatever another did
  for (const auto& f : files) {
    try {
      stopped += stop_node(f, o.timeout_s) ? 1 : 0;
    } catch (const Error& e) {
      failed.push_back(e.what());
    }
  }
  if (!failed.empty()) throw Error(fmt::format("{}", fmt::join(failed, "; ")));
  if (stopped == 0) {
    throw ConfigError(fmt::format(
        "no node of this user runs on this machine (none in {} or {}/); a node started by "
        "another user or with another TWINKLE_HOME is stopped by that user, or with --pid-file",
        default_pid_file(), (core::cluster::twinkle_home() / "nodes").string()));
  }
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
  start->add_option("--state-dir", o->state_dir,
                    "With --head: where the job service keeps its history, uploads and jobs' "
                    "folders (default ~/.twinkle/head)");
  start
      ->add_option("--keep-jobs", o->keep_jobs,
                   "With --head: ended jobs kept in the history (default 10000)")
      ->check(CLI::Range(1, 10000000));
  start
      ->add_option("--job-log-mb", o->job_log_mb,
                   "With --head: MiB of log kept per submitted job, rotated (default 64)")
      ->check(CLI::Range(1, 1 << 20));
  start->add_option("--dashboard", o->dashboard,
                    "With --head: serve the web dashboard on [ADDR:]PORT (127.0.0.1 unless "
                    "--tls-cert and --tls-key; log in with `twinkle dashboard`)");
  start->add_option("--tls-cert", o->tls_cert,
                    "With --dashboard: serve HTTPS with this certificate (PEM; with --tls-key)");
  start->add_option("--tls-key", o->tls_key,
                    "With --dashboard: the certificate's private key (PEM)");
  start->add_option("--dashboard-name", o->dashboard_names,
                    "With --dashboard: another name browsers reach it by (the certificate's, e.g. "
                    "an FQDN; repeatable); the first is the login links'");
  start->add_option("--quotas", o->quotas,
                    "With --head: the teams' quotas, borrowing limits and fair-share weights "
                    "(TOML, twinkle-quotas(1)); read again on SIGHUP and `twinkle quotas reload`");
  start->add_option("--run-as", o->run_as,
                    "As root: run each member's workers (and, on the head, its submitted jobs' "
                    "drivers) as a Unix account: alice=alice,bob=tw-bob, or auto (the account of "
                    "the member's name); needs keys");
  start->add_flag("--daemon", o->daemon, "Run in the background (see --pid-file, --log-file)");
  start->add_option("--pid-file", o->pid_file, "With --daemon (default ~/.twinkle/node.pid)");
  start->add_option("--log-file", o->log_file, "With --daemon (default ~/.twinkle/node.log)");
  start->callback([o, &action] { action = [o] { return run_node_start(*o); }; });

  auto so = std::make_shared<NodeStopOptions>();
  auto* stop = node->add_subcommand(
      "stop", "Stop this machine's nodes (heads and agents, --daemon or in the foreground)");
  stop->add_option("--pid-file", so->pid_file,
                   "Only the node of this pid file (default: every node of this user here)");
  stop->add_option("--timeout", so->timeout_s, "Seconds to wait for it to stop")
      ->check(CLI::Range(0.1, 3600.0));
  stop->callback([so, &action] { action = [so] { return run_node_stop(*so); }; });
}

}  // namespace twinkle::cli
