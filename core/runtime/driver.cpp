#include "core/runtime/driver.hpp"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zmq.hpp>

#include "core/job/placement.hpp"
#include "core/job/size.hpp"
#include "core/job/topology.hpp"
#include "core/job/values.hpp"
#include "core/runtime/call_table.hpp"
#include "core/runtime/checkpoint.hpp"
#include "core/runtime/communicators.hpp"
#include "core/runtime/cross_comms.hpp"
#include "core/runtime/failure_report.hpp"
#include "core/runtime/heap_pages.hpp"
#include "core/runtime/host_abi.hpp"
#include "core/runtime/launcher.hpp"
#include "core/runtime/notify.hpp"
#include "core/runtime/run_checkpoints.hpp"
#include "core/runtime/run_dir.hpp"
#include "core/runtime/run_restarts.hpp"
#include "core/runtime/stop_signals.hpp"
#include "core/runtime/worker_env.hpp"
#include "plugins/loader.hpp"
#include "transports/zmq/auth.hpp"
#include "transports/zmq/channel.hpp"
#include "transports/zmq/curve.hpp"
#include "transports/zmq/kv.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

extern char** environ;

namespace twinkle::core {

namespace {

using transport::Message;
namespace proto = transport::proto;

// How long workers have to say hello, and to exit after an orderly shutdown.
constexpr auto kStartTimeout = std::chrono::seconds(60);
constexpr auto kShutdownGrace = std::chrono::seconds(2);
// How long an interrupted driver entry has to return before the driver stops waiting for it.
constexpr auto kInterruptGrace = std::chrono::seconds(2);

std::string make_run_id() {
  std::random_device rd;
  return fmt::format("{:08x}", rd());
}

// A free TCP port on loopback for each group's MASTER_PORT; the sockets stay open until all are
// chosen so that the ports are distinct.
std::vector<int> free_ports(std::size_t n) {
  std::vector<Fd> fds;
  std::vector<int> ports;
  for (std::size_t i = 0; i < n; ++i) {
    Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (!fd || ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      throw Error("cannot find a free port on 127.0.0.1 for MASTER_PORT");
    }
    ports.push_back(ntohs(a.sin_port));
    fds.push_back(std::move(fd));
  }
  return ports;
}

class JobRun : public HostOps {
 public:
  explicit JobRun(const RunOptions& o) : options_(o) {}
  // The stop signals stay blocked: a second Ctrl-C while `twinkle` exits must not turn a clean
  // exit code into a death by signal.
  ~JobRun() override { signals_.stop(); }

  // run(), and the cluster (remote mode) hears how it ended, for its history.
  RunResult run_and_tell() {
    try {
      const RunResult r = run();
      if (site_) {
        site_->ended(r.outcome == RunResult::Outcome::ok       ? "succeeded"
                     : r.outcome == RunResult::Outcome::failed ? "failed"
                                                               : "stopped");
      }
      return r;
    } catch (...) {
      if (site_) site_->ended("failed");
      throw;
    }
  }

  RunResult run() {
    // Before any thread exists (ZeroMQ's, the spawner's), so that every thread blocks them and
    // only the signal thread takes them: a signal delivered to another thread would run the
    // default action, or vanish where the shell ignores SIGINT for background jobs.
    StopSignals::block();
    // The control channels to local workers are pipes: a worker that died leaves a write to its
    // pipe failing with EPIPE, which the channel handles (its loss comes from the launcher),
    // never the driver's death. Workers start with SIGPIPE's default again (Spawner).
    ::signal(SIGPIPE, SIG_IGN);
    job_ = load_job(options_.job_file, options_.overrides);
    // The workers' fork server starts now, beside the placement and the plugin's check.
    if (job_.mode != Mode::remote && fork_server_enabled()) start_fork_server();
    collectives_ = collectives_backend(job_, std::getenv("TWINKLE_COLLECTIVES"));
    run_id_ = make_run_id();
    checkpoints_.emplace(job_, run_id_);
    const std::string resume_note = checkpoints_->choose_resume(options_.resume);
    if (!place_ranks()) {
      std::fprintf(stderr, "\ntwinkle: interrupted by %s while waiting for devices\n",
                   signal_name(signal_.load()));
      return {RunResult::Outcome::interrupted, signal_.load()};
    }
    std::fputs(render_topology(job_, placement_, {options_.ascii}).c_str(), stdout);
    if (!resume_note.empty()) std::printf("twinkle: %s\n", resume_note.c_str());
    std::fflush(stdout);
    load_plugin();

    prepare();
    start_signal_thread();
    try {
      launcher_->start(launches_);
      table_->start(kStartTimeout, [this](const WorkerInfo& w) { return welcome(w); });
    } catch (const Error& e) {
      return finish(false, e.what());
    }
    std::string error;
    const bool ok = run_entry(&error);
    signals_.entry_returned();
    return finish(ok, error);
  }

