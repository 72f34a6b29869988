#include "core/runtime/worker.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zmq.hpp>

#include "core/job/values.hpp"
#include "core/runtime/call_table.hpp"
#include "core/runtime/checkpoint.hpp"
#include "core/runtime/communicators.hpp"
#include "core/runtime/fork_server.hpp"
#include "core/runtime/group_calls.hpp"
#include "core/runtime/host_abi.hpp"
#include "core/runtime/inbox.hpp"
#include "core/runtime/instances.hpp"
#include "core/runtime/run_as.hpp"
#include "core/runtime/state_copy.hpp"
#include "plugins/loader.hpp"
#include "transports/zmq/channel.hpp"
#include "transports/zmq/peers.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::core {

namespace {

using transport::Message;
using transport::MsgType;
namespace proto = transport::proto;

// For the parent-death handler: what to remove when the driver died without cleaning up.
constexpr std::size_t kPathMax = 4096;
// the rendezvous socket and this worker's serve socket
char g_run_files[2][kPathMax];
char g_run_dir[kPathMax];
// The other local workers' serve sockets (set once at the welcome, never freed): the first
// worker to notice the driver's death kills the rest before they could remove their own.
const char* const* g_peer_sockets = nullptr;
std::size_t g_peer_socket_count = 0;
// A forked worker's parent is its fork server: the driver's pidfd tells which of the two died.
int g_driver_pidfd = -1;

extern "C" void on_driver_death(int) {
  // Only async-signal-safe calls. The worker asks for SIGHUP when its parent dies, and the
  // launcher stops workers with SIGTERM/SIGKILL, so SIGHUP here means the driver died (even
  // SIGKILLed) and left its run folder behind: the workers remove it on their way out. Unless
  // only the fork server died: the run is still the driver's, which hears of this worker's end.
  // A driver being killed takes a moment to end all its threads (the server's parent thread may go
  // first): give it that before taking it for alive. Where only the server died, its launcher
  // kills the worker at once anyway.
  if (g_driver_pidfd >= 0) {
    pollfd p{g_driver_pidfd, POLLIN, 0};
    if (poll(&p, 1, 2000) == 0) {
      static const char kLine[] = "twinkle-worker: its fork server died; the worker ends\n";
      (void)!write(2, kLine, sizeof kLine - 1);
      _exit(128 + SIGHUP);
    }
  }
  for (const char* f : g_run_files) {
    if (f[0]) unlink(f);
  }
  for (std::size_t i = 0; i < g_peer_socket_count; ++i) unlink(g_peer_sockets[i]);
  if (g_run_dir[0]) rmdir(g_run_dir);
  // Whatever the workers started dies with them: the whole worker process group.
  kill(0, SIGKILL);
  _exit(128 + SIGHUP);
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

// The descriptors of a local worker's control channel, from its endpoint "fd:IN,OUT" (what it
// reads, what it writes). Throws ConfigError for anything else.
std::pair<int, int> control_fds(const std::string& endpoint) {
  int in = -1, out = -1, used = 0;
  const bool parsed = endpoint.starts_with("fd:") &&
                      std::sscanf(endpoint.c_str(), "fd:%d,%d%n", &in, &out, &used) == 2 &&
                      static_cast<std::size_t>(used) == endpoint.size();
  if (!parsed || in < 3 || out < 3 || in == out || ::fcntl(in, F_GETFD) < 0 ||
      ::fcntl(out, F_GETFD) < 0) {
    throw ConfigError(fmt::format(
        "--endpoint {}: not a control channel this worker has; a local worker's endpoint is "
        "fd:IN,OUT, the descriptors twinkle run hands it (workers are started by twinkle run), a "
        "remote worker's tcp://HOST:PORT",
        endpoint));
  }
  return {in, out};
}

std::string env_str(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

void log_line(void*, std::int32_t level, const char* message) {
  std::FILE* out = level >= TWK_LOG_WARN ? stderr : stdout;
  std::fprintf(out, "%s\n", message);
  std::fflush(out);
}

// A worker: runs the calls of its driver and, for calls between groups (docs/ARCHITECTURE.md, Calls
// between groups), those of other workers, one at a time; and calls other groups itself through a
// call table of its own (the HostOps that the plugin's Context::create/handle and Handle::call
// reach).
class Worker : public HostOps {
 public:
  Worker(const WorkerOptions& o, plugins::Plugin plugin) : options_(o), plugin_(std::move(plugin)) {
    name_ = env_str("TWINKLE_WORKER_NAME");
    group_ = env_str("TWINKLE_GROUP");
    rank_ = env_int("RANK", 0);
    world_ = env_int("WORLD_SIZE", 1);
    local_rank_ = env_int("LOCAL_RANK", rank_);
    local_world_ = env_int("LOCAL_WORLD_SIZE", world_);
    if (remote()) {
      // A remote worker: CURVE with the run's keys (handed over by its agent) when the cluster
      // uses keys. Losing the driver's connection ends the worker and what it started: its calls
      // are lost with it, and nobody else would stop it.
      if (const char* pub = std::getenv("TWINKLE_CURVE_PUBLIC")) {
        security_.keys = transport::KeyPair{pub, env_str("TWINKLE_CURVE_SECRET")};
        security_.server_key = env_str("TWINKLE_CURVE_SERVER");
      }
      for (const char* v : {"TWINKLE_CURVE_PUBLIC", "TWINKLE_CURVE_SECRET", "TWINKLE_CURVE_SERVER"})
        ::unsetenv(v);  // not for the plugin, nor for what it starts
      node_ip_ = env_str("TWINKLE_NODE_IP");
      const std::string name = name_;
      auto on_lost = [name](const std::string& why) {
        std::fprintf(stderr, "twinkle worker %s: %s; exiting\n", name.c_str(), why.c_str());
        std::fflush(stderr);
        kill(0, SIGKILL);
        _exit(1);
      };
      link_ = o.endpoint.starts_with(transport::kStreamScheme)
                  ? transport::connect_stream_worker(o.endpoint, on_lost)
                  : transport::connect_tcp_worker(zmq_, o.endpoint, name_, security_, on_lost);
    } else {
      // A local worker: its control channel and descriptor channel are inherited descriptors.
      // Its driver closing the control channel means it died: the same as its parent-death
      // signal.
      const char* shm_fd = std::getenv("TWINKLE_SHM_FD");
      const auto [in, out] = control_fds(o.endpoint);
      link_ = transport::connect_local_worker(Fd(in), Fd(out), Fd(shm_fd ? std::atoi(shm_fd) : -1),
                                              [](const std::string&) { on_driver_death(SIGHUP); });
    }
    // create/call/wait/release/attach as in a driver entry (HostOps); the collectives on this
    // worker's communicators (communicators()).
    host_ = host_table();
    host_.log = &log_line;
    set_collectives(host_);
  }

  bool run() {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    serve_ = std::make_unique<transport::ServeSocket>(zmq_, serve_endpoint(), security_);
    link_->send(Message{0, proto::Hello{name_, group_, rank_, static_cast<int>(getpid()),
                                        std::string(host), serve_->endpoint()}});
    std::optional<proto::Welcome> welcome;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!welcome) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        std::fprintf(stderr, "twinkle worker %s: no welcome from the driver at %s\n", name_.c_str(),
                     options_.endpoint.c_str());
        return false;
      }
      auto m = link_->recv(left);
      if (!m) continue;
      if (auto* w = m->get<proto::Welcome>()) {
        welcome = std::move(*w);
      } else if (m->get<proto::Shutdown>()) {
        return true;
      }
    }
    try {
      job_ = welcome->job;
      args_ = encode(welcome->args);
      mesh_ = std::make_unique<DeviceMesh>(mesh_from_value(welcome->mesh));
      mesh_abi_ = std::make_unique<MeshAbi>(*mesh_);
      device_ = welcome->device;
      timeout_ = std::chrono::milliseconds(static_cast<std::int64_t>(welcome->timeout_s * 1000));
      comms_ = std::make_unique<Communicators>(
          zmq_, CommunicatorSetup{group_, rank_, world_, *mesh_, device_, welcome->collectives,
                                  timeout_, welcome->kv, security_, node_ip_, welcome->generation});
      welcomed(*welcome);
      if (welcome->resume && !welcome->resume->file.empty()) {
        std::optional<checkpoint::Part> part;
        std::string error;
        try {
          part.emplace(checkpoint::Part::read(welcome->resume->file, welcome->resume->sha256));
        } catch (const Error& e) {
          error = e.what();  // the first instance with state fails with it
        }
        instances_.resume_from(welcome->resume->step, std::move(part), std::move(error));
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "twinkle worker %s: the driver's welcome does not fit this worker: %s\n",
                   name_.c_str(), e.what());
      return false;
    }

    // One call at a time, in arrival order, from the driver or from other workers (Inbox).
    for (;;) {
      if (auto p = inbox_->take()) {
        if (!run_one(*p)) return true;
        continue;
      }
      inbox_->wait();
    }
  }

