#include "core/runtime/worker.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zmq.hpp>

#include "core/job/values.hpp"
#include "core/runtime/call_chain.hpp"
#include "core/runtime/call_table.hpp"
#include "core/runtime/checkpoint.hpp"
#include "core/runtime/communicators.hpp"
#include "core/runtime/host_abi.hpp"
#include "core/runtime/instances.hpp"
#include "core/runtime/run_as.hpp"
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
using Chain = std::vector<proto::ChainLink>;

// How often a worker waiting for another group looks for a cycle of calls (probes).
constexpr auto kProbeInterval = std::chrono::milliseconds(300);

// For the parent-death handler: what to remove when the driver died without cleaning up.
constexpr std::size_t kPathMax = 4096;
// the rendezvous socket, this worker's serve socket and its descriptor socket
char g_run_files[3][kPathMax];
char g_run_dir[kPathMax];
// The other local workers' serve sockets (set once at the welcome, never freed): the first
// worker to notice the driver's death kills the rest before they could remove their own.
const char* const* g_peer_sockets = nullptr;
std::size_t g_peer_socket_count = 0;

extern "C" void on_driver_death(int) {
  // Only async-signal-safe calls. The worker asks for SIGHUP when its parent dies, and the
  // launcher stops workers with SIGTERM/SIGKILL, so SIGHUP here means the driver died (even
  // SIGKILLed) and left its run folder behind: the workers remove it on their way out.
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
    if (o.endpoint.starts_with("tcp://")) {
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
      link_ = transport::connect_tcp_worker(
          zmq_, o.endpoint, name_, security_, [name](const std::string& why) {
            std::fprintf(stderr, "twinkle worker %s: %s; exiting\n", name.c_str(), why.c_str());
            std::fflush(stderr);
            kill(0, SIGKILL);
            _exit(1);
          });
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
      peers_from(*welcome);
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

    // One call at a time, in arrival order, from the driver or from other workers. While a call
    // waits for another group, PeerChannel::next runs the same handlers: they queue what must
    // wait and answer at once what would otherwise never finish (a cycle of calls).
    for (;;) {
      if (!queue_.empty()) {
        Pending p = std::move(queue_.front());
        queue_.pop_front();
        if (!run_one(p)) return true;
        continue;
      }
      // Both sockets are read until empty before waiting (wait_readable's condition).
      on_link_ready();
      on_serve_ready();
      if (queue_.empty())
        transport::wait_readable({link_->waitable(), serve_->socket()}, -1,
                                 std::chrono::milliseconds(-1));
    }
  }

  // ----- HostOps: this worker's calls to other groups -------------------------------------

  void log(std::int32_t level, std::string_view message) override {
    log_line(nullptr, level, std::string(message).c_str());
  }

  std::uint64_t create(std::string_view cls_name, std::string_view group,
                       const twk_value_v1& args) override {
    const plugins::ClassInfo& cls = known_class(cls_name, "create");
    const std::size_t gi = known_group(group, "create " + std::string(cls_name));
    EncodedValue a = peers_->adopt(args);
    const std::uint64_t id = table_->create(cls, gi, a, PeerCaller{rank_, world_}, calls_->chain());
    // The driver records it, so that a restart of that group makes it there again.
    link_->send(Message{id, proto::Made{gi, table_->workers_of(id), cls.name, std::move(a)}});
    return id;
  }

  std::uint64_t call(std::uint64_t instance, std::string_view method, const twk_value_v1& args,
                     const std::string& caller) override {
    return table_->call(instance, method, peers_->adopt(args), caller, PeerCaller{rank_, world_},
                        calls_->chain());
  }

  EncodedValue wait(std::uint64_t future) override { return table_->wait(future); }
  void release(std::uint64_t future) noexcept override { table_->release(future); }

  void comm_create(std::string_view name, const Value&, double) override {
    throw CallError(
        fmt::format("communicator \"{}\": communicators across groups are declared by the driver "
                    "(twinkle::Driver::communicator), before the methods that use them",
                    name));
  }

  void attach(std::string_view cls_name, std::string_view group, std::uint64_t instance) override {
    const plugins::ClassInfo& cls = known_class(cls_name, "handle");
    table_->attach(instance, cls, known_group(group, "handle of " + std::string(cls_name)));
  }

  Communicators* communicators() override { return comms_.get(); }

 private:
  // Something to run: a message from the driver (`from` empty) or a request from another worker.
  struct Pending {
    std::string from;
    Message message;
  };

  // Local workers serve on a Unix socket in the run folder; remote ones on TCP at their node's
  // address, with the run's keys when the cluster uses keys.
  std::string serve_endpoint() {
    if (options_.endpoint.starts_with("tcp://"))
      return fmt::format("tcp://{}:*", node_ip_.empty() ? "127.0.0.1" : node_ip_);
    if (options_.run_dir.empty()) return "tcp://127.0.0.1:*";
    const std::string path = (options_.run_dir / fmt::format("w{}", getpid())).string();
    std::snprintf(g_run_files[1], sizeof g_run_files[1], "%s", path.c_str());
    std::snprintf(g_run_files[2], sizeof g_run_files[2], "%s.fd", path.c_str());
    return "ipc://" + path;
  }

  // The run's groups and workers (the welcome), for this worker's calls to other groups.
  void peers_from(const proto::Welcome& welcome) {
    std::vector<GroupInfo> groups;
    for (const auto& g : welcome.groups) {
      GroupInfo info;
      info.name = g.name;
      info.mesh = mesh_from_value(g.mesh);
      for (const auto p : g.peers) info.peers.push_back(p);
      groups.push_back(std::move(info));
    }
    std::vector<WorkerInfo> workers;
    std::vector<std::string> names, endpoints;
    for (const auto& w : welcome.workers) {
      WorkerInfo info;
      info.name = w.name;
      info.group = w.group;
      info.index = w.index;
      info.pid = w.pid;
      info.host = w.host;
      info.serve = w.serve;
      info.ready = true;
      names.push_back(info.name);
      endpoints.push_back(info.serve);
      workers.push_back(std::move(info));
    }
    self_ = welcome.self;
    remember_peer_sockets(endpoints);
    transport::SocketSecurity client;
    if (security_.keys) {
      client.keys = security_.keys;
      client.server_key = security_.keys->public_key;  // every worker of the run has this pair
    }
    peers_ = std::make_unique<transport::PeerChannel>(zmq_, name_, std::move(names),
                                                      std::move(endpoints), client);
    peers_->watch(link_->waitable(), [this] { on_link_ready(); });
    peers_->watch(serve_->socket(), [this] { on_serve_ready(); });
    peers_->every(kProbeInterval, [this] { calls_->send_probes(); });
    CustomFunctions custom{[this](std::string_view n) { return plugin_.find_dispatcher(n); },
                           [this](std::string_view n) { return plugin_.find_collector(n); }};
    const double timeout_s = std::chrono::duration<double>(timeout_).count();
    table_ = std::make_unique<CallTable>(*peers_, std::move(groups), std::move(workers),
                                         std::move(custom), timeout_s,
                                         static_cast<std::uint64_t>(self_ + 1) << 40);
    table_->set_caller_label("worker caller");
    calls_ = std::make_unique<CallChain>(
        name_, CallChain::Peers{[this] { return table_->waiting_peers(); },
                                [this](const std::string& n) { return peer_index(n); },
                                [this](std::size_t p, const proto::Probe& probe) {
                                  try {
                                    peers_->send(p, Message{0, probe});
                                  } catch (const TransportError&) {
                                    // That worker is gone: the driver tells everyone.
                                  }
                                },
                                [this](std::size_t p, const std::string& error) {
                                  table_->fail_waiting(p, error);
                                  peers_->wake();  // the waiting call sees its error now
                                }});
  }

  // For the parent-death handler: the local workers' socket files in this run's folder.
  void remember_peer_sockets(const std::vector<std::string>& endpoints) {
    if (options_.run_dir.empty() || g_peer_sockets) return;
    const std::string prefix = "ipc://" + options_.run_dir.string() + "/";
    auto* paths = new std::vector<std::string>;  // lives as long as the process
    for (const auto& e : endpoints) {
      if (!e.starts_with(prefix)) continue;
      paths->push_back(e.substr(6));
      paths->push_back(transport::shm_listener_path(e));
    }
    auto* list = new const char*[paths->size() + 1];
    for (std::size_t i = 0; i < paths->size(); ++i) list[i] = (*paths)[i].c_str();
    g_peer_sockets = list;  // before the count: the handler reads only what the count covers
    g_peer_socket_count = paths->size();
  }

  const plugins::ClassInfo& known_class(std::string_view name, const std::string& what) const {
    if (const plugins::ClassInfo* cls = plugin_.find_class(name)) return *cls;
    std::vector<std::string> names;
    for (const auto& c : plugin_.classes()) names.push_back(c.name);
    throw CallError(fmt::format("{}: the plugin has no class {} (it has: {})", what, name,
                                fmt::join(names, ", ")));
  }

  std::size_t known_group(std::string_view name, const std::string& what) const {
    if (auto gi = table_->find_group(name)) return *gi;
    std::vector<std::string> names;
    for (const auto& g : table_->groups()) names.push_back(g.name);
    throw CallError(fmt::format("{}: the job has no group \"{}\" (it has: {})", what, name,
                                fmt::join(names, ", ")));
  }

  // Messages from the driver: a lost worker and a communicator's membership take effect at
  // once (a call in progress may need them); the rest waits its turn.
  void on_link_ready() {
    while (auto m = link_->recv(std::chrono::milliseconds(0))) {
      if (auto* lost = m->get<proto::PeerLost>()) {
        if (peers_) peers_->lost(lost->peer, std::move(lost->text));
      } else if (auto* join = m->get<proto::CommJoin>()) {
        comms_->join(*join);
      } else if (auto* moved = m->get<proto::PeersReplaced>()) {
        // A group restarted: its new workers serve elsewhere; calls waiting on the old fail.
        if (!table_ || !peers_) continue;
        for (const auto& w : moved->workers) {
          const auto peer = peer_index(w.name);
          if (!peer || *peer == self_) continue;
          table_->replace_worker(*peer, w.pid, w.host, w.serve, moved->text);
          peers_->repoint(*peer, w.serve);
        }
        peers_->wake();
      } else if (m->get<proto::Create>() || m->get<proto::Call>() || m->get<proto::Shutdown>() ||
                 m->get<proto::Save>() || m->get<proto::Regroup>() || m->get<proto::Recover>()) {
        queue_.push_back(Pending{"", std::move(*m)});
      } else {
        link_->drop(fmt::format("a {} message from the driver is not for a worker",
                                transport::to_string(m->type())));
      }
    }
  }

  // Requests from other workers. While this worker is in a call, one that this call (directly
  // or through others) waits for is a cycle: answered at once with an error naming it.
  void on_serve_ready() {
    while (auto r = serve_->recv(std::chrono::milliseconds(0))) {
      Message& m = r->message;
      if (!peer_index(r->from)) {
        // Not a worker of this run (it cannot be one: they all are in the address book).
        serve_->drop(fmt::format("a {} message from \"{}\", not a worker of this run",
                                 transport::to_string(m.type()), r->from.substr(0, 64)));
        continue;
      }
      if (auto* probe = m.get<proto::Probe>()) {
        calls_->on_probe(*probe);
        continue;
      }
      if (m.get<proto::StatePull>()) {  // a replacement of this worker's group: in turn
        queue_.push_back(Pending{std::move(r->from), std::move(m)});
        continue;
      }
      if (!m.get<proto::Create>() && !m.get<proto::Call>()) {
        serve_->drop(fmt::format("a {} message from worker {} is not a call",
                                 transport::to_string(m.type()), r->from));
        continue;
      }
      {
        if (auto cycle = calls_->find_cycle(chain_of(m), r->from, request_what(m), caller_of(m))) {
          if (m.get<proto::Create>()) {
            serve_->reply(r->from, Message{m.id, proto::Created{*cycle}});
          } else {
            serve_->reply(r->from, Message{m.id, proto::Reply{*cycle, {}}});
          }
          continue;
        }
      }
      queue_.push_back(Pending{std::move(r->from), std::move(m)});
    }
  }

  std::optional<std::size_t> peer_index(const std::string& name) const {
    for (std::size_t i = 0; i < table_->workers().size(); ++i) {
      if (table_->workers()[i].name == name) return i;
    }
    return std::nullopt;
  }

  // "Trainer.step" for a request (the class from this worker's instances when it has it).
  std::string request_what(const Message& m) const {
    if (const auto* c = m.get<proto::Create>()) return c->cls + " constructor";
    const auto* call = m.get<proto::Call>();
    if (!call) return transport::to_string(m.type());
    return instances_.class_of(call->instance) + "." + call->method;
  }

  static const Chain& chain_of(const Message& m) {
    static const Chain none;
    if (const auto* c = m.get<proto::Create>()) return c->chain;
    if (const auto* c = m.get<proto::Call>()) return c->chain;
    return none;
  }

  static std::string caller_of(const Message& m) {
    if (const auto* c = m.get<proto::Call>()) return c->caller;
    return "";
  }

  // Runs one queued message; false after a shutdown.
  bool run_one(Pending& p) {
    const std::string from = p.from;
    auto reply = [this, &from](Message m) {
      if (from.empty()) {
        link_->send(m);
      } else {
        serve_->reply(from, m);
      }
    };
    Message& m = p.message;
    if (auto* c = m.get<proto::Create>()) {
      taken_.reset();  // the state taken for a replacement is not this worker's any more
      execute(m, from, [&] { reply(Message{m.id, instances_.create(*c, m.id, from)}); });
    } else if (auto* c = m.get<proto::Call>()) {
      taken_.reset();
      execute(m, from, [&] { reply(Message{m.id, instances_.call(*c, adopt_for(from))}); });
    } else if (auto* s = m.get<proto::Save>()) {
      reply(Message{m.id, instances_.save(*s)});
    } else if (auto* g = m.get<proto::Regroup>()) {
      regroup(*g);
    } else if (auto* pull = m.get<proto::StatePull>()) {
      if (pull->generation > comms_->generation()) {
        held_pulls_.push_back(std::move(p));  // served once this worker is regrouped
      } else {
        reply(Message{m.id, take_state()});
      }
    } else if (auto* r = m.get<proto::Recover>()) {
      reply(Message{m.id, recover(*r)});
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
    calls_->run(chain_of(m), from.empty(), request_what(m), caller_of(m), std::forward<F>(f));
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

  // ----- restart = "worker" (docs/ARCHITECTURE.md, Restarts) --------------------------------

  // Everything sent before this was of the group as it was: the group's communicators are made
  // again at the new generation (their rendezvous keys are new, so the replacements meet the
  // survivors there), and replacements that asked for this worker's state get it now. A donor
  // takes its state here, while its replacement starts: the copy into new shared memory is then
  // off the replacement's path, and nothing can change the state before the pull but a call or
  // create that this worker runs first (calls to the group wait for it to be back).
  void regroup(const proto::Regroup& g) {
    comms_->regroup(std::max(comms_->generation(), g.generation));
    taken_.reset();
    if (g.donor) taken_ = state();
    std::vector<Pending> held = std::move(held_pulls_);
    held_pulls_.clear();
    for (Pending& p : held) {
      if (p.message.get<proto::StatePull>()->generation > comms_->generation()) {
        held_pulls_.push_back(std::move(p));
      } else {
        serve_->reply(p.from, Message{p.message.id, take_state()});
      }
    }
  }

  // This worker's state for a replacement, its tensors in shared memory for a local one.
  proto::State state() {
    return instances_.state(name_, [this](const twk_value_v1& v) {
      return transport::adopt_to_shm(v, serve_->pool());
    });
  }

  // The state taken at the regroup when nothing ran since, else the state now.
  proto::State take_state() {
    if (!taken_) return state();
    proto::State s = std::move(*taken_);
    taken_.reset();
    return s;
  }

  // How a method's result leaves the plugin's memory: for the driver by its link (shared memory
  // locally), for another worker into shared memory.
  Instances::Adopt adopt_for(const std::string& from) {
    if (from.empty()) return [this](const twk_value_v1& v) { return link_->adopt(v); };
    return [this](const twk_value_v1& v) { return transport::adopt_to_shm(v, serve_->pool()); };
  }

  // A replacement's instances take the state of the same instances on `donor`, a surviving
  // replica, worker to worker: asked for on the donor's socket for calls, loaded with load().
  proto::Recovered recover(const proto::Recover& r) {
    const auto& workers = table_->workers();
    if (r.donor >= workers.size() || r.donor == self_)
      return proto::Recovered{fmt::format("no worker {} to recover from", r.donor), 0, 0, 0};
    const std::string donor = workers[r.donor].name;
    const std::string what = fmt::format("recovering the state of {} from {}", name_, donor);
    const std::uint64_t id =
        (static_cast<std::uint64_t>(self_ + 1) << 40) | (std::uint64_t{1} << 39);
    const auto started = std::chrono::steady_clock::now();
    try {
      peers_->send(r.donor, Message{id, proto::StatePull{r.generation}});
    } catch (const std::exception& e) {
      return proto::Recovered{fmt::format("{}: {}", what, e.what()), 0, 0, 0};
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    std::optional<proto::State> got;
    while (!got) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        return proto::Recovered{fmt::format("{}: no answer in {:g} s (the job's timeout_s)", what,
                                            std::chrono::duration<double>(timeout_).count()),
                                0, 0, 0};
      }
      auto e = peers_->next(left);
      if (!e || e->peer != r.donor) continue;
      if (e->kind == transport::ChannelEvent::Kind::lost)
        return proto::Recovered{fmt::format("{}: {} was lost: {}", what, donor, e->reason), 0, 0,
                                0};
      if (e->kind != transport::ChannelEvent::Kind::message || e->message.id != id) continue;
      if (auto* st = e->message.get<proto::State>()) got = std::move(*st);
    }
    if (got->error) return proto::Recovered{fmt::format("{}: {}", what, *got->error), 0, 0, 0};
    const Instances::Loaded loaded = instances_.load(got->entries, what);
    if (loaded.error) return proto::Recovered{loaded.error, loaded.instances, loaded.bytes, 0};
    return proto::Recovered{
        std::nullopt, loaded.instances, loaded.bytes,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()};
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
  std::unique_ptr<Communicators> comms_;  // after the welcome
  transport::SocketSecurity security_;    // remote workers: the run's keys
  std::string node_ip_;                   // remote workers: where peers reach this node
  // Calls between groups.
  std::unique_ptr<transport::ServeSocket> serve_;  // calls from other workers
  std::unique_ptr<transport::PeerChannel> peers_;  // this worker's connections to the others
  std::unique_ptr<CallTable> table_;               // this worker's calls to other groups
  std::size_t self_ = 0;                           // this worker's index in the run
  std::deque<Pending> queue_;                      // what waits its turn
  std::vector<Pending> held_pulls_;    // state pulls of a newer generation than this worker's
  std::optional<proto::State> taken_;  // a donor's state, taken at its regroup
  std::unique_ptr<CallChain> calls_;   // what runs now, and the cycle checks
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
  // Die with the driver. The launcher starts workers with posix_spawn, which cannot ask for the
  // parent-death signal, so the worker asks itself and then checks that the driver did not die
  // before it asked.
  if (const char* parent = std::getenv("TWINKLE_PARENT_PID")) {
    prctl(PR_SET_PDEATHSIG, SIGHUP);
    if (getppid() != static_cast<pid_t>(std::atoll(parent))) on_driver_death(SIGHUP);
  }

  plugins::Plugin plugin = plugins::Plugin::load(o.plugin);
  Worker w(o, std::move(plugin));
  return w.run();
}

}  // namespace twinkle::core
