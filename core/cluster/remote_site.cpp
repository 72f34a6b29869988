#include "core/cluster/remote_site.hpp"

#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
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
#include "core/job/digest.hpp"
#include "core/job/values.hpp"
#include "core/jobs/demand.hpp"
#include "core/runtime/log_dir.hpp"
#include "core/runtime/worker_env.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core::cluster {

namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kRequestTimeout = std::chrono::seconds(10);
constexpr auto kLaunchTimeout = std::chrono::seconds(60);
// How long the agents have, beyond the grace, to say their workers are stopped.
constexpr auto kStopSlack = std::chrono::seconds(5);

std::string owner_name() {
  // A submitted job's driver runs as the head's user for the one who submitted it.
  if (const char* user = std::getenv("TWINKLE_JOB_USER"); user && *user) return user;
  const passwd* pw = getpwuid(getuid());
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return fmt::format("{}@{}", pw ? pw->pw_name : std::to_string(getuid()), host);
}

class ClusterLauncher;

// The node `node` of the head's answer `reply`, with the address the answer gives it.
NodeSlot node_slot(const proto::Reservation& reply, const std::string& node, bool planned) {
  auto where = std::find_if(reply.nodes.begin(), reply.nodes.end(),
                            [&](const proto::NodeAddress& n) { return n.node == node; });
  if (where == reply.nodes.end())
    throw TransportError(
        fmt::format("the head placed a worker on node {} without its address", node));
  NodeSlot slot;
  slot.id = node;
  slot.address = where->address;
  slot.host = fmt::format("{} {}", node, slot.address);
  slot.planned = planned;
  return slot;
}

std::string driver_identity() {
  std::random_device rd;
  return fmt::format("driver/{:08x}{:08x}", rd(), rd());
}

class ClusterSite : public RemoteSite {
 public:
  ClusterSite(const std::string& address, const transport::SocketSecurity& security)
      : security_(security), link_(address, security_, driver_identity()) {}

  ~ClusterSite() override {
    if (!run_.empty()) link_.post(Message{0, proto::Release{run_, outcome_, restarts_.load()}});
    link_.stop(std::chrono::milliseconds(1000));
  }

  std::optional<Placement> reserve(const Job& job, const std::string& run_id,
                                   const Wait& wait) override {
    const auto deadline = Clock::now() + std::chrono::milliseconds(
                                             static_cast<std::int64_t>(job.queue_timeout_s * 1000));
    std::string last_holders;
    for (;;) {
      auto r = link_.request<proto::Reservation>(Message{++request_id_, demand(job, run_id, false)},
                                                 kRequestTimeout);
      if (r.ok) {
        run_ = run_id;
        link_.start([this](Message& m) { on_message(m); },
                    [this]() -> std::optional<Message> {
                      return Message{0, proto::Lease{run_, restarts_.load()}};
                    });
        return placement_of(job, r);
      }
      if (r.kind == "infeasible") {
        throw ConfigError(fmt::format("{}: the job cannot run on the cluster at {}: {}",
                                      job.file.string(), link_.address(), r.message));
      }
      if (Clock::now() >= deadline) {
        throw Error(fmt::format(
            "gave up waiting for devices after {:g} s (job.queue_timeout_s): {}; held by {}",
            job.queue_timeout_s, r.message, r.holders));
      }
      if (r.holders != last_holders) {
        std::fprintf(stderr,
                     "twinkle: waiting for devices on the cluster at %s: %s; held by %s (up to "
                     "%g s, job.queue_timeout_s)\n",
                     link_.address().c_str(), r.message.c_str(), r.holders.c_str(),
                     job.queue_timeout_s);
        std::fflush(stderr);
        last_holders = r.holders;
      }
      if (!wait(std::chrono::milliseconds(500))) return std::nullopt;
    }
  }

