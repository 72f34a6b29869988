#include "core/cluster/remote_site.hpp"

#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/cluster/agent.hpp"
#include "core/cluster/head_link.hpp"
#include "core/job/values.hpp"
#include "core/runtime/log_dir.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core::cluster {

namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kRequestTimeout = std::chrono::seconds(10);
constexpr auto kLaunchTimeout = std::chrono::seconds(60);
// How long the agents have, beyond the grace, to say their workers are stopped.
constexpr auto kStopSlack = std::chrono::seconds(5);

std::string owner_name() {
  const passwd* pw = getpwuid(getuid());
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return fmt::format("{}@{}", pw ? pw->pw_name : std::to_string(getuid()), host);
}

class ClusterLauncher;

std::string driver_identity() {
  std::random_device rd;
  return fmt::format("driver/{:08x}{:08x}", rd(), rd());
}

class ClusterSite : public RemoteSite {
 public:
  ClusterSite(const std::string& address, const transport::SocketSecurity& security)
      : security_(security), link_(address, security_, driver_identity()) {}

  ~ClusterSite() override {
    if (!run_.empty()) link_.post(Message{MsgType::release, 0, Value::map({{"run", run_}})});
    link_.stop(std::chrono::milliseconds(1000));
  }

  std::optional<Placement> reserve(const Job& job, const std::string& run_id,
                                   const Wait& wait) override {
    const auto deadline = Clock::now() + std::chrono::milliseconds(
                                             static_cast<std::int64_t>(job.queue_timeout_s * 1000));
    std::string last_holders;
    for (;;) {
      Message r =
          link_.request(Message{MsgType::reserve, ++request_id_, demand(job, run_id, false)},
                        MsgType::reservation, kRequestTimeout);
      if (r.body["ok"].as<bool>()) {
        run_ = run_id;
        link_.start([this](Message& m) { on_message(m); },
                    [this]() -> std::optional<Message> {
                      return Message{MsgType::lease, 0, Value::map({{"run", run_}})};
                    });
        return to_placement(job, r.body);
      }
      const std::string message = r.body["message"].as<std::string>();
      if (r.body["kind"].as<std::string>() == "infeasible") {
        throw ConfigError(fmt::format("{}: the job cannot run on the cluster at {}: {}",
                                      job.file.string(), link_.address(), message));
      }
      const std::string holders = r.body["holders"].as<std::string>();
      if (Clock::now() >= deadline) {
        throw Error(fmt::format(
            "gave up waiting for devices after {:g} s (job.queue_timeout_s): {}; held by {}",
            job.queue_timeout_s, message, holders));
      }
      if (holders != last_holders) {
        std::fprintf(stderr,
                     "twinkle: waiting for devices on the cluster at %s: %s; held by %s (up to "
                     "%g s, job.queue_timeout_s)\n",
                     link_.address().c_str(), message.c_str(), holders.c_str(),
                     job.queue_timeout_s);
        std::fflush(stderr);
        last_holders = holders;
      }
      if (!wait(std::chrono::milliseconds(500))) return std::nullopt;
    }
  }

  Placement plan(const Job& job) override {
    Message r = link_.request(Message{MsgType::reserve, ++request_id_, demand(job, "plan", true)},
                              MsgType::reservation, kRequestTimeout);
    if (!r.body["ok"].as<bool>()) {
      const bool busy = r.body["kind"].as<std::string>() == "busy";
      throw ConfigError(
          fmt::format("{}: the job {} on the cluster at {}: {}{}", job.file.string(),
                      busy ? "does not fit now" : "cannot run", link_.address(),
                      r.body["message"].as<std::string>(),
                      busy ? "; held by " + r.body["holders"].as<std::string>() : std::string()));
    }
    return to_placement(job, r.body);
  }

  std::string driver_address() const override { return link_.local_address(); }
  bool secure() const override { return security_.secure(); }

  std::unique_ptr<Launcher> launcher(const Job& job, const Placement& placement, Launch launch,
                                     transport::DriverChannel& channel) override;