  // ----- HostOps: this worker's calls to other groups -------------------------------------

  void log(std::int32_t level, std::string_view message) override {
    log_line(nullptr, level, std::string(message).c_str());
  }

  std::uint64_t create(std::string_view cls_name, std::string_view group,
                       const twk_value_v1& args) override {
    auto [id, made] = group_calls_->create(cls_name, group, args, rank_, world_);
    // The driver records it, so that a restart of that group makes it there again.
    link_->send(Message{id, std::move(made)});
    return id;
  }

  std::uint64_t call(std::uint64_t instance, std::string_view method, const twk_value_v1& args,
                     const std::string& caller) override {
    return group_calls_->call(instance, method, args, caller, rank_, world_);
  }

  EncodedValue wait(std::uint64_t future) override { return group_calls_->wait(future); }
  void release(std::uint64_t future) noexcept override { group_calls_->release(future); }

  void comm_create(std::string_view name, const Value&, double) override {
    throw CallError(
        fmt::format("communicator \"{}\": communicators across groups are declared by the driver "
                    "(twinkle::Driver::communicator), before the methods that use them",
                    name));
  }

  void attach(std::string_view cls_name, std::string_view group, std::uint64_t instance) override {
    group_calls_->attach(cls_name, group, instance);
  }

  Communicators* communicators() override { return comms_.get(); }