  // ----- HostOps: what the plugin's driver entry calls ------------------------------------

  void log(std::int32_t level, std::string_view message) override {
    std::FILE* out = level >= TWK_LOG_WARN ? stderr : stdout;
    std::fprintf(out, "%.*s\n", static_cast<int>(message.size()), message.data());
    std::fflush(out);
  }

  std::uint64_t create(std::string_view cls_name, std::string_view group,
                       const twk_value_v1& args) override {
    const plugins::ClassInfo* cls = plugin_->find_class(cls_name);
    if (!cls) {
      std::vector<std::string> names;
      for (const auto& c : plugin_->classes()) names.push_back(c.name);
      throw CallError(fmt::format(
          "create: the plugin has no class {} (it has: {}); declare it with TWINKLE_CLASS",
          cls_name,
          names.empty() ? std::string("none") : fmt::format("{}", fmt::join(names, ", "))));
    }
    const auto gi = table_->find_group(group);
    if (!gi) {
      std::vector<std::string> names;
      for (const auto& g : table_->groups()) names.push_back(g.name);
      throw CallError(fmt::format("create {}: the job has no group \"{}\" (it has: {}); see {}",
                                  cls_name, group, fmt::join(names, ", "), job_.file.string()));
    }
    return table_->create(*cls, *gi, channel_->adopt(args));
  }

  std::uint64_t call(std::uint64_t instance, std::string_view method, const twk_value_v1& args,
                     const std::string& caller) override {
    return table_->call(instance, method, channel_->adopt(args), caller);
  }

  EncodedValue wait(std::uint64_t future) override { return table_->wait(future); }

  // A communicator across groups: each member learns its rank now (before any call that uses
  // it, on the same ordered channel); the backend is made when the members first use it.
  void comm_create(std::string_view name, const Value& members, double timeout_s) override {
    comms_.create(std::string(name), members, timeout_s, job_, *table_);
  }

  void release(std::uint64_t future) noexcept override { table_->release(future); }

  // Every worker writes its part into a hidden folder, then the manifest makes it a checkpoint
  // (docs/ARCHITECTURE.md, Checkpoints).
  bool checkpoint(std::int64_t step, const Value& meta) override {
    return checkpoints_->write(step, meta, *table_);
  }

  Value resumed() override { return checkpoints_->resumed(); }

  bool stop_requested() override { return signals_.stop_requested(); }

  void attach(std::string_view cls_name, std::string_view group, std::uint64_t instance) override {
    const plugins::ClassInfo* cls = plugin_->find_class(cls_name);
    const auto gi = table_->find_group(group);
    if (!cls || !gi) {
      throw CallError(
          fmt::format("handle: no class {} on a group {} in this job", cls_name, group));
    }
    table_->attach(instance, *cls, *gi);
  }

 private:
  // ----- start-up ---------------------------------------------------------------------------

  // Where every rank runs: this machine's devices, or a reservation on the cluster (which may
  // wait for devices); false when a stop signal came while waiting.
  bool place_ranks() {
    if (job_.mode != Mode::remote) {
      placement_ = place(job_, discover_local(options_.gpus));
      return true;
    }
    if (!options_.connect) {
      throw ConfigError(
          fmt::format("{}: mode = \"remote\" needs a cluster address", job_.file.string()));
    }
    site_ = options_.connect(job_);
    auto reserved = site_->reserve(
        job_, run_id_, [this](std::chrono::milliseconds d) { return !stop_signal_within(d); });
    if (!reserved) return false;
    placement_ = std::move(*reserved);
    return true;
  }

