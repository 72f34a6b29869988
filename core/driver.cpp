#include "core/driver.hpp"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <thread>

#include <fmt/format.h>
#include <zmq.hpp>

#include "core/dispatch.hpp"
#include "core/error.hpp"
#include "core/launcher.hpp"
#include "core/notify.hpp"
#include "core/placement.hpp"
#include "core/topology.hpp"
#include "core/values.hpp"
#include "plugins/loader.hpp"
#include "transports/zmq/kv.hpp"
#include "transports/zmq/message.hpp"

extern char** environ;

namespace twinkle::core {

namespace {

using Clock = std::chrono::steady_clock;
using transport::Message;
using transport::MsgType;

std::string make_run_id() {
  std::random_device rd;
  return fmt::format("{:08x}", rd());
}

// A free TCP port on loopback for each group's MASTER_PORT; the sockets stay open until all
// are chosen so that the ports are distinct.
std::vector<int> free_ports(std::size_t n) {
  std::vector<int> fds, ports;
  for (std::size_t i = 0; i < n; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      throw Error("cannot find a free port on 127.0.0.1 for MASTER_PORT");
    }
    fds.push_back(fd);
    ports.push_back(ntohs(a.sin_port));
  }
  for (int fd : fds) close(fd);
  return ports;
}

std::filesystem::path self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw Error("cannot find the twinkle binary (/proc/self/exe) to start workers");
  return p;
}

struct WorkerRef {
  std::string name;  // "model:3"
  std::size_t group = 0;
  int index = 0;
  int pid = 0;
  std::string host;
  bool ready = false;
};

struct GroupRuntime {
  const GroupSpec* spec = nullptr;
  std::unique_ptr<MeshAbi> mesh_abi;
  std::vector<std::size_t> workers;  // into JobRun::workers_, by index in the group
};

struct InstanceState {
  const plugins::ClassInfo* cls = nullptr;
  std::size_t group = 0;
  std::map<int, std::optional<std::string>> acks;  // worker index -> error (nullopt: ok)
};

struct CallState {
  std::string what;    // "Model.train_step"
  std::string caller;  // "train.cpp:42"
  std::size_t group = 0;
  const plugins::MethodInfo* method = nullptr;
  std::vector<int> workers;
  std::vector<std::optional<Value>> results;
  std::map<int, std::string> errors;  // position -> message
  std::size_t answered = 0;
  double timeout_s = 0;
  Clock::time_point deadline;
  bool released = false;
};

std::atomic<bool> g_stop_signals{false};

class JobRun {
 public:
  JobRun(const RunOptions& o) : options_(o) {}
  ~JobRun() { cleanup(); }

  int run() {
    job_ = load_job(options_.job_file, options_.overrides);
    if (job_.mode == Mode::remote) {
      throw ConfigError(
          fmt::format("{}: mode = \"remote\" needs a cluster, which this twinkle cannot run yet; "
                      "use mode = \"local\"",
                      job_.file.string()));
    }
    collectives_ = collectives_backend(job_, std::getenv("TWINKLE_COLLECTIVES"));
    local_ = discover_local(options_.gpus);
    placement_ = place(job_, local_);
    std::fputs(render_topology(job_, placement_, {options_.ascii}).c_str(), stdout);
    std::fflush(stdout);

    plugin_.emplace(plugins::Plugin::load(job_.plugin_path));
    driver_fn_ = plugin_->find_driver(job_.driver);
    if (!driver_fn_) {
      std::string names;
      for (const auto& d : plugin_->drivers()) names += (names.empty() ? "" : ", ") + d.name;
      throw PluginError(fmt::format(
          "{}: plugin has no driver entry \"{}\" (it has: {}); declare TWINKLE_DRIVER({}, "
          "twinkle::Driver& d) or set job.driver",
          job_.plugin_path.string(), job_.driver, names.empty() ? "none" : names, job_.driver));
    }

    start_signal_thread();
    start_workers();
    if (!wait_for_hello()) return finish(false, "");

    twk_host_v1 host = host_table();
    EncodedValue args = encode(to_value(job_.args));
    twk_context_v1 ctx{};
    ctx.size = sizeof ctx;
    ctx.rank = -1;
    ctx.world_size = static_cast<std::int32_t>(workers_.size());
    ctx.job = job_.name.c_str();
    ctx.group = "";
    ctx.device = "";
    ctx.args = args.view();
    ctx.host_ctx = this;
    std::string job_dir = std::filesystem::absolute(job_.file).parent_path().string();
    ctx.job_dir = job_dir.c_str();
    std::string error;
    twk_sink_v1 sink{&error, nullptr,
                     [](void* t, const char* m) { *static_cast<std::string*>(t) = m ? m : ""; }};
    const bool ok = driver_fn_(&host, &ctx, &sink) == TWK_OK && !launcher_->failed();
    if (!ok && error.empty() && launcher_->failed()) error = "a worker died";
    return finish(ok, error);
  }