 private:
  // Local workers serve on a Unix socket in the run folder; remote ones on TCP at their node's
  // address, with the run's keys when the cluster uses keys.
  // A remote worker's driver is at a TCP endpoint: a ROUTER (tcp://) or a stream (tcp+stream://).
  bool remote() const {
    return options_.endpoint.starts_with("tcp://") ||
           options_.endpoint.starts_with(transport::kStreamScheme);
  }

  std::string serve_endpoint() {
    if (remote()) {
      // Without keys a TCP stream (docs/ARCHITECTURE.md, Sockets); with them a CURVE ROUTER.
      return fmt::format("{}{}:*", security_.keys ? "tcp://" : transport::kStreamScheme,
                         node_ip_.empty() ? "127.0.0.1" : node_ip_);
    }
    if (options_.run_dir.empty()) return "tcp://127.0.0.1:*";
    const std::string path = (options_.run_dir / fmt::format("w{}", getpid())).string();
    std::snprintf(g_run_files[1], sizeof g_run_files[1], "%s", path.c_str());
    return "unix://" + path;
  }

  // The welcome's workers and groups: this worker's calls to other groups, what it is asked to
  // do, and its side of restarts.
  void welcomed(const proto::Welcome& welcome) {
    std::vector<std::string> endpoints;
    for (const auto& w : welcome.workers) endpoints.push_back(w.serve);
    remember_peer_sockets(endpoints);
    group_calls_ = std::make_unique<GroupCalls>(
        zmq_, name_, welcome, plugin_, security_, timeout_,
        GroupCalls::Watched{link_->waitable(), [this] { inbox_->read_link(); }, serve_->waitable(),
                            [this] { inbox_->read_serve(); }});
    inbox_ = std::make_unique<Inbox>(*link_, *serve_, *group_calls_, *comms_,
                                     [this](const Message& m) { return request_what(m); });
    state_copy_ =
        std::make_unique<StateCopy>(name_, instances_, *comms_, *serve_, *group_calls_, timeout_);
  }

  // For the parent-death handler: the local workers' socket files in this run's folder.
  void remember_peer_sockets(const std::vector<std::string>& endpoints) {
    if (options_.run_dir.empty() || g_peer_sockets) return;
    const std::string prefix = options_.run_dir.string() + "/";
    auto* paths = new std::vector<std::string>;  // lives as long as the process
    for (const auto& e : endpoints) {
      if (std::string path = transport::local_serve_path(e); path.starts_with(prefix))
        paths->push_back(std::move(path));
    }
    auto* list = new const char*[paths->size() + 1];
    for (std::size_t i = 0; i < paths->size(); ++i) list[i] = (*paths)[i].c_str();
    g_peer_sockets = list;  // before the count: the handler reads only what the count covers
    g_peer_socket_count = paths->size();
  }

  // "Trainer.step" for a request (the class from this worker's instances when it has it).
  std::string request_what(const Message& m) const {
    if (const auto* c = m.get<proto::Create>()) return c->cls + " constructor";
    const auto* call = m.get<proto::Call>();
    if (!call) return transport::to_string(m.type());
    return instances_.class_of(call->instance) + "." + call->method;
  }

  // Runs one queued message; false after a shutdown.
  bool run_one(Inbox::Pending& p) {
    const std::string& from = p.from;
    auto reply = [this, &from](Message m) {
      if (from.empty()) {
        link_->send(m);
      } else {
        serve_->reply(from, m);
      }
    };
    Message& m = p.message;
    if (auto* c = m.get<proto::Create>()) {
      state_copy_->changed();
      execute(m, from, [&] { reply(Message{m.id, instances_.create(*c, m.id, from)}); });
    } else if (auto* c = m.get<proto::Call>()) {
      state_copy_->changed();
      execute(m, from, [&] { reply(Message{m.id, instances_.call(*c, adopt_for(from))}); });
    } else if (auto* s = m.get<proto::Save>()) {
      reply(Message{m.id, instances_.save(*s)});
    } else if (auto* g = m.get<proto::Regroup>()) {
      state_copy_->regroup(*g);
    } else if (m.get<proto::StatePull>()) {
      state_copy_->pull(std::move(p));
    } else if (auto* r = m.get<proto::Recover>()) {
      reply(Message{m.id, state_copy_->recover(*r)});
    } else if (m.get<proto::Shutdown>()) {
      instances_.clear();
      comms_->clear();
      return false;
    }
    return true;
  }