  Placement plan(const Job& job) override {
    auto r = link_.request<proto::Reservation>(Message{++request_id_, demand(job, "plan", true)},
                                               kRequestTimeout);
    if (!r.ok) {
      const bool busy = r.kind == "busy";
      throw ConfigError(fmt::format("{}: the job {} on the cluster at {}: {}{}", job.file.string(),
                                    busy ? "does not fit now" : "cannot run", link_.address(),
                                    r.message, busy ? "; held by " + r.holders : std::string()));
    }
    return placement_of(job, r, true);
  }

  std::string driver_address() const override { return link_.local_address(); }
  void ended(const std::string& outcome) override { outcome_ = outcome; }
  bool secure() const override { return security_.secure(); }

  std::unique_ptr<Launcher> launcher(const Job& job, const Placement& placement, Launch launch,
                                     transport::CallChannel& channel) override;

  // The launcher of the run, which takes the messages of the run's agents.
  void attach(ClusterLauncher* l) {
    std::lock_guard lock(mu_);
    launcher_ = l;
  }
  HeadLink& link() { return link_; }
  const std::string& run() const { return run_; }
  // One more group restart of the run (the next lease tells the head).
  void restarted() { ++restarts_; }
  // Room for workers whose node is DEAD, on other nodes (the head's answer).
  proto::Reservation relocate(proto::Relocate r) {
    r.run = run_;
    return link_.request<proto::Reservation>(Message{++request_id_, std::move(r)}, kRequestTimeout);
  }

 private:
  proto::Reserve demand(const Job& job, const std::string& run_id, bool dry_run) const {
    proto::Reserve r{run_id, job.name, owner_name(), dry_run, {}, {}};
    // A submitted job is known by the name it was submitted under.
    if (const char* name = std::getenv("TWINKLE_JOB_NAME"); name && *name) r.job = name;
    // The driver of a submitted job (docs/ARCHITECTURE.md, Job service): its reservation is the
    // job's.
    if (const char* id = std::getenv("TWINKLE_JOB_ID"); id && *id && !dry_run) {
      char* end = nullptr;
      const long long v = std::strtoll(id, &end, 10);
      if (end && *end == '\0' && v > 0) r.job_id = v;
    }
    r.groups = jobs::group_demands(job);
    return r;
  }

  void on_message(Message& m);

  transport::SocketSecurity security_;
  HeadLink link_;
  std::uint64_t request_id_ = 0;
  std::string run_;
  std::atomic<int> restarts_{0};        // its groups' restarts, which every lease says
  std::optional<std::string> outcome_;  // how the run ended, for the release
  std::mutex mu_;
  ClusterLauncher* launcher_ = nullptr;
};

