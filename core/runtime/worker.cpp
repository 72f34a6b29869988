#include "core/runtime/worker.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zmq.hpp>

#include "core/job/values.hpp"
#include "core/runtime/host_abi.hpp"
#include "plugins/loader.hpp"
#include "transports/gloo/communicator.hpp"
#include "transports/nccl/communicator.hpp"
#include "transports/shm/communicator.hpp"
#include "transports/zmq/channel.hpp"
#include "transports/zmq/kv.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core {

namespace {

using transport::Message;
using transport::MsgType;

// For the parent-death handler: what to remove when the driver died without cleaning up.
constexpr std::size_t kPathMax = 4096;
char g_run_files[3][kPathMax];  // the control socket, the rendezvous socket, the owner file
char g_run_dir[kPathMax];

extern "C" void on_driver_death(int) {
  // Only async-signal-safe calls. The worker asks for SIGHUP when its parent dies, and the
  // launcher stops workers with SIGTERM/SIGKILL, so SIGHUP here means the driver died (even
  // SIGKILLed) and left its run folder behind: the workers remove it on their way out.
  for (const char* f : g_run_files) {
    if (f[0]) unlink(f);
  }
  if (g_run_dir[0]) rmdir(g_run_dir);
  // Whatever the workers started dies with them: the whole worker process group.
  kill(0, SIGKILL);
  _exit(128 + SIGHUP);
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
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

// A received value shared with the plugin without a copy (twk_value_v1 retain/release).
struct SharedArgs {
  Value value;
  EncodedValue encoded;
  std::atomic<int> refs{1};
  static void retain(void* p) { ++static_cast<SharedArgs*>(p)->refs; }
  static void release(void* p) {
    auto* s = static_cast<SharedArgs*>(p);
    if (--s->refs == 0) delete s;
  }
};

// Arguments for a plugin call: `view` borrows from `hold`, and the plugin may keep them past the
// call through retain/release instead of copying.
struct Shared {
  std::unique_ptr<SharedArgs, void (*)(SharedArgs*)> hold;
  twk_value_v1 view;
};

Shared share(Value v) {
  auto* s = new SharedArgs;
  s->value = std::move(v);
  Shared out{{s, [](SharedArgs* p) { SharedArgs::release(p); }}, {}};
  s->encoded = encode(s->value);
  out.view = *s->encoded.view();
  out.view.owner = s;
  out.view.retain = &SharedArgs::retain;
  out.view.release = &SharedArgs::release;
  return out;
}

class Worker {
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
      const char* shm_fd = std::getenv("TWINKLE_SHM_FD");
      link_ =
          transport::connect_local_worker(zmq_, o.endpoint, name_, shm_fd ? std::atoi(shm_fd) : -1);
    }
    host_.size = sizeof host_;
    host_.abi_version = TWK_ABI_VERSION;
    host_.log = &log_line;
    host_.comm_info = [](void* w, const char* dim, std::int32_t* rank, std::int32_t* size,
                         twk_sink_v1* err) {
      return static_cast<Worker*>(w)->collective(dim, err, "communicator",
                                                 [&](transport::Communicator& c) {
                                                   *rank = c.rank();
                                                   *size = c.size();
                                                 });
    };
    host_.all_reduce = [](void* w, const char* dim, void* data, std::uint64_t count,
                          std::int32_t dtype, std::int32_t op, twk_sink_v1* err) {
      return static_cast<Worker*>(w)->collective(
          dim, err, "all_reduce", [&](transport::Communicator& c) {
            c.all_reduce(data, count, checked_dtype(dtype), checked_op(op));
          });
    };
    host_.broadcast = [](void* w, const char* dim, void* data, std::uint64_t count,
                         std::int32_t dtype, std::int32_t root, twk_sink_v1* err) {
      return static_cast<Worker*>(w)->collective(
          dim, err, "broadcast", [&](transport::Communicator& c) {
            c.broadcast(data, count, checked_dtype(dtype), root);
          });
    };
    host_.all_gather = [](void* w, const char* dim, const void* in, void* out, std::uint64_t count,
                          std::int32_t dtype, twk_sink_v1* err) {
      return static_cast<Worker*>(w)->collective(
          dim, err, "all_gather",
          [&](transport::Communicator& c) { c.all_gather(in, out, count, checked_dtype(dtype)); });
    };
    host_.reduce_scatter = [](void* w, const char* dim, const void* in, void* out,
                              std::uint64_t count, std::int32_t dtype, std::int32_t op,
                              twk_sink_v1* err) {
      return static_cast<Worker*>(w)->collective(
          dim, err, "reduce_scatter", [&](transport::Communicator& c) {
            c.reduce_scatter(in, out, count, checked_dtype(dtype), checked_op(op));
          });
    };
    host_.barrier = [](void* w, const char* dim, twk_sink_v1* err) {
      return static_cast<Worker*>(w)->collective(dim, err, "barrier",
                                                 [&](transport::Communicator& c) { c.barrier(); });
    };
  }