  // With this process's environment, which workers start from (worker_env adds no variable that
  // ForkServer::suits looks at); a server that cannot start is the launcher's to report.
  void start_fork_server() {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) env.emplace_back(*e);
    std::string why;
    fork_server_ = ForkServer::start(worker_binary(twinkle_binary()), env, why);
  }

  // The plugin, checked in a child first, and its driver entry.
  void load_plugin() {
    plugin_.emplace(plugins::Plugin::load_checked(job_.plugin_path));
    driver_fn_ = plugin_->find_driver(job_.driver);
    if (driver_fn_) return;
    std::vector<std::string> names;
    for (const auto& d : plugin_->drivers()) names.push_back(d.name);
    throw PluginError(fmt::format(
        "{}: plugin has no driver entry \"{}\" (it has: {}); declare TWINKLE_DRIVER({}, "
        "twinkle::Driver& d) or set job.driver",
        job_.plugin_path.string(), job_.driver,
        names.empty() ? std::string("none") : fmt::format("{}", fmt::join(names, ", ")),
        job_.driver));
  }

  // Runs the plugin's driver entry with this run as its host; false (and `error`) when it failed.
  bool run_entry(std::string* error) {
    twk_host_v1 host = host_table();
    EncodedValue args = encode(job_.args);
    twk_context_v1 ctx{};
    ctx.size = sizeof ctx;
    ctx.rank = -1;
    ctx.world_size = static_cast<std::int32_t>(table_->workers().size());
    ctx.job = job_.name.c_str();
    ctx.group = "";
    ctx.device = "";
    ctx.args = args.view();
    ctx.host_ctx = static_cast<HostOps*>(this);
    const std::string job_dir = std::filesystem::absolute(job_.file).parent_path().string();
    ctx.job_dir = job_dir.c_str();
    SinkCapture result;
    twk_sink_v1 sink = result.sink();
    const bool ok = driver_fn_(&host, &ctx, &sink) == TWK_OK;
    *error = result.error.value_or(ok ? "" : "the driver entry failed");
    return ok;
  }

  // Everything a run needs before its workers start: the run folder, the channel, the rendezvous
  // store, the call table, the launcher and each worker's environment.
  void prepare() {
    run_dir_ = std::make_unique<RunDir>(run_id_);
    std::vector<std::string> identities;
    std::vector<GroupInfo> groups;
    std::vector<WorkerInfo> workers;
    for (std::size_t gi = 0; gi < placement_.groups.size(); ++gi) {
      const auto& gp = placement_.groups[gi];
      GroupInfo g;
      g.name = gp.group->name;
      g.mesh = gp.group->mesh;
      for (const auto& w : gp.workers) {
        WorkerInfo info;
        info.name = fmt::format("{}:{}", gp.group->name, w.index);
        info.group = gi;
        info.index = w.index;
        g.peers.push_back(workers.size());
        identities.push_back(info.name);
        workers.push_back(std::move(info));
      }
      groups.push_back(std::move(g));
    }

    std::vector<std::string> base;  // the environment the workers start from
    const std::vector<Rendezvous> rendezvous =
        site_ ? prepare_remote(identities) : prepare_local(identities, &base);
    CustomFunctions custom{[this](std::string_view n) { return plugin_->find_dispatcher(n); },
                           [this](std::string_view n) { return plugin_->find_collector(n); }};
    table_ = std::make_unique<CallTable>(*channel_, std::move(groups), std::move(workers),
                                         std::move(custom), job_.timeout_s);
    restarts_.emplace(RunRestarts::Parts{
        job_, *table_, *kv_, comms_, *launcher_, *checkpoints_, [this] { book_.reset(); },
        [this](std::string_view name) { return plugin_->find_class(name); }});
    restarts_->install();
    // The other workers learn of a lost one at once: their calls to it fail instead of waiting.
    table_->on_first_loss([this](std::size_t lost, const std::string& text) {
      for (std::size_t i = 0; i < table_->workers().size(); ++i) {
        if (i == lost) continue;
        try {
          channel_->send(i, Message{0, proto::PeerLost{lost, text}});
        } catch (const TransportError&) {
          // Gone too: the launcher reports it.
        }
      }
    });

    const RunInfo run{run_id_, job_.mode, job_.seed};
    for (std::size_t gi = 0; gi < placement_.groups.size(); ++gi) {
      const auto& gp = placement_.groups[gi];
      for (std::size_t wi = 0; wi < gp.workers.size(); ++wi) {
        launches_.push_back({fmt::format("{}:{}", gp.group->name, gp.workers[wi].index),
                             worker_env(base, placement_, gi, wi, rendezvous[gi], run),
                             gp.group->memory});
      }
    }
  }