 private:
  // ----- start-up ---------------------------------------------------------------------------

  void start_workers() {
    run_id_ = make_run_id();
    const char* tmp = std::getenv("TMPDIR");
    std::string templ =
        fmt::format("{}/twinkle-run.{}.XXXXXX", tmp && *tmp ? tmp : "/tmp", run_id_);
    if (!mkdtemp(templ.data()))
      throw Error(fmt::format("cannot create the run directory {}", templ));
    run_dir_ = templ;
    endpoint_ = "ipc://" + (run_dir_ / "ctl").string();
    router_ = std::make_unique<zmq::socket_t>(zmq_, zmq::socket_type::router);
    router_->set(zmq::sockopt::linger, 0);
    router_->set(zmq::sockopt::router_mandatory, 1);
    // No high-water marks: a driver that sends many calls before reading replies must not block
    // on a worker that blocks on its replies (a deadlock).
    router_->set(zmq::sockopt::sndhwm, 0);
    router_->set(zmq::sockopt::rcvhwm, 0);
    router_->bind(endpoint_);
    kv_ = std::make_unique<transport::KvServer>(zmq_, "ipc://" + (run_dir_ / "kv").string());

    LaunchOptions lo;
    lo.log_dir = options_.log_dir;
    lo.quiet = options_.quiet;
    launcher_ = std::make_unique<LocalLauncher>(lo);

    std::vector<std::string> base_env;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      static const char* kOwned[] = {
          "RANK=",       "LOCAL_RANK=",  "WORLD_SIZE=",  "LOCAL_WORLD_SIZE=",
          "GROUP_RANK=", "MASTER_ADDR=", "MASTER_PORT=", "TWINKLE_"};
      bool owned = false;
      for (const char* k : kOwned) owned |= kv.starts_with(k);
      if (!owned) base_env.push_back(kv);
    }
    const bool has_omp = std::getenv("OMP_NUM_THREADS") != nullptr;
    const std::string exe = self_exe().string();
    const std::vector<int> ports = free_ports(placement_.groups.size());