  bool run() {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    send(MsgType::hello, 0,
         Value::map({{"name", name_},
                     {"group", group_},
                     {"rank", rank_},
                     {"pid", static_cast<int>(getpid())},
                     {"host", std::string(host)}}));
    auto welcome = link_->recv(std::chrono::seconds(60));
    if (!welcome || welcome->type != MsgType::welcome) {
      std::fprintf(stderr, "twinkle worker %s: no welcome from the driver at %s\n", name_.c_str(),
                   options_.endpoint.c_str());
      return false;
    }
    job_ = welcome->body["job"].as<std::string>();
    args_ = encode(welcome->body["args"]);
    mesh_ = std::make_unique<DeviceMesh>(mesh_from_value(welcome->body["mesh"]));
    mesh_abi_ = std::make_unique<MeshAbi>(*mesh_);
    device_ = welcome->body["device"].as<std::string>();
    kv_endpoint_ = welcome->body["kv"].as<std::string>();
    collectives_ = welcome->body["collectives"].as<std::string>();
    timeout_ = std::chrono::milliseconds(
        static_cast<std::int64_t>(welcome->body["timeout_s"].as<double>() * 1000));

    for (;;) {
      auto m = link_->recv(std::chrono::milliseconds(-1));
      if (!m) continue;
      switch (m->type) {
        case MsgType::create: create(*m); break;
        case MsgType::call: call(*m); break;
        case MsgType::comm_join: {
          Cross c;
          c.rank = m->body["rank"].as<int>();
          c.members = m->body["members"].as<std::vector<std::string>>();
          c.timeout = std::chrono::milliseconds(
              static_cast<std::int64_t>(m->body["timeout_s"].as<double>() * 1000));
          cross_[m->body["name"].as<std::string>()] = std::move(c);
          break;
        }
        case MsgType::shutdown:
          for (auto& [id, inst] : instances_) inst.cls->destruct(inst.self);
          instances_.clear();
          comms_.clear();
          return true;
        default:
          std::fprintf(stderr, "twinkle worker %s: unexpected %s message ignored\n", name_.c_str(),
                       transport::to_string(m->type));
      }
    }
  }

 private:
  struct Instance {
    const plugins::ClassInfo* cls;
    void* self;
  };
  // This worker's place in a communicator across groups (Driver::communicator).
  struct Cross {
    int rank = 0;
    std::vector<std::string> members;  // "group:index" by rank
    std::chrono::milliseconds timeout{0};
  };

  static DType checked_dtype(std::int32_t d) {
    if (!dtype_known(d)) throw ValueError("unknown dtype " + std::to_string(d));
    return static_cast<DType>(d);
  }
  static transport::ReduceOp checked_op(std::int32_t op) {
    if (op < TWK_REDUCE_SUM || op > TWK_REDUCE_MIN)
      throw ValueError("unknown reduce op " + std::to_string(op));
    return static_cast<transport::ReduceOp>(op);
  }