  // Remote mode: the channel and the store on TCP (CURVE when the cluster uses keys) and the
  // cluster's launcher; each group's MASTER_ADDR:MASTER_PORT on its first node.
  std::vector<Rendezvous> prepare_remote(const std::vector<std::string>& identities) {
    // Every socket of the run uses CURVE when the cluster does: the driver's key pair and the
    // workers' are made for this run and reach the workers through the (authenticated) agents.
    transport::SocketSecurity driver_side, worker_side;
    if (site_->secure()) {
      driver_side.keys = transport::generate_keypair();
      worker_side.keys = transport::generate_keypair();
      worker_side.server_key = driver_side.keys->public_key;
      gate_ = std::make_unique<transport::KeyGate>(
          zmq_, std::set<std::string>{worker_side.keys->public_key}, [](const std::string& line) {
            std::fprintf(stderr, "twinkle: %s\n", line.c_str());
            std::fflush(stderr);
          });
    }
    const std::string address = site_->driver_address();
    // Without keys the workers' control channels are plain TCP streams (no ZeroMQ I/O thread on
    // either side); with keys, CURVE on a ROUTER.
    if (driver_side.keys) {
      channel_ =
          std::make_unique<transport::TcpDriverChannel>(zmq_, address, identities, driver_side);
    } else {
      channel_ = std::make_unique<transport::StreamDriverChannel>(address, identities);
    }
    kv_ = std::make_unique<transport::KvServer>(zmq_, fmt::format("tcp://{}:*", address),
                                                driver_side);
    RemoteSite::Launch launch{job_.plugin_path, channel_->endpoint(), worker_side, options_.log_dir,
                              options_.quiet};
    launcher_ = site_->launcher(job_, placement_, std::move(launch), *channel_);
    std::vector<Rendezvous> rendezvous;
    for (std::size_t g = 0; g < placement_.groups.size(); ++g)
      rendezvous.push_back(remote_rendezvous(placement_, g));
    return rendezvous;
  }

  // Local mode: the channel and the store on Unix sockets in the run folder, the local launcher,
  // one free loopback port per group; workers start from this process's environment (`base`).
  std::vector<Rendezvous> prepare_local(const std::vector<std::string>& identities,
                                        std::vector<std::string>* base) {
    auto local = std::make_unique<transport::LocalDriverChannel>(identities);
    kv_ = std::make_unique<transport::KvServer>(zmq_, "ipc://" + run_dir_->socket("kv").string());
    LocalLaunchOptions lo;
    lo.exe = worker_binary(twinkle_binary());
    lo.plugin = job_.plugin_path;
    lo.run_dir = run_dir_->path();
    lo.log_dir = options_.log_dir;
    lo.quiet = options_.quiet;
    lo.fork_server = std::move(fork_server_);
    launcher_ = std::make_unique<LocalLauncher>(lo, *local);
    channel_ = std::move(local);
    for (const auto& g : job_.groups) {
      if (g.memory > 0 && !options_.quiet) {
        std::fprintf(stderr,
                     "twinkle: note: group \"%s\" has memory = %s, which node agents enforce; "
                     "a local run does not\n",
                     g.name.c_str(), format_size(g.memory).c_str());
      }
    }
    for (char** e = environ; *e; ++e) base->emplace_back(*e);
    std::vector<Rendezvous> rendezvous;
    for (int port : free_ports(placement_.groups.size()))
      rendezvous.push_back(Rendezvous{"127.0.0.1", port});
    return rendezvous;
  }

  // Waits up to `d` for a stop signal (they are blocked: nothing else takes them before the
  // signal thread starts); true when one came.
  bool stop_signal_within(std::chrono::milliseconds d) {
    const int sig = StopSignals::wait(d);
    if (sig == 0) return false;
    signal_ = sig;
    return true;
  }