  // The launcher of the run, which takes the messages of the run's agents.
  void attach(ClusterLauncher* l) {
    std::lock_guard lock(mu_);
    launcher_ = l;
  }
  HeadLink& link() { return link_; }
  const std::string& run() const { return run_; }

 private:
  Value demand(const Job& job, const std::string& run_id, bool dry_run) const {
    Value groups = Value::list();
    for (const auto& g : job.groups) {
      groups.push_back(
          Value::map({{"name", g.name},
                      {"workers", g.workers()},
                      {"gpus_per_worker", g.device == DeviceType::cuda ? g.gpus_per_worker : 0},
                      {"strategy", std::string(to_string(g.placement.value_or(job.placement)))},
                      {"labels", labels_to_value(g.labels)}}));
    }
    return Value::map({{"run", run_id},
                       {"job", job.name},
                       {"owner", owner_name()},
                       {"dry_run", dry_run},
                       {"groups", groups}});
  }

  static Placement to_placement(const Job& job, const Value& reply) {
    Placement p;
    std::map<std::string, int> index;
    const Value& where = reply["nodes"];
    for (std::size_t gi = 0; gi < job.groups.size(); ++gi) {
      GroupPlacement gp;
      gp.group = &job.groups[gi];
      const Value& slots = reply["groups"].list_items().at(gi);
      for (std::size_t wi = 0; wi < slots.list_items().size(); ++wi) {
        const Value& s = slots.list_items()[wi];
        const std::string node = s["node"].as<std::string>();
        auto [it, fresh] = index.emplace(node, static_cast<int>(p.nodes.size()));
        if (fresh) {
          NodeSlot slot;
          slot.id = node;
          slot.address = where[node]["address"].as<std::string>();
          slot.host = fmt::format("{} {}", node, slot.address);
          p.nodes.push_back(std::move(slot));
        }
        WorkerPlacement w;
        w.rank = gp.group->ranks.at(wi);
        w.index = static_cast<int>(wi);
        w.node = it->second;
        w.gpus = s["gpus"].as<std::vector<int>>();
        gp.workers.push_back(std::move(w));
      }
      p.groups.push_back(std::move(gp));
    }
    return p;
  }

  void on_message(Message& m);

  transport::SocketSecurity security_;
  HeadLink link_;
  std::uint64_t request_id_ = 0;
  std::string run_;
  std::mutex mu_;
  ClusterLauncher* launcher_ = nullptr;
};

// Starts a run's workers through the agents of its nodes and turns what they report (exits,
// output, a dead node) into what the driver expects of a launcher.
class ClusterLauncher : public Launcher {
 public:
  ClusterLauncher(ClusterSite& site, const Job& job, const Placement& placement,
                  RemoteSite::Launch launch, transport::DriverChannel& channel)
      : site_(site), job_(job.name), launch_(std::move(launch)), channel_(channel) {
    for (const auto& gp : placement.groups) {
      for (const auto& w : gp.workers) {
        names_.push_back(fmt::format("{}:{}", gp.group->name, w.index));
        peer_node_.push_back(placement.nodes.at(w.node).id);
        gpus_[placement.nodes.at(w.node).id];
        auto& g = gpus_[placement.nodes.at(w.node).id];
        g.insert(g.end(), w.gpus.begin(), w.gpus.end());
      }
    }
    for (const auto& n : placement.nodes) nodes_.push_back(n.id);
    sha_ = file_sha256(launch_.plugin);
    if (launch_.log_dir) {
      // Every worker's file from the start, as in local mode: an unwritable one stops the run
      // before a worker starts.
      logs_.emplace(*launch_.log_dir);
      for (const auto& name : names_) log_files_.push_back(logs_->open(name));
    }
    site_.attach(this);
  }

  ~ClusterLauncher() override {
    stop(std::chrono::milliseconds(0));
    site_.attach(nullptr);
  }