// Starts a run's workers through the agents of its nodes and turns what they report (exits,
// output, a dead node) into what the driver expects of a launcher.
class ClusterLauncher : public Launcher {
 public:
  ClusterLauncher(ClusterSite& site, const Job& job, const Placement& placement,
                  RemoteSite::Launch launch, transport::CallChannel& channel)
      : site_(site),
        job_(job.name),
        launch_(std::move(launch)),
        channel_(channel),
        placement_(placement),
        demands_(jobs::group_demands(job)) {
    for (std::size_t gi = 0; gi < placement.groups.size(); ++gi) {
      const auto& gp = placement.groups[gi];
      for (std::size_t wi = 0; wi < gp.workers.size(); ++wi) {
        const auto& w = gp.workers[wi];
        names_.push_back(fmt::format("{}:{}", gp.group->name, w.index));
        where_.emplace_back(gi, wi);
        peer_node_.push_back(placement.nodes.at(w.node).id);
        auto& g = gpus_[placement.nodes.at(w.node).id];
        g.insert(g.end(), w.gpus.begin(), w.gpus.end());
      }
    }
    // Room for every node a worker may move to: kill_now() reads it from a signal handler, so it
    // never reallocates.
    nodes_.reserve(placement.nodes.size() + names_.size());
    for (const auto& n : placement.nodes) nodes_.push_back(n.id);
    exited_.assign(names_.size(), false);
    sha_ = sha256_file(launch_.plugin);
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
    launches_ = workers;
    std::vector<std::size_t> all(workers.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    launch(all, false);
  }

  void set_restartable(std::vector<bool> by_peer) override { restartable_ = std::move(by_peer); }

  // A group's restart on the nodes its workers ran on: the agents kill those that still run
  // (their exits are awaited, not reported), then start replacements, which connect to the
  // driver's channel under the same names. Workers whose node is DEAD start on another node that
  // the head gives the run (relocate()).
  std::string restart(const std::vector<std::size_t>& peers,
                      const std::vector<std::string>& env) override {
    std::map<std::string, std::vector<std::string>> running;  // node -> names to kill
    std::vector<std::size_t> moving;                          // on DEAD nodes
    {
      std::lock_guard lock(mu_);
      for (std::size_t p : peers) {
        if (dead_.count(peer_node_[p])) {
          moving.push_back(p);
        } else if (!exited_[p]) {
          replacing_.insert(p);
          running[peer_node_[p]].push_back(names_[p]);
        }
      }
    }
    const std::string where = moving.empty() ? std::string() : relocate(moving);
    if (!moving.empty()) readdress(peers);
    for (const auto& [node, names] : running) {
      proto::StopJob k{site_.run(), node, 0, {}};
      k.workers = names;
      site_.link().post(Message{0, std::move(k)});
    }
    {
      std::unique_lock lock(mu_);
      if (!cv_.wait_for(lock, kLaunchTimeout, [this] { return replacing_.empty(); })) {
        std::vector<std::string> left;
        for (std::size_t p : replacing_) left.push_back(names_[p]);
        throw Error(
            fmt::format("worker(s) {} did not exit within {} s of being killed for "
                        "their group's restart",
                        fmt::join(left, ", "), kLaunchTimeout.count()));
      }
    }
    for (std::size_t p : peers) {
      channel_.forget_lost(p);
      override_env(launches_.at(p).env, env);
    }
    launch(peers, true);
    site_.restarted();
    return where;
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
    if (auto* need = m.get<proto::NeedPlugin>()) {
      send_plugin(need->node);
    } else if (auto* launched = m.get<proto::Launched>()) {
      std::lock_guard lock(mu_);
      if (!launched->error) {
        launched_.insert(launched->node);
      } else if (launch_error_.empty()) {
        launch_error_ = fmt::format("node {} could not start its workers: {}", launched->node,
                                    *launched->error);
      }
      cv_.notify_all();
    } else if (auto* stopped = m.get<proto::Stopped>()) {
      std::lock_guard lock(mu_);
      stopped_.insert(stopped->node);
      signalled_.insert(signalled_.end(), stopped->signalled.begin(), stopped->signalled.end());
      cv_.notify_all();
    } else if (auto* out = m.get<proto::Output>()) {
      output(*out);
    } else if (auto* exit = m.get<proto::WorkerExit>()) {
      worker_exit(*exit);
    } else if (auto* dead = m.get<proto::NodeDead>()) {
      node_dead(*dead);
    }
  }

 private:
  // Asks the agents of `peers` to start them (into the run, where they run it already) and waits
  // until each of those nodes has.
  void launch(const std::vector<std::size_t>& peers, bool restart) {
    std::set<std::string> targets;
    {
      std::lock_guard lock(mu_);
      for (std::size_t p : peers) {
        targets.insert(peer_node_[p]);
        exited_[p] = false;
      }
      for (const auto& n : targets) launched_.erase(n);
    }
    for (const auto& node : targets) {
      proto::Launch l;
      l.run = site_.run();
      l.node = node;
      l.job = job_;
      l.owner = owner_name();
      l.sha256 = sha_;
      l.endpoint = launch_.endpoint;
      l.gpus = gpus_[node];
      l.restart = hosting_.count(node) > 0;
      for (std::size_t i = 0; i < names_.size(); ++i) {
        if (peer_node_[i] == node) ++l.cpus;  // what the run holds there, all of it
      }
      for (std::size_t p : peers) {
        if (peer_node_[p] != node) continue;
        const auto& w = launches_.at(p);
        l.workers.push_back(
            proto::LaunchWorker{w.name, w.env, static_cast<std::int64_t>(w.memory)});
      }
      if (launch_.worker.secure()) {
        l.keys = proto::RunKeys{launch_.worker.keys->public_key, launch_.worker.keys->secret_key,
                                launch_.worker.server_key};
      }
      site_.link().post(Message{0, std::move(l)});
    }
    std::unique_lock lock(mu_);
    auto done = [&] {
      return std::all_of(targets.begin(), targets.end(), [&](const std::string& n) {
        return launched_.count(n) > 0 || dead_.count(n) > 0;
      });
    };
    const bool all =
        cv_.wait_for(lock, kLaunchTimeout, [&] { return !launch_error_.empty() || done(); });
    if (!launch_error_.empty()) throw Error(launch_error_);
    if (!all) {
      std::vector<std::string> missing;
      for (const auto& n : targets) {
        if (!launched_.count(n)) missing.push_back(n);
      }
      throw Error(fmt::format("node(s) {} did not {} their workers within {} s",
                              fmt::join(missing, ", "), restart ? "restart" : "start",
                              kLaunchTimeout.count()));
    }
    hosting_.insert(targets.begin(), targets.end());
  }

  // Asks the head for room for `moving` (workers of one group whose node is DEAD) on other live
  // nodes, and starts them there from now on: their node, GPUs and the variables that depend on
  // where they run (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, CUDA_VISIBLE_DEVICES). Returns where,
  // for the driver's "back" line. Throws Error when the cluster has no room.
  std::string relocate(const std::vector<std::size_t>& moving) {
    const std::size_t gi = where_.at(moving.front()).first;
    GroupPlacement& gp = placement_.groups.at(gi);
    proto::Relocate ask;
    ask.groups.push_back(demands_.at(gi));
    ask.groups.back().workers = static_cast<int>(moving.size());
    ask.ranks.emplace_back();
    std::set<std::string> from;
    std::vector<std::string> names;
    for (std::size_t p : moving) {
      ask.ranks.back().push_back(gp.workers.at(where_[p].second).index);
      from.insert(peer_node_[p]);
      names.push_back(names_[p]);
    }
    // strict_spread: never on a node where another worker of the group runs.
    if (ask.groups.back().strategy == "strict_spread") {
      for (std::size_t p = 0; p < names_.size(); ++p) {
        if (where_[p].first == gi && !from.count(peer_node_[p]))
          ask.exclude.push_back(peer_node_[p]);
      }
    }
    const proto::Reservation r = site_.relocate(std::move(ask));
    if (!r.ok) {
      throw Error(fmt::format(
          "{} cannot start again: node {} is DEAD and the cluster has no room "
          "for {} elsewhere: {}{}",
          fmt::join(names, ", "), fmt::join(from, ", "), moving.size() == 1 ? "it" : "them",
          r.message, r.holders.empty() ? "" : "; held by " + r.holders));
    }
    if (r.groups.size() != 1 || r.groups[0].size() != moving.size())
      throw TransportError("the head answered a relocation with another number of workers");
    std::set<std::string> to;
    {
      std::lock_guard lock(mu_);
      for (std::size_t k = 0; k < moving.size(); ++k) {
        const std::size_t p = moving[k];
        const proto::SlotEntry& slot = r.groups[0][k];
        auto known = std::find_if(placement_.nodes.begin(), placement_.nodes.end(),
                                  [&](const NodeSlot& n) { return n.id == slot.node; });
        if (known == placement_.nodes.end()) {
          placement_.nodes.push_back(node_slot(r, slot.node, false));
          known = placement_.nodes.end() - 1;
          nodes_.push_back(slot.node);
        }
        WorkerPlacement& w = gp.workers.at(where_[p].second);
        auto& old = gpus_[peer_node_[p]];
        for (int g : w.gpus) old.erase(std::remove(old.begin(), old.end(), g), old.end());
        w.node = static_cast<int>(known - placement_.nodes.begin());
        w.gpus = slot.gpus;
        auto& now = gpus_[slot.node];
        now.insert(now.end(), slot.gpus.begin(), slot.gpus.end());
        peer_node_[p] = slot.node;
        to.insert(slot.node);
      }
    }
    // The variables that depend on where a worker runs, for the moving ones (LOCAL_WORLD_SIZE
    // counts the group's workers on their new node; the survivors keep what they started with).
    for (std::size_t p : moving) {
      const auto env = worker_env({}, placement_, gi, where_[p].second, Rendezvous{}, RunInfo{});
      std::vector<std::string> placed;
      for (const auto& kv : env) {
        for (const char* key :
             {"LOCAL_RANK=", "LOCAL_WORLD_SIZE=", "GROUP_RANK=", "CUDA_VISIBLE_DEVICES="}) {
          if (kv.starts_with(key)) placed.push_back(kv);
        }
      }
      override_env(launches_.at(p).env, placed);
    }
    const std::string text = fmt::format("{} on node {}: node {} is DEAD", fmt::join(names, ", "),
                                         fmt::join(to, ", "), fmt::join(from, ", "));
    std::fprintf(stderr, "twinkle: %s start on node %s (node %s is DEAD)\n",
                 fmt::format("{}", fmt::join(names, ", ")).c_str(),
                 fmt::format("{}", fmt::join(to, ", ")).c_str(),
                 fmt::format("{}", fmt::join(from, ", ")).c_str());
    std::fflush(stderr);
    return text;
  }

  // When every worker of a group restarts (restart = "group") and its rank 0 moved to another
  // node, their MASTER_ADDR becomes rank 0's new node, with a new MASTER_PORT, as at the start
  // (the old address may be the DEAD node). Survivors of restart = "worker" keep the variables
  // their processes started with, so then the replacements keep them too.
  void readdress(const std::vector<std::size_t>& peers) {
    const std::size_t gi = where_.at(peers.front()).first;
    Rendezvous r;
    std::string group;
    {
      std::lock_guard lock(mu_);
      const GroupPlacement& gp = placement_.groups.at(gi);
      if (peers.size() != gp.workers.size() || gp.workers.empty()) return;
      r = remote_rendezvous(placement_, gi);
      group = gp.group->name;
    }
    const std::string addr = "MASTER_ADDR=" + r.addr;
    const auto& env = launches_.at(peers.front()).env;
    if (r.addr.empty() || std::find(env.begin(), env.end(), addr) != env.end()) return;
    const std::string port = fmt::format("MASTER_PORT={}", r.port);
    for (std::size_t p : peers) override_env(launches_.at(p).env, {addr, port});
    std::fprintf(stderr, "twinkle: group %s's MASTER_ADDR is now %s (%s): its rank 0 moved\n",
                 group.c_str(), r.addr.c_str(), port.c_str());
    std::fflush(stderr);
  }

  void post_stop(const std::string& node, std::chrono::milliseconds grace) const {
    site_.link().post(Message{
        0, proto::StopJob{site_.run(), node, static_cast<std::int64_t>(grace.count()), {}}});
  }

  void send_plugin(const std::string& node) {
    if (!plugin_bytes_) {
      std::ifstream in(launch_.plugin, std::ios::binary);
      auto data = std::make_shared<std::vector<char>>((std::istreambuf_iterator<char>(in)),
                                                      std::istreambuf_iterator<char>());
      plugin_bytes_ = Tensor::view(DType::u8, {static_cast<std::int64_t>(data->size())},
                                   data->data(), data->size(), data);
    }
    site_.link().post(Message{0, proto::PluginBytes{site_.run(), node, sha_, *plugin_bytes_}});
  }

  std::size_t peer_of(const std::string& name) const {
    return static_cast<std::size_t>(std::find(names_.begin(), names_.end(), name) - names_.begin());
  }

  void output(const proto::Output& b) {
    const std::string& name = b.name;
    const std::string& line = b.line;
    const bool err = b.is_stderr;
    if (const std::size_t peer = peer_of(name); logs_ && peer < log_files_.size())
      logs_->append(log_files_[peer], name, line);
    if (launch_.quiet) return;
    std::FILE* out = err ? stderr : stdout;
    std::fprintf(out, "[%s] %s\n", name.c_str(), line.c_str());
    std::fflush(out);
  }

  void worker_exit(const proto::WorkerExit& b) {
    const std::size_t peer = peer_of(b.name);
    if (peer < names_.size()) {
      std::lock_guard lock(mu_);
      exited_[peer] = true;
      // Killed for its group's restart: awaited, not a loss.
      if (replacing_.erase(peer)) {
        cv_.notify_all();
        return;
      }
    }
    if (expecting_) return;
    std::string reason = fmt::format("{} on node {}", b.text, b.node);
    if (peer < restartable_.size() && restartable_[peer]) {
      // Its group may restart: the driver decides; the others go on meanwhile.
      std::fprintf(stderr, "twinkle: worker %s (node %s, pid %d) %s\n", b.name.c_str(),
                   b.node.c_str(), b.pid, b.text.c_str());
      std::fflush(stderr);
      if (!b.stderr_tail.empty()) {
        reason += "; its last stderr lines:";
        for (const auto& l : b.stderr_tail) reason += "\n    | " + l;
      }
      channel_.lost(peer, std::move(reason));
      return;
    }
    if (failed_.exchange(true)) return;
    std::fprintf(stderr, "twinkle: worker %s (node %s, pid %d) %s; stopping the other workers\n",
                 b.name.c_str(), b.node.c_str(), b.pid, b.text.c_str());
    std::fflush(stderr);
    kill_now();
    if (!b.stderr_tail.empty()) {
      reason += "; its last stderr lines:";
      for (const auto& l : b.stderr_tail) reason += "\n    | " + l;
    }
    channel_.lost(peer, std::move(reason));
  }

  // A node of the run is DEAD: its workers are lost. Where all of them belong to groups that
  // restart, each group's are reported as one loss (the driver restarts them elsewhere) and the
  // others go on; otherwise the run stops.
  void node_dead(const proto::NodeDead& b) {
    std::vector<std::size_t> there;
    bool restart = true;
    {
      std::lock_guard lock(mu_);
      dead_.insert(b.node);
      cv_.notify_all();
      for (std::size_t i = 0; i < names_.size(); ++i) {
        if (peer_node_[i] != b.node) continue;
        there.push_back(i);
        restart = restart && i < restartable_.size() && restartable_[i];
      }
    }
    if (expecting_ || there.empty()) return;
    std::vector<std::string> ranks;
    for (std::size_t i : there) ranks.push_back(names_[i]);
    const std::string reason = fmt::format("its node {} ({}) is DEAD: {}; the ranks there were {}",
                                           b.node, b.host, b.reason, fmt::join(ranks, ", "));
    if (restart && !failed_) {
      std::fprintf(stderr, "twinkle: node %s is DEAD (%s); lost worker(s) %s\n", b.node.c_str(),
                   b.reason.c_str(), fmt::format("{}", fmt::join(ranks, ", ")).c_str());
      std::fflush(stderr);
      std::map<std::size_t, std::vector<std::size_t>> by_group;
      {
        std::lock_guard lock(mu_);
        for (std::size_t i : there) {
          exited_[i] = true;  // nothing of it is left to kill
          by_group[where_[i].first].push_back(i);
        }
      }
      for (auto& [g, peers] : by_group) {
        const std::size_t first = peers.front();
        channel_.lost(first, reason, std::vector<std::size_t>(peers.begin() + 1, peers.end()));
      }
      return;
    }
    if (failed_.exchange(true)) return;
    const std::size_t first = there.front();
    std::fprintf(stderr, "twinkle: node %s is DEAD (%s); lost worker(s) %s; stopping the others\n",
                 b.node.c_str(), b.reason.c_str(),
                 fmt::format("{}", fmt::join(ranks, ", ")).c_str());
    std::fflush(stderr);
    kill_now();
    channel_.lost(first, reason);
  }

  ClusterSite& site_;
  std::string job_;
  RemoteSite::Launch launch_;
  transport::CallChannel& channel_;
  Placement placement_;  // where the workers run (relocate() moves those of DEAD nodes)
  std::vector<proto::GroupDemandEntry> demands_;            // by group: what it asks of a node
  std::vector<std::string> names_;                          // by peer
  std::vector<std::pair<std::size_t, std::size_t>> where_;  // by peer: its group, its worker
  std::vector<std::string> peer_node_;  // by peer: its node id (mu_ for writes off the driver)
  std::vector<WorkerLaunch> launches_;  // by peer: as start() got them, with restarts' variables
  std::vector<bool> restartable_;       // by peer: its group restarts (set_restartable)
  std::vector<bool> exited_;            // by peer: its process is known to have exited (mu_)
  std::set<std::size_t> replacing_;     // peers killed for a restart, exits awaited (mu_)
  std::vector<std::string> nodes_;
  std::map<std::string, std::vector<int>> gpus_;  // node -> the run's GPUs there
  std::string sha_;
  std::optional<Tensor> plugin_bytes_;
  std::optional<LogDir> logs_;
  std::vector<Fd> log_files_;  // by peer
  std::atomic<bool> expecting_{false};
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<std::string> launched_, stopped_, dead_;
  std::set<std::string> hosting_;  // nodes that run the run (started some of its workers)
  std::string launch_error_;
  std::vector<std::string> signalled_;
  bool stop_sent_ = false;
};

std::unique_ptr<Launcher> ClusterSite::launcher(const Job& job, const Placement& placement,
                                                Launch launch, transport::CallChannel& channel) {
  return std::make_unique<ClusterLauncher>(*this, job, placement, std::move(launch), channel);
}

void ClusterSite::on_message(Message& m) {
  std::lock_guard lock(mu_);
  if (launcher_) launcher_->on_message(m);
}

}  // namespace