  // What every worker needs for its calls to other groups: the groups (meshes, workers) and the
  // workers (names, where they serve).
  void fill_book(proto::Welcome& w) const {
    for (const auto& g : table_->groups()) {
      proto::GroupEntry e{g.name, mesh_to_value(g.mesh), {}};
      for (std::size_t p : g.peers) e.peers.push_back(p);
      w.groups.push_back(std::move(e));
    }
    for (const auto& x : table_->workers()) {
      w.workers.push_back(proto::WorkerEntry{x.name, x.group, x.index, x.pid, x.host, x.serve});
    }
  }

  proto::Welcome welcome(const WorkerInfo& w) {
    if (!book_) {
      book_.emplace();
      fill_book(*book_);
    }
    const GroupSpec& g = job_.groups.at(w.group);
    proto::Welcome out = *book_;
    out.job = job_.name;
    out.self = table_->groups()[w.group].peers[static_cast<std::size_t>(w.index)];
    out.args = job_.args;
    out.mesh = mesh_to_value(g.mesh);
    out.device = to_string(g.device);
    out.kv = kv_->endpoint();
    out.collectives = collectives_;
    out.timeout_s = job_.timeout_s;
    out.generation = restarts_->generation(w.group);
    const auto& from = out.generation ? restarts_->resume_of(w.group) : checkpoints_->resume();
    if (from) {
      proto::ResumePart part{"", "", from->manifest.step};
      for (const auto& p : from->manifest.parts) {
        if (p.worker != w.name) continue;
        part.file = (from->dir / p.file).string();
        part.sha256 = p.sha256;
      }
      out.resume = std::move(part);
    }
    return out;
  }

  // ----- signals (StopSignals) ---------------------------------------------------------------

  // SIGINT, SIGTERM and SIGHUP (and SIGUSR1 without a checkpoint_dir): the workers stop at once
  // and the call table is cancelled, so that the driver entry's waits fail and it returns through
  // the normal path. Only a driver entry stuck in its own code for kInterruptGrace is left
  // behind: then the signal thread cleans up what it can and exits (the last resort).
  void start_signal_thread() {
    StopSignals::Options o;
    o.graceful = !job_.checkpoint_dir.empty();
    o.grace = std::chrono::milliseconds(static_cast<std::int64_t>(job_.stop_grace_s * 1000));
    o.interrupt = [this](int sig) { interrupt(sig); };
    signals_.start(std::move(o));
  }

  // Stops the workers at once and fails every wait of the driver entry; if the entry does not
  // return within kInterruptGrace, the last resort.
  void interrupt(int sig) {
    if (signal_.exchange(sig) != 0) return;
    launcher_->expect_exits();
    launcher_->kill_now();
    table_->cancel(fmt::format("interrupted by {}", signal_name(sig)));
    channel_->wake();
    if (signals_.wait_entry_returned(kInterruptGrace)) return;
    std::fflush(stdout);
    std::fprintf(stderr,
                 "\ntwinkle: interrupted by %s; the driver entry did not return within %lld s, "
                 "stopped all workers\n",
                 signal_name(sig), static_cast<long long>(kInterruptGrace.count()));
    std::fflush(stderr);
    launcher_->kill_now();
    run_dir_.reset();
    ::_exit(128 + sig);  // the last resort: the driver thread is in plugin code
  }

  // ----- the end ----------------------------------------------------------------------------

  // The driver entry returned after a stop request: say where the run stands and how to go on.
  RunResult stopped_on_request() {
    std::string resume = "twinkle run --resume " + options_.job_file.string();
    for (const auto& o : options_.overrides) resume += fmt::format(" --set {}={}", o.key, o.value);
    // A submitted job's driver: the job goes on from the cluster.
    if (const char* id = std::getenv("TWINKLE_JOB_ID"); id && *id)
      resume = fmt::format("twinkle resume {}", id);
    const std::string where = checkpoints_->where();
    std::fflush(stdout);
    std::fprintf(stderr, "twinkle: stopped on request (%s) %s; continue with:\n  %s\n",
                 signal_name(signals_.stop_signal()), where.c_str(), resume.c_str());
    std::fflush(stderr);
    return {RunResult::Outcome::stopped, signals_.stop_signal()};
  }