  void start(const std::vector<WorkerLaunch>& workers) override {
    for (const auto& node : nodes_) {
      Value list = Value::list();
      int cpus = 0;
      for (std::size_t i = 0; i < workers.size(); ++i) {
        if (peer_node_[i] != node) continue;
        list.push_back(Value::map({{"name", workers[i].name}, {"env", Value(workers[i].env)}}));
        ++cpus;
      }
      Value body = Value::map({{"run", site_.run()},
                               {"node", node},
                               {"job", job_},
                               {"owner", owner_name()},
                               {"sha256", sha_},
                               {"endpoint", launch_.endpoint},
                               {"gpus", Value(gpus_[node])},
                               {"cpus", cpus},
                               {"workers", list}});
      if (launch_.worker.secure()) {
        body["keys"] = Value::map({{"public", launch_.worker.keys->public_key},
                                   {"secret", launch_.worker.keys->secret_key},
                                   {"server", launch_.worker.server_key}});
      }
      site_.link().post(Message{MsgType::launch, 0, std::move(body)});
    }
    std::unique_lock lock(mu_);
    const bool all = cv_.wait_for(lock, kLaunchTimeout, [this] {
      return !launch_error_.empty() || launched_.size() + dead_.size() >= nodes_.size();
    });
    if (!launch_error_.empty()) throw Error(launch_error_);
    if (!all) {
      std::vector<std::string> missing;
      for (const auto& n : nodes_) {
        if (!launched_.count(n)) missing.push_back(n);
      }
      throw Error(fmt::format("node(s) {} did not start their workers within {} s",
                              fmt::join(missing, ", "), kLaunchTimeout.count()));
    }
  }

  void expect_exits() override { expecting_ = true; }

