#include "core/worker.hpp"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <zmq.hpp>

#include "core/error.hpp"
#include "core/values.hpp"
#include "plugins/loader.hpp"
#include "transports/zmq/message.hpp"

namespace twinkle::core {

namespace {

using transport::Message;
using transport::MsgType;

// For the parent-death handler: what to remove when the driver died without cleaning up.
char g_socket_path[4096];
char g_run_dir[4096];

extern "C" void on_driver_death(int) {
  // Only async-signal-safe calls. The launcher sets PR_SET_PDEATHSIG(SIGHUP) and stops workers
  // with SIGTERM/SIGKILL, so SIGHUP here means the driver died (even SIGKILLed) and left its run
  // directory behind: the workers remove it on their way out.
  if (g_socket_path[0]) unlink(g_socket_path);
  if (g_run_dir[0]) rmdir(g_run_dir);
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

struct Captured {
  std::optional<Value> value;
  std::optional<std::string> error;
  twk_sink_v1 sink() {
    return {this,
            [](void* t, const twk_value_v1* v) { static_cast<Captured*>(t)->value = decode(*v); },
            [](void* t, const char* m) { static_cast<Captured*>(t)->error = m ? m : ""; }};
  }
};

class Worker {
 public:
  Worker(const WorkerOptions& o, plugins::Plugin plugin)
      : options_(o), plugin_(std::move(plugin)), socket_(zmq_, zmq::socket_type::dealer) {
    name_ = env_str("TWINKLE_WORKER_NAME");
    group_ = env_str("TWINKLE_GROUP");
    rank_ = env_int("RANK", 0);
    world_ = env_int("WORLD_SIZE", 1);
    local_rank_ = env_int("LOCAL_RANK", rank_);
    local_world_ = env_int("LOCAL_WORLD_SIZE", world_);
    socket_.set(zmq::sockopt::routing_id, name_);
    socket_.set(zmq::sockopt::linger, 2000);
    socket_.connect(o.endpoint);
    host_.size = sizeof host_;
    host_.abi_version = TWK_ABI_VERSION;
    host_.log = &log_line;
  }

  int run() {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    send(MsgType::hello, 0,
         Value::map({{"name", name_},
                     {"group", group_},
                     {"rank", rank_},
                     {"pid", static_cast<int>(getpid())},
                     {"host", std::string(host)}}));
    auto welcome = transport::recv_message(socket_, 60'000);
    if (!welcome || welcome->type != MsgType::welcome) {
      std::fprintf(stderr, "twinkle worker %s: no welcome from the driver at %s\n", name_.c_str(),
                   options_.endpoint.c_str());
      return kExitJobFailed;
    }
    job_ = welcome->body["job"].as<std::string>();
    args_ = encode(welcome->body["args"]);
    mesh_ = std::make_unique<DeviceMesh>(mesh_from_value(welcome->body["mesh"]));
    mesh_abi_ = std::make_unique<MeshAbi>(*mesh_);
    device_ = welcome->body["device"].as<std::string>();

    for (;;) {
      auto m = transport::recv_message(socket_, -1);
      if (!m) continue;
      switch (m->type) {
        case MsgType::create: create(*m); break;
        case MsgType::call: call(*m); break;
        case MsgType::shutdown:
          for (auto& [id, inst] : instances_) inst.cls->destruct(inst.self);
          instances_.clear();
          return kExitOk;
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
    transport::send_message(socket_, Message{t, id, std::move(body)});
  }

  void create(const Message& m) {
    const std::string cls_name = m.body["class"].as<std::string>();
    const plugins::ClassInfo* cls = plugin_.find_class(cls_name);
    if (!cls) {
      send(MsgType::created, m.id,
           Value::map({{"ok", false}, {"error", "the worker's plugin has no class " + cls_name}}));
      return;
    }
    auto* shared = new SharedArgs;
    shared->value = m.body["args"];
    std::unique_ptr<SharedArgs, void (*)(SharedArgs*)> hold(
        shared, [](SharedArgs* s) { SharedArgs::release(s); });
    shared->encoded = encode(shared->value);
    twk_value_v1 args = *shared->encoded.view();
    args.owner = shared;
    args.retain = &SharedArgs::retain;
    args.release = &SharedArgs::release;
    twk_context_v1 ctx = context();
    Captured err;
    twk_sink_v1 sink = err.sink();
    void* self = nullptr;
    if (cls->construct(&host_, &ctx, &args, &self, &sink) != TWK_OK) {
      send(MsgType::created, m.id,
           Value::map({{"ok", false}, {"error", err.error.value_or("constructor failed")}}));
      return;
    }
    instances_[m.id] = Instance{cls, self};
    send(MsgType::created, m.id, Value::map({{"ok", true}}));
  }

  void call(const Message& m) {
    auto reply_error = [&](const std::string& e) {
      send(MsgType::reply, m.id, Value::map({{"ok", false}, {"error", e}}));
    };
    auto it = instances_.find(m.body["instance"].as<std::uint64_t>());
    if (it == instances_.end()) return reply_error("no such instance on this worker");
    const std::string method = m.body["method"].as<std::string>();
    const plugins::MethodInfo* mi = it->second.cls->find_method(method);
    if (!mi)
      return reply_error("class " + it->second.cls->name + " has no remote method " + method);

    auto* shared = new SharedArgs;
    shared->value = m.body["args"];
    std::unique_ptr<SharedArgs, void (*)(SharedArgs*)> hold(
        shared, [](SharedArgs* s) { SharedArgs::release(s); });
    shared->encoded = encode(shared->value);
    twk_value_v1 args = *shared->encoded.view();
    args.owner = shared;
    args.retain = &SharedArgs::retain;
    args.release = &SharedArgs::release;
    twk_context_v1 ctx = context();
    Captured out;
    twk_sink_v1 sink = out.sink();
    std::int32_t rc = mi->invoke(it->second.self, &host_, &ctx, &args, &sink);
    if (rc != TWK_OK || out.error)
      return reply_error(out.error.value_or("the method failed without a message"));
    send(MsgType::reply, m.id, Value::map({{"ok", true}, {"value", out.value.value_or(Value())}}));
  }

  WorkerOptions options_;
  plugins::Plugin plugin_;
  zmq::context_t zmq_;
  zmq::socket_t socket_;
  twk_host_v1 host_{};
  std::string name_, group_, job_, device_;
  int rank_ = 0, world_ = 1, local_rank_ = 0, local_world_ = 1;
  EncodedValue args_;
  std::unique_ptr<DeviceMesh> mesh_;
  std::unique_ptr<MeshAbi> mesh_abi_;
  std::map<std::uint64_t, Instance> instances_;
};

}  // namespace

int run_worker(const WorkerOptions& o) {
  if (o.endpoint.starts_with("ipc://")) {
    std::snprintf(g_socket_path, sizeof g_socket_path, "%s", o.endpoint.c_str() + 6);
  }
  std::snprintf(g_run_dir, sizeof g_run_dir, "%s", o.run_dir.c_str());
  struct sigaction sa {};
  sa.sa_handler = &on_driver_death;
  sigaction(SIGHUP, &sa, nullptr);

  plugins::Plugin plugin = plugins::Plugin::load(o.plugin);
  Worker w(o, std::move(plugin));
  return w.run();
}

}  // namespace twinkle::core