  // Runs `f` as this worker's current call (the chain its calls to other groups carry, so that a
  // call back into it is recognised as a cycle).
  template <class F>
  void execute(const Message& m, const std::string& from, F&& f) {
    group_calls_->chain().run(
        Inbox::chain_of(m), from.empty(), [this, &m] { return request_what(m); },
        Inbox::caller_of(m), std::forward<F>(f));
  }

  twk_context_v1 context() const {
    twk_context_v1 c{};
    c.size = sizeof c;
    c.rank = rank_;
    c.world_size = world_;
    c.local_rank = local_rank_;
    c.local_world_size = local_world_;
    c.job = job_.c_str();
    c.group = group_.c_str();
    c.device = device_.c_str();
    c.mesh = mesh_abi_->view();
    c.args = const_cast<EncodedValue&>(args_).view();
    c.host_ctx = static_cast<HostOps*>(const_cast<Worker*>(this));
    return c;
  }

  // How a method's result leaves the plugin's memory: for the driver by its link (shared memory
  // locally), for another worker into shared memory.
  Instances::Adopt adopt_for(const std::string& from) {
    if (from.empty()) return [this](const twk_value_v1& v) { return link_->adopt(v); };
    return [this](const twk_value_v1& v) { return transport::adopt_to_shm(v, serve_->pool()); };
  }

  WorkerOptions options_;
  plugins::Plugin plugin_;
  zmq::context_t zmq_;
  std::unique_ptr<transport::WorkerLink> link_;
  twk_host_v1 host_{};
  std::string name_, group_, job_, device_;
  int rank_ = 0, world_ = 1, local_rank_ = 0, local_world_ = 1;
  EncodedValue args_;
  std::unique_ptr<DeviceMesh> mesh_;
  std::unique_ptr<MeshAbi> mesh_abi_;
  Instances instances_{plugin_, host_, [this] { return context(); }};
  std::chrono::milliseconds timeout_{600'000};
  std::unique_ptr<Communicators> comms_;           // after the welcome
  transport::SocketSecurity security_;             // remote workers: the run's keys
  std::string node_ip_;                            // remote workers: where peers reach this node
  std::unique_ptr<transport::ServeSocket> serve_;  // calls from other workers
  // After the welcome:
  std::unique_ptr<GroupCalls> group_calls_;  // this worker's calls to other groups
  std::unique_ptr<Inbox> inbox_;             // what it is asked to do, in turn
  std::unique_ptr<StateCopy> state_copy_;    // its side of restarts with recover = "peer"
};

}  // namespace

bool run_worker(const WorkerOptions& o) {
  // First: changing the uid clears the parent-death signal asked for below.
  if (!o.user.empty()) become(o.user);
  if (!o.run_dir.empty()) {
    std::snprintf(g_run_files[0], sizeof g_run_files[0], "%s", (o.run_dir / "kv").c_str());
    std::snprintf(g_run_dir, sizeof g_run_dir, "%s", o.run_dir.c_str());
  }
  struct sigaction sa {};
  sa.sa_handler = &on_driver_death;
  sigaction(SIGHUP, &sa, nullptr);
  // A write to a connection or pipe whose other end is gone is an error where it happens, never
  // the worker's death (a survivor was once killed by SIGPIPE as a replica died beside it).
  ::signal(SIGPIPE, SIG_IGN);
  // Die with the driver. A worker started with posix_spawn cannot be given the parent-death
  // signal, so the worker asks itself and then checks that its parent did not die before it
  // asked; a worker forked by the fork server watches the server (which dies with the driver).
  if (const char* parent = std::getenv("TWINKLE_PARENT_PID")) {
    const auto driver = static_cast<pid_t>(std::atoll(parent));
    if (forked_by() > 0) g_driver_pidfd = open_pidfd(driver).release();
    prctl(PR_SET_PDEATHSIG, SIGHUP);
    if (getppid() != (forked_by() > 0 ? forked_by() : driver)) on_driver_death(SIGHUP);
  }

  plugins::Plugin plugin = plugins::Plugin::load(o.plugin);
  Worker w(o, std::move(plugin));
  return w.run();
}

}  // namespace twinkle::core