  std::vector<std::string> stop(std::chrono::milliseconds grace) override {
    {
      std::lock_guard lock(mu_);
      if (stop_sent_) return {};
      stop_sent_ = true;
    }
    expecting_ = true;
    for (const auto& node : nodes_) post_stop(node, grace);
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, grace + kStopSlack, [this] {
      for (const auto& n : nodes_) {
        if (!stopped_.count(n) && !dead_.count(n)) return false;
      }
      return true;
    });
    return signalled_;
  }

  void kill_now() const noexcept override {
    for (const auto& node : nodes_) post_stop(node, std::chrono::milliseconds(0));
  }

  void on_message(Message& m) {
    switch (m.type) {
      case MsgType::need_plugin: send_plugin(m.body["node"].as<std::string>()); break;
      case MsgType::launched: {
        std::lock_guard lock(mu_);
        const std::string node = m.body["node"].as<std::string>();
        if (m.body["ok"].as<bool>()) {
          launched_.insert(node);
        } else if (launch_error_.empty()) {
          launch_error_ = fmt::format("node {} could not start its workers: {}", node,
                                      m.body["error"].as<std::string>());
        }
        cv_.notify_all();
        break;
      }
      case MsgType::stopped: {
        std::lock_guard lock(mu_);
        stopped_.insert(m.body["node"].as<std::string>());
        for (const auto& n : m.body["signalled"]) signalled_.push_back(n.as<std::string>());
        cv_.notify_all();
        break;
      }
      case MsgType::output: output(m.body); break;
      case MsgType::worker_exit: worker_exit(m.body); break;
      case MsgType::node_dead: node_dead(m.body); break;
      default: break;
    }
  }

 private:
  void post_stop(const std::string& node, std::chrono::milliseconds grace) const {
    site_.link().post(
        Message{MsgType::stop_job, 0,
                Value::map({{"run", site_.run()},
                            {"node", node},
                            {"grace_ms", static_cast<std::int64_t>(grace.count())}})});
  }

  void send_plugin(const std::string& node) {
    if (!plugin_bytes_) {
      std::ifstream in(launch_.plugin, std::ios::binary);
      auto data = std::make_shared<std::vector<char>>((std::istreambuf_iterator<char>(in)),
                                                      std::istreambuf_iterator<char>());
      plugin_bytes_ = Tensor::view(DType::u8, {static_cast<std::int64_t>(data->size())},
                                   data->data(), data->size(), data);
    }
    site_.link().post(Message{
        MsgType::plugin, 0,
        Value::map(
            {{"run", site_.run()}, {"node", node}, {"sha256", sha_}, {"bytes", *plugin_bytes_}})});
  }

  std::size_t peer_of(const std::string& name) const {
    return static_cast<std::size_t>(std::find(names_.begin(), names_.end(), name) - names_.begin());
  }

  void output(const Value& b) {
    const std::string name = b["name"].as<std::string>();
    const std::string line = b["line"].as<std::string>();
    const bool err = b["stream"].as<std::string>() == "stderr";
    if (const std::size_t peer = peer_of(name); logs_ && peer < log_files_.size())
      logs_->append(log_files_[peer], name, line);
    if (launch_.quiet) return;
    std::FILE* out = err ? stderr : stdout;
    std::fprintf(out, "[%s] %s\n", name.c_str(), line.c_str());
    std::fflush(out);
  }

  void worker_exit(const Value& b) {
    if (expecting_ || failed_.exchange(true)) return;
    const std::string name = b["name"].as<std::string>();
    std::string reason =
        fmt::format("{} on node {}", b["text"].as<std::string>(), b["node"].as<std::string>());
    std::fprintf(stderr, "twinkle: worker %s (node %s, pid %d) %s; stopping the other workers\n",
                 name.c_str(), b["node"].as<std::string>().c_str(), b["pid"].as<int>(),
                 b["text"].as<std::string>().c_str());
    std::fflush(stderr);
    kill_now();
    if (!b["stderr"].list_items().empty()) {
      reason += "; its last stderr lines:";
      for (const auto& l : b["stderr"]) reason += "\n    | " + l.as<std::string>();
    }
    channel_.lost(peer_of(name), std::move(reason));
  }

  void node_dead(const Value& b) {
    const std::string node = b["node"].as<std::string>();
    {
      std::lock_guard lock(mu_);
      dead_.insert(node);
      cv_.notify_all();
    }
    if (expecting_ || failed_.exchange(true)) return;
    std::vector<std::string> ranks;
    std::size_t first = names_.size();
    for (std::size_t i = 0; i < names_.size(); ++i) {
      if (peer_node_[i] != node) continue;
      ranks.push_back(names_[i]);
      first = std::min(first, i);
    }
    if (first == names_.size()) return;
    const std::string reason = fmt::format("its node {} ({}) is DEAD: {}; the ranks there were {}",
                                           node, b["host"].as<std::string>(),
                                           b["reason"].as<std::string>(), fmt::join(ranks, ", "));
    std::fprintf(stderr, "twinkle: node %s is DEAD (%s); lost worker(s) %s; stopping the others\n",
                 node.c_str(), b["reason"].as<std::string>().c_str(),
                 fmt::format("{}", fmt::join(ranks, ", ")).c_str());
    std::fflush(stderr);
    kill_now();
    channel_.lost(first, reason);
  }

  ClusterSite& site_;
  std::string job_;
  RemoteSite::Launch launch_;
  transport::DriverChannel& channel_;
  std::vector<std::string> names_;      // by peer
  std::vector<std::string> peer_node_;  // by peer: its node id
  std::vector<std::string> nodes_;
  std::map<std::string, std::vector<int>> gpus_;  // node -> the run's GPUs there
  std::string sha_;
  std::optional<Tensor> plugin_bytes_;
  std::optional<LogDir> logs_;
  std::vector<transport::Fd> log_files_;  // by peer
  std::atomic<bool> expecting_{false};
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<std::string> launched_, stopped_, dead_;
  std::string launch_error_;
  std::vector<std::string> signalled_;
  bool stop_sent_ = false;
};

std::unique_ptr<Launcher> ClusterSite::launcher(const Job& job, const Placement& placement,
                                                Launch launch, transport::DriverChannel& channel) {
  return std::make_unique<ClusterLauncher>(*this, job, placement, std::move(launch), channel);
}

void ClusterSite::on_message(Message& m) {
  std::lock_guard lock(mu_);
  if (launcher_) launcher_->on_message(m);
}

}  // namespace

std::unique_ptr<RemoteSite> connect_site(const std::string& address, const KeyOptions& keys) {
  return std::make_unique<ClusterSite>(address, member_security(keys, address));
}

std::unique_ptr<RemoteSite> connect_site(const std::string& address,
                                         const transport::SocketSecurity& security) {
  return std::make_unique<ClusterSite>(address, security);
}

}  // namespace twinkle::core::cluster