  // The communicator of `dim` ("" = the group), made on first use: its members are the ranks that
  // share every other mesh coordinate, and its store keys are named after the group, the
  // dimension and the sub-group's index so that every member finds the same ones.
  // A communicator across groups: every member first says it joined, so that one that never
  // does is named (instead of a rendezvous key nobody recognises).
  void join(const std::string& name, const Cross& c, transport::CommConfig& config) {
    config.name = "cross/" + name;
    config.rank = c.rank;
    config.size = static_cast<int>(c.members.size());
    config.timeout = c.timeout;
    kv_->set(fmt::format("{}/joined/{}", config.name, c.rank), "1");
    const auto deadline = std::chrono::steady_clock::now() + c.timeout;
    std::vector<std::string> missing;
    for (int r = 0; r < config.size; ++r) {
      // Past the deadline a member that did join still answers within a round trip.
      const auto left = std::max(std::chrono::milliseconds(500),
                                 std::chrono::duration_cast<std::chrono::milliseconds>(
                                     deadline - std::chrono::steady_clock::now()));
      try {
        kv_->get(fmt::format("{}/joined/{}", config.name, r), left);
      } catch (const TransportError&) {
        missing.push_back(fmt::format("rank {} ({})", r, c.members[static_cast<std::size_t>(r)]));
      }
    }
    if (!missing.empty()) {
      throw TransportError(fmt::format(
          "communicator {}: {} never joined within {:g} s; every member must make the same "
          "collective calls on it",
          name, fmt::join(missing, ", "), static_cast<double>(c.timeout.count()) / 1000.0));
    }
  }

  transport::Communicator& comm(const std::string& dim) {
    if (auto it = comms_.find(dim); it != comms_.end()) return *it->second;
    transport::CommConfig config;
    config.timeout = timeout_;
    if (!node_ip_.empty()) config.host = node_ip_;
    if (!kv_) kv_ = std::make_unique<transport::KvClient>(zmq_, kv_endpoint_, security_);
    if (auto cross = cross_.find(dim); cross != cross_.end()) {
      join(dim, cross->second, config);
    } else if (dim.empty()) {
      config.name = fmt::format("{}/all", group_);
      config.rank = rank_;
      config.size = world_;
    } else {
      if (dim != "ep" && !DeviceMesh::is_known_dim(dim)) {
        throw ValueError(fmt::format(
            "no mesh dimension \"{}\" (known: pp, dp, fsdp, cp, tp, ep; this group's mesh "
            "is {}), nor a communicator across groups that this worker is in",
            dim, mesh_->dimensions_text(true)));
      }
      const auto groups = mesh_->groups(dim);
      for (std::size_t i = 0; i < groups.size(); ++i) {
        auto at = std::find(groups[i].begin(), groups[i].end(), rank_);
        if (at == groups[i].end()) continue;
        config.name = fmt::format("{}/{}/{}", group_, dim, i);
        config.rank = static_cast<int>(at - groups[i].begin());
        config.size = static_cast<int>(groups[i].size());
      }
    }
    std::unique_ptr<transport::Communicator> c;
    if (device_ == "cuda") {
      c = transport::create_nccl_communicator(*kv_, config);
    } else if (collectives_ == "gloo") {
      c = transport::create_gloo_communicator(*kv_, config);
    } else {
      // Every member takes the same branch: they all see the same host ids.
      const bool local = transport::members_share_host(*kv_, config);
      if (local) {
        c = transport::create_shm_communicator(*kv_, config);
      } else if (collectives_ == "shm") {
        throw TransportError(fmt::format(
            "collectives = \"shm\" but the members of {} are on more than one host; use \"auto\" "
            "or \"gloo\"",
            config.name));
      } else {
        c = transport::create_gloo_communicator(*kv_, config);
      }
    }
    return *comms_.emplace(dim, std::move(c)).first->second;
  }

  template <class F>
  std::int32_t collective(const char* dim_c, twk_sink_v1* err, const char* op, F&& f) {
    const std::string dim = dim_c ? dim_c : "";
    try {
      f(comm(dim));
      return TWK_OK;
    } catch (const std::exception& e) {
      const std::string msg =
          cross_.count(dim) ? fmt::format("{} communicator {} failed on {}:{}: {}",
                                          std::string_view(op) == "communicator" ? "joining" : op,
                                          dim, group_, rank_, e.what())
                            : fmt::format("{} over group {}{} failed on rank {}: {}", op, group_,
                                          dim.empty() ? "" : " (dim " + dim + ")", rank_, e.what());
      if (err && err->set_error) err->set_error(err->target, msg.c_str());
      return TWK_ERROR;
    }
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
    c.host_ctx = const_cast<Worker*>(this);
    return c;
  }