Placement placement_of(const Job& job, const proto::Reservation& reply, bool planned) {
  if (reply.groups.size() != job.groups.size())
    throw TransportError(fmt::format("the head placed {} group(s) for a job of {}",
                                     reply.groups.size(), job.groups.size()));
  Placement p;
  std::map<std::string, int> index;
  for (std::size_t gi = 0; gi < job.groups.size(); ++gi) {
    GroupPlacement gp;
    gp.group = &job.groups[gi];
    const auto& slots = reply.groups[gi];
    if (slots.size() != gp.group->ranks.size())
      throw TransportError(fmt::format("the head placed {} worker(s) of group {} for {}",
                                       slots.size(), gp.group->name, gp.group->ranks.size()));
    for (std::size_t wi = 0; wi < slots.size(); ++wi) {
      const auto& sl = slots[wi];
      auto [it, fresh] = index.emplace(sl.node, static_cast<int>(p.nodes.size()));
      if (fresh) p.nodes.push_back(node_slot(reply, sl.node, planned));
      WorkerPlacement w;
      w.rank = gp.group->ranks.at(wi);
      w.index = static_cast<int>(wi);
      w.node = it->second;
      w.gpus = sl.gpus;
      gp.workers.push_back(std::move(w));
    }
    p.groups.push_back(std::move(gp));
  }
  return p;
}

std::unique_ptr<RemoteSite> connect_site(const std::string& address, const KeyOptions& keys) {
  return std::make_unique<ClusterSite>(address, member_security(keys, address));
}

std::unique_ptr<RemoteSite> connect_site(const std::string& address,
                                         const transport::SocketSecurity& security) {
  return std::make_unique<ClusterSite>(address, security);
}

}  // namespace twinkle::core::cluster