  RunResult finish(bool ok, const std::string& error) {
    signals_.entry_returned();
    if (restarts_) restarts_->print();
    if (const int sig = signal_.load()) {
      if (launcher_) launcher_->stop(std::chrono::milliseconds(0));
      run_dir_.reset();
      std::fflush(stdout);
      std::fprintf(stderr, "\ntwinkle: interrupted by %s; stopped all workers\n", signal_name(sig));
      return {RunResult::Outcome::interrupted, sig};
    }
    // A worker lost while the driver entry was finishing still fails the run.
    if (table_) table_->drain();
    if (ok && table_ && !table_->lost()) {
      table_->expect_exits();
      launcher_->expect_exits();
      // The run folder goes while the workers still live and before they are told to shut
      // down: their connections are made and need no file, and a driver killed at any moment
      // leaves nothing behind (until the folder is gone the workers are there to remove it on
      // the driver's death; once they have exited no one would).
      run_dir_.reset();
      for (std::size_t i = 0; i < table_->workers().size(); ++i) {
        try {
          channel_->send(i, Message{0, proto::Shutdown{}});
        } catch (const TransportError&) {
          // Already gone: the launcher reaps it.
        }
      }
      channel_->flush(kShutdownGrace);  // a worker that has not read all yet still gets it
      const auto stopped = launcher_->stop(kShutdownGrace);
      if (!stopped.empty()) {
        std::fprintf(stderr,
                     "twinkle: worker(s) %s did not exit within %lld s of the shutdown (stopped "
                     "or stuck); killed them\n",
                     fmt::format("{}", fmt::join(stopped, ", ")).c_str(),
                     static_cast<long long>(kShutdownGrace.count()));
      }
      if (signals_.stop_requested()) return stopped_on_request();
      return {RunResult::Outcome::ok, 0};
    }
    FailureFacts facts{job_.name, run_id_, table_ ? table_->lost() : std::nullopt, error};
    run_dir_.reset();  // first, as above
    if (launcher_) launcher_->stop(std::chrono::milliseconds(0));
    std::fflush(stdout);
    std::fputs(failure_summary(facts).c_str(), stderr);
    std::fflush(stderr);
    if (job_.notify) notify_failure(*job_.notify, job_.name, run_id_, root_cause(facts));
    return {RunResult::Outcome::failed, 0};
  }

  RunOptions options_;
  Job job_;
  std::string collectives_;  // the cpu groups' backend, TWINKLE_COLLECTIVES applied
  Placement placement_;
  std::optional<plugins::Plugin> plugin_;
  twk_driver_fn driver_fn_ = nullptr;
  std::string run_id_;
  std::vector<WorkerLaunch> launches_;
  std::optional<proto::Welcome> book_;  // the workers' address book (welcome)
  // Destroyed bottom-up: the launcher (its workers) first, the run folder last.
  std::unique_ptr<RemoteSite> site_;  // remote mode: the cluster (releases the reservation)
  std::unique_ptr<RunDir> run_dir_;
  zmq::context_t zmq_;
  std::unique_ptr<transport::KeyGate> gate_;  // remote mode with keys: admits the run's workers
  std::unique_ptr<transport::CallChannel> channel_;
  std::unique_ptr<transport::KvServer> kv_;
  std::unique_ptr<CallTable> table_;
  // Communicators across groups (after the channel: their messages go through it).
  CrossComms comms_{[this](std::size_t p, const Message& m) { channel_->send(p, m); }};
  std::shared_ptr<ForkServer> fork_server_;  // until the local launcher takes it
  std::unique_ptr<Launcher> launcher_;
  StopSignals signals_;
  std::atomic<int> signal_{0};  // the signal that interrupted the run
  // Checkpoints and stopping on request.
  std::optional<RunCheckpoints> checkpoints_;  // once the job is read
  std::optional<RunRestarts> restarts_;        // once the call table is made
};

}  // namespace

RunResult run_job(const RunOptions& options) {
  heap_pages::grow_in_large_steps();
  JobRun run(options);
  return run.run_and_tell();
}

}  // namespace twinkle::core