  void send(MsgType t, std::uint64_t id, Value body) {
    link_->send(Message{t, id, std::move(body)});
  }

  void create(const Message& m) {
    const std::string cls_name = m.body["class"].as<std::string>();
    const plugins::ClassInfo* cls = plugin_.find_class(cls_name);
    if (!cls) {
      send(MsgType::created, m.id,
           Value::map({{"ok", false}, {"error", "the worker's plugin has no class " + cls_name}}));
      return;
    }
    Shared args = share(m.body["args"]);
    twk_context_v1 ctx = context();
    SinkCapture err;
    twk_sink_v1 sink = err.sink();
    void* self = nullptr;
    if (cls->construct(&host_, &ctx, &args.view, &self, &sink) != TWK_OK) {
      send(MsgType::created, m.id,
           Value::map({{"ok", false}, {"error", err.error.value_or("constructor failed")}}));
      return;
    }
    instances_[m.id] = Instance{cls, self};
    send(MsgType::created, m.id, Value::map({{"ok", true}}));
  }

  void call(Message& m) {
    auto reply_error = [&](const std::string& e) {
      send(MsgType::reply, m.id, Value::map({{"ok", false}, {"error", e}}));
    };
    auto it = instances_.find(m.body["instance"].as<std::uint64_t>());
    if (it == instances_.end()) return reply_error("no such instance on this worker");
    const std::string method = m.body["method"].as<std::string>();
    const plugins::MethodInfo* mi = it->second.cls->find_method(method);
    if (!mi)
      return reply_error("class " + it->second.cls->name + " has no remote method " + method);

    // Moved out of the message so that the arguments die with `args.hold` (below), before the
    // reply.
    Shared args = share(std::move(m.body["args"]));
    m.body.map_items().erase("args");
    twk_context_v1 ctx = context();
    SinkCapture out;
    out.adopt = [this](const twk_value_v1& v) { return link_->adopt(v); };
    twk_sink_v1 sink = out.sink();
    std::int32_t rc = mi->invoke(it->second.self, &host_, &ctx, &args.view, &sink);
    // Shared-memory arguments the plugin did not keep are released now, so that the reply can
    // tell the driver it may reuse them.
    args.hold.reset();
    if (rc != TWK_OK || out.error)
      return reply_error(out.error.value_or("the method failed without a message"));
    send(MsgType::reply, m.id, Value::map({{"ok", true}, {"value", out.value.value_or(Value())}}));
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
  std::map<std::uint64_t, Instance> instances_;
  std::string kv_endpoint_;
  std::string collectives_ = "auto";  // "auto" | "shm" | "gloo" for cpu groups
  std::chrono::milliseconds timeout_{600'000};
  std::unique_ptr<transport::KvClient> kv_;
  std::map<std::string, std::unique_ptr<transport::Communicator>> comms_;
  std::map<std::string, Cross> cross_;  // communicators across groups, by name
  transport::SocketSecurity security_;  // remote workers: the run's keys
  std::string node_ip_;                 // remote workers: where peers reach this node
};

}  // namespace

bool run_worker(const WorkerOptions& o) {
  if (!o.run_dir.empty()) {
    const std::string files[3] = {(o.run_dir / "ctl").string(), (o.run_dir / "kv").string(),
                                  (o.run_dir / "driver").string()};
    for (int i = 0; i < 3; ++i)
      std::snprintf(g_run_files[i], sizeof g_run_files[i], "%s", files[i].c_str());
    std::snprintf(g_run_dir, sizeof g_run_dir, "%s", o.run_dir.c_str());
  }
  struct sigaction sa {};
  sa.sa_handler = &on_driver_death;
  sigaction(SIGHUP, &sa, nullptr);
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