    std::vector<WorkerSpec> specs;
    for (std::size_t gi = 0; gi < placement_.groups.size(); ++gi) {
      const auto& gp = placement_.groups[gi];
      GroupRuntime gr;
      gr.spec = gp.group;
      gr.mesh_abi = std::make_unique<MeshAbi>(gp.group->mesh);
      for (const auto& w : gp.workers) {
        WorkerRef ref;
        ref.name = fmt::format("{}:{}", gp.group->name, w.index);
        ref.group = gi;
        ref.index = w.index;
        identities_[ref.name] = workers_.size();
        gr.workers.push_back(workers_.size());
        WorkerSpec spec;
        spec.name = ref.name;
        spec.argv = {exe,         "worker",         "--endpoint",
                     endpoint_,   "--plugin",       job_.plugin_path.string(),
                     "--run-dir", run_dir_.string()};
        spec.env = base_env;
        const int n = gp.group->workers();
        auto set = [&](const std::string& k, const std::string& v) {
          std::erase_if(spec.env, [&](const std::string& kv) { return kv.starts_with(k + "="); });
          spec.env.push_back(k + "=" + v);
        };
        set("RANK", std::to_string(w.index));
        set("LOCAL_RANK", std::to_string(w.index));
        set("WORLD_SIZE", std::to_string(n));
        set("LOCAL_WORLD_SIZE", std::to_string(n));
        set("GROUP_RANK", std::to_string(w.node));
        set("MASTER_ADDR", "127.0.0.1");
        set("MASTER_PORT", std::to_string(ports[gi]));
        set("TWINKLE_GROUP", gp.group->name);
        set("TWINKLE_WORKER_NAME", ref.name);
        set("TWINKLE_GLOBAL_RANK", std::to_string(w.rank));
        set("TWINKLE_MODE", std::string(to_string(job_.mode)));
        set("TWINKLE_SEED", std::to_string(job_.seed));
        set("TWINKLE_RUN_ID", run_id_);
        // cuda workers see the physical GPUs placed for them; cpu workers see none.
        std::string ids;
        for (int g : w.gpus) ids += (ids.empty() ? "" : ",") + std::to_string(g);
        set("CUDA_VISIBLE_DEVICES", ids);
        if (!has_omp) set("OMP_NUM_THREADS", "1");
        specs.push_back(std::move(spec));
        workers_.push_back(std::move(ref));
      }
      groups_.push_back(std::move(gr));
    }
    launcher_->start(specs);
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      channels_.push_back(
          std::make_unique<transport::ShmChannel>(launcher_->take_channel(i), &shm_pool_));
    }
  }

  bool wait_for_hello() {
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    std::size_t ready = 0;
    while (ready < workers_.size()) {
      if (launcher_->failed()) {
        startup_error_ = "a worker ended before it was ready";
        return false;
      }
      if (Clock::now() > deadline) {
        std::string missing;
        for (const auto& w : workers_) {
          if (!w.ready) missing += (missing.empty() ? "" : ", ") + w.name;
        }
        startup_error_ = fmt::format("workers {} did not start within 60 s", missing);
        return false;
      }
      std::string from;
      auto m = recv(100, &from);
      if (!m || m->type != MsgType::hello) continue;
      auto& w = workers_[identities_.at(from)];
      if (!w.ready) ++ready;
      w.ready = true;
      w.pid = m->body["pid"].as<int>();
      w.host = m->body["host"].as<std::string>();
    }
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      const auto& gr = groups_[workers_[i].group];
      send(i, MsgType::welcome, 0,
           Value::map({{"job", job_.name},
                       {"args", to_value(job_.args)},
                       {"mesh", mesh_to_value(gr.spec->mesh)},
                       {"device", std::string(to_string(gr.spec->device))},
                       {"kv", kv_->endpoint()},
                       {"collectives", collectives_},
                       {"timeout_s", job_.timeout_s}}));
    }
    return true;
  }

  // ----- messages ---------------------------------------------------------------------------

  transport::ChannelOf channel_of() {
    return [this](const std::string& identity) -> transport::ShmChannel* {
      auto it = identities_.find(identity);
      return it == identities_.end() ? nullptr : channels_[it->second].get();
    };
  }

  std::optional<Message> recv(int timeout_ms, std::string* from) {
    try {
      return transport::recv_message(*router_, timeout_ms, from, channel_of());
    } catch (const TransportError& e) {
      std::fprintf(stderr, "twinkle: dropped a message: %s\n", e.what());
      return std::nullopt;
    }
  }

  void send(std::size_t worker, MsgType t, std::uint64_t id, Value body) {
    transport::send_message(*router_, Message{t, id, std::move(body)}, &workers_[worker].name,
                            channels_[worker].get());
  }

  // Handles one incoming message, if one arrives within `timeout_ms`.
  void pump(int timeout_ms) {
    std::string from;
    auto m = recv(timeout_ms, &from);
    if (!m) return;
    auto it = identities_.find(from);
    if (it == identities_.end()) return;
    const WorkerRef& w = workers_[it->second];
    if (m->body.contains("shm_released")) {
      for (const auto& id : m->body["shm_released"]) shm_pool_.released(id.as<std::uint64_t>());
    }
    switch (m->type) {
      case MsgType::created: {
        auto inst = instances_.find(m->id);
        if (inst == instances_.end()) break;
        std::optional<std::string> err;
        if (!m->body["ok"].as<bool>()) err = m->body["error"].as<std::string>();
        inst->second.acks[w.index] = err;
        break;
      }
      case MsgType::reply: {
        auto c = calls_.find(m->id);
        if (c == calls_.end()) break;
        CallState& cs = c->second;
        auto pos = std::find(cs.workers.begin(), cs.workers.end(), w.index) - cs.workers.begin();
        if (pos >= static_cast<long>(cs.workers.size()) || cs.results[pos] || cs.errors.count(pos))
          break;
        if (m->body["ok"].as<bool>()) {
          cs.results[pos] = m->body["value"];
        } else {
          cs.errors[pos] = m->body["error"].as<std::string>();
        }
        ++cs.answered;
        if (cs.released && cs.answered == cs.workers.size()) calls_.erase(c);
        break;
      }
      default: break;
    }
  }

  std::string worker_label(std::size_t group, int index) const {
    const WorkerRef& w = workers_[groups_[group].workers[index]];
    return fmt::format("group {} rank {} (host {}, pid {})", groups_[group].spec->name, index,
                       w.host, w.pid);
  }

  std::string death_text() const {
    auto f = launcher_->failure();
    if (!f) return "a worker died";
    std::string host = local_.hostname;
    if (auto it = identities_.find(f->name);
        it != identities_.end() && !workers_[it->second].host.empty()) {
      host = workers_[it->second].host;
    }
    std::string s =
        fmt::format("worker {} (host {}, pid {}) {}", f->name, host, f->pid, f->describe());
    if (!f->last_stderr.empty()) {
      s += "; its last stderr lines:";
      for (const auto& l : f->last_stderr) s += "\n    | " + l;
    }
    return s;
  }

  // ----- host operations (the plugin's driver entry calls these) ----------------------------

  twk_host_v1 host_table() {
    twk_host_v1 h{};
    h.size = sizeof h;
    h.abi_version = TWK_ABI_VERSION;
    h.log = [](void*, std::int32_t level, const char* m) {
      std::FILE* out = level >= TWK_LOG_WARN ? stderr : stdout;
      std::fprintf(out, "%s\n", m);
      std::fflush(out);
    };
    h.create = [](void* c, const char* cls, const char* group, const twk_value_v1* args,
                  std::uint64_t* handle, twk_sink_v1* err) {
      return static_cast<JobRun*>(c)->create(cls, group, args, handle, err);
    };
    h.call = [](void* c, std::uint64_t handle, const char* method, const twk_value_v1* args,
                const char* file, std::uint32_t line, std::uint64_t* future, twk_sink_v1* err) {
      return static_cast<JobRun*>(c)->call(handle, method, args, file, line, future, err);
    };
    h.wait = [](void* c, std::uint64_t future, twk_sink_v1* out) {
      return static_cast<JobRun*>(c)->wait(future, out);
    };
    h.release = [](void* c, std::uint64_t future) { static_cast<JobRun*>(c)->release(future); };
    return h;
  }

  static std::int32_t fail(twk_sink_v1* sink, const std::string& message) {
    if (sink && sink->set_error) sink->set_error(sink->target, message.c_str());
    return TWK_ERROR;
  }

  std::int32_t create(const char* cls_name, const char* group_name, const twk_value_v1* args,
                      std::uint64_t* handle, twk_sink_v1* err) {
    try {
      const plugins::ClassInfo* cls = plugin_->find_class(cls_name);
      if (!cls) {
        std::string names;
        for (const auto& c : plugin_->classes()) names += (names.empty() ? "" : ", ") + c.name;
        return fail(
            err,
            fmt::format(
                "create: the plugin has no class {} (it has: {}); declare it with TWINKLE_CLASS",
                cls_name, names.empty() ? "none" : names));
      }
      std::size_t gi = groups_.size();
      for (std::size_t i = 0; i < groups_.size(); ++i) {
        if (groups_[i].spec->name == group_name) gi = i;
      }
      if (gi == groups_.size()) {
        std::string names;
        for (const auto& g : groups_) names += (names.empty() ? "" : ", ") + g.spec->name;
        return fail(err, fmt::format("create {}: the job has no group \"{}\" (it has: {}); see {}",
                                     cls_name, group_name, names, job_.file.string()));
      }
      const std::uint64_t id = ++next_id_;
      Value a = decode(*args);
      InstanceState& inst = instances_[id];
      inst.cls = cls;
      inst.group = gi;
      for (std::size_t w : groups_[gi].workers)
        send(w, MsgType::create, id, Value::map({{"class", cls->name}, {"args", a}}));
      const auto deadline = Clock::now() + std::chrono::duration<double>(job_.timeout_s);
      while (inst.acks.size() < groups_[gi].workers.size()) {
        if (launcher_->failed())
          return fail(err, fmt::format("{} constructor: {}", cls->name, death_text()));
        if (Clock::now() > deadline) {
          return fail(err, fmt::format("{} constructor on group {} timed out after {:g} s",
                                       cls->name, group_name, job_.timeout_s));
        }
        pump(50);
      }
      for (const auto& [index, e] : inst.acks) {
        if (e)
          return fail(err, fmt::format("{} constructor failed on {}: {}", cls->name,
                                       worker_label(gi, index), *e));
      }
      *handle = id;
      return TWK_OK;
    } catch (const std::exception& e) {
      return fail(err, e.what());
    }
  }

  std::int32_t call(std::uint64_t handle, const char* method_name, const twk_value_v1* args,
                    const char* file, std::uint32_t line, std::uint64_t* future, twk_sink_v1* err) {
    try {
      auto inst = instances_.find(handle);
      if (inst == instances_.end()) return fail(err, "unknown instance handle");
      const plugins::ClassInfo* cls = inst->second.cls;
      const plugins::MethodInfo* m = cls->find_method(method_name);
      if (!m) {
        std::string names;
        for (const auto& mm : cls->methods) names += (names.empty() ? "" : ", ") + mm.name;
        return fail(
            err,
            fmt::format("no remote method {} (class {} has: {}); declare it with TWINKLE_METHOD",
                        method_name, cls->name, names.empty() ? "none" : names));
      }
      if (launcher_->failed())
        return fail(err, fmt::format("{}.{}: {}", cls->name, m->name, death_text()));
      const std::size_t gi = inst->second.group;
      const DeviceMesh& mesh = groups_[gi].spec->mesh;
      const std::string what = fmt::format("{}.{}", cls->name, m->name);
      // Large tensors go straight into shared memory: their slices are then passed to the
      // workers without another copy.
      Value a = transport::decode_to_shm(*args, &shm_pool_);

      CallState cs;
      cs.what = what;
      cs.caller =
          fmt::format("{}:{}", std::filesystem::path(file ? file : "?").filename().string(), line);
      cs.group = gi;
      cs.method = m;
      cs.workers = executing_workers(m->execute, mesh);
      std::vector<Value> per_worker;
      if (m->execute == Execute::first) {
        per_worker.assign(cs.workers.size(), a);
      } else if (m->dispatch == Dispatch::custom) {
        auto fn = plugin_->find_dispatcher(m->custom_dispatch);
        EncodedValue ea = encode(a);
        for (std::size_t i = 0; i < cs.workers.size(); ++i) {
          SinkCapture got;
          twk_sink_v1 sink = got.sink(/*to_shm=*/true);
          if (fn(static_cast<std::int32_t>(cs.workers.size()), static_cast<std::int32_t>(i),
                 groups_[gi].mesh_abi->view(), ea.view(), &sink) != TWK_OK ||
              !got.value) {
            return fail(err, fmt::format("{}: custom dispatch {} failed for worker {}: {}", what,
                                         m->custom_dispatch, i, got.error.value_or("no value")));
          }
          per_worker.push_back(std::move(*got.value));
        }
      } else {
        per_worker = dispatch_args(m->dispatch, a, mesh, cs.workers, what);
      }
      cs.results.resize(cs.workers.size());
      cs.timeout_s = m->timeout_s > 0 ? m->timeout_s : job_.timeout_s;
      cs.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(cs.timeout_s));
      const std::uint64_t id = ++next_id_;
      for (std::size_t i = 0; i < cs.workers.size(); ++i) {
        send(groups_[gi].workers[cs.workers[i]], MsgType::call, id,
             Value::map(
                 {{"instance", handle}, {"method", m->name}, {"args", std::move(per_worker[i])}}));
      }
      calls_.emplace(id, std::move(cs));
      *future = id;
      return TWK_OK;
    } catch (const std::exception& e) {
      // dispatch_args names the call itself.
      return fail(err, e.what());
    }
  }

  std::int32_t wait(std::uint64_t future, twk_sink_v1* out) {
    auto it = calls_.find(future);
    if (it == calls_.end()) return fail(out, "unknown or already collected call");
    const std::string prefix =
        fmt::format("[twinkle driver caller: {}] {}", it->second.caller, it->second.what);
    try {
      while (it->second.answered < it->second.workers.size()) {
        if (launcher_->failed()) {
          std::string msg = fmt::format("{} failed: {}", prefix, death_text());
          calls_.erase(it);
          return fail(out, msg);
        }
        if (Clock::now() > it->second.deadline) {
          std::string missing;
          for (std::size_t i = 0; i < it->second.workers.size(); ++i) {
            if (!it->second.results[i] && !it->second.errors.count(i)) {
              missing += (missing.empty() ? "" : ", ") + std::to_string(it->second.workers[i]);
            }
          }
          std::string msg = fmt::format(
              "{} timed out after {:g} s: ranks [{}] of group {} did not answer; raise the "
              "method's timeout "
              "(twinkle::timeout in TWINKLE_METHOD) or job.timeout_s",
              prefix, it->second.timeout_s, missing, groups_[it->second.group].spec->name);
          it->second.released = true;  // late answers are dropped
          return fail(out, msg);
        }
        pump(20);
        it = calls_.find(future);
      }
      CallState cs = std::move(it->second);
      calls_.erase(it);
      if (!cs.errors.empty()) {
        auto [pos, e] = *cs.errors.begin();
        std::string msg =
            fmt::format("{} failed on {}: {}", prefix, worker_label(cs.group, cs.workers[pos]), e);
        if (cs.errors.size() > 1) {
          std::string others;
          for (const auto& [p, _] : cs.errors) {
            if (p != pos) others += (others.empty() ? "" : ", ") + std::to_string(cs.workers[p]);
          }
          msg += fmt::format(" (ranks {} failed too)", others);
        }
        return fail(out, msg);
      }
      std::vector<Value> results;
      for (auto& r : cs.results) results.push_back(std::move(*r));
      Value collected;
      if (cs.method->collect == Collect::custom) {
        auto fn = plugin_->find_collector(cs.method->custom_collect);
        std::vector<EncodedValue> enc;
        for (const auto& r : results) enc.push_back(encode(r));
        std::vector<twk_value_v1> views;
        for (auto& e : enc) views.push_back(*e.view());
        SinkCapture got;
        twk_sink_v1 sink = got.sink();
        if (fn(views.data(), static_cast<std::uint32_t>(views.size()),
               groups_[cs.group].mesh_abi->view(), &sink) != TWK_OK ||
            !got.value) {
          return fail(out, fmt::format("{}: custom collect {} failed: {}", prefix,
                                       cs.method->custom_collect, got.error.value_or("no value")));
        }
        collected = std::move(*got.value);
      } else {
        collected = collect_results(cs.method->collect, std::move(results),
                                    groups_[cs.group].spec->mesh, cs.workers, cs.what);
      }
      EncodedValue e = encode(collected);
      if (out && out->set_value) out->set_value(out->target, e.view());
      return TWK_OK;
    } catch (const std::exception& e) {
      return fail(out, fmt::format("{}: {}", prefix, e.what()));
    }
  }

  void release(std::uint64_t future) {
    auto it = calls_.find(future);
    if (it == calls_.end()) return;
    if (it->second.answered == it->second.workers.size()) {
      calls_.erase(it);
    } else {
      it->second.released = true;
    }
  }

  // ----- the end ----------------------------------------------------------------------------

  void start_signal_thread() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    g_stop_signals = false;
    signal_thread_ = std::thread([this, set] {
      timespec tick{0, 100'000'000};
      while (!g_stop_signals) {
        int sig = sigtimedwait(&set, nullptr, &tick);
        if (sig <= 0) continue;
        // The driver entry may be deep in plugin code that never returns to us: stop everything
        // from here and leave at once.
        std::fflush(stdout);
        if (launcher_) launcher_->kill_and_reap();
        std::error_code ec;
        if (!run_dir_.empty()) std::filesystem::remove_all(run_dir_, ec);
        std::fprintf(stderr, "\ntwinkle: interrupted by %s; stopped all workers\n",
                     sig == SIGINT    ? "SIGINT"
                     : sig == SIGTERM ? "SIGTERM"
                                      : "SIGHUP");
        std::fflush(stderr);
        _exit(sig == SIGINT ? kExitInterrupted : 128 + sig);
      }
    });
  }

  int finish(bool ok, const std::string& driver_error) {
    if (ok) {
      launcher_->expect_exits();
      for (std::size_t i = 0; i < workers_.size(); ++i) {
        try {
          send(i, MsgType::shutdown, 0, Value());
        } catch (const zmq::error_t&) {
          // Already gone: the launcher reports it.
        }
      }
      launcher_->stop(std::chrono::seconds(10));
      cleanup();
      return kExitOk;
    }
    // Root cause first: a dead worker explains the errors that followed it.
    std::string summary = fmt::format("twinkle: job \"{}\" failed (run {})\n", job_.name, run_id_);
    std::string first;
    if (launcher_->failed()) {
      first = death_text();
      summary += "  root cause: " + first + "\n";
      // The driver's error usually repeats the death; show it only when it says something else.
      if (!driver_error.empty() && driver_error.find(first) == std::string::npos) {
        summary += "  then the driver: " + driver_error + "\n";
      }
    } else {
      first = driver_error.empty() ? startup_error_ : driver_error;
      summary += "  root cause: " + first + "\n";
    }
    launcher_->stop(std::chrono::milliseconds(0));
    std::fflush(stdout);
    std::fputs(summary.c_str(), stderr);
    std::fflush(stderr);
    if (job_.notify) notify_failure(*job_.notify, job_.name, run_id_, first);
    cleanup();
    return kExitJobFailed;
  }

  void cleanup() {
    if (launcher_) launcher_->stop(std::chrono::milliseconds(0));
    router_.reset();
    kv_.reset();
    if (!run_dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(run_dir_, ec);
      run_dir_.clear();
    }
    if (signal_thread_.joinable()) {
      g_stop_signals = true;
      signal_thread_.join();
    }
  }

  RunOptions options_;
  Job job_;
  std::string collectives_;  // the cpu groups' backend, TWINKLE_COLLECTIVES applied
  NodeResources local_;
  Placement placement_;
  std::optional<plugins::Plugin> plugin_;
  twk_driver_fn driver_fn_ = nullptr;
  std::string run_id_;
  std::filesystem::path run_dir_;
  std::string endpoint_;
  zmq::context_t zmq_;
  std::unique_ptr<zmq::socket_t> router_;
  std::unique_ptr<transport::KvServer> kv_;
  std::unique_ptr<LocalLauncher> launcher_;
  std::vector<WorkerRef> workers_;
  transport::ShmPool shm_pool_;  // before the channels, which point to it
  std::vector<std::unique_ptr<transport::ShmChannel>> channels_;  // by worker
  std::vector<GroupRuntime> groups_;
  std::map<std::string, std::size_t> identities_;
  std::map<std::uint64_t, InstanceState> instances_;
  std::map<std::uint64_t, CallState> calls_;
  std::uint64_t next_id_ = 0;
  std::string startup_error_;
  std::thread signal_thread_;
};

}  // namespace

int run_job(const RunOptions& options) {
  JobRun run(options);
  return run.run();
}

}  // namespace twinkle::core
