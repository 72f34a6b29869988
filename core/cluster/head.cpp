#include "core/cluster/head.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "core/cluster/dashboard.hpp"
#include "core/cluster/scheduler.hpp"
#include "core/job/resources.hpp"
#include "core/job/unix_time.hpp"
#include "core/job/values.hpp"
#include "core/jobs/service.hpp"
#include "transports/zmq/auth.hpp"
#include "transports/zmq/message.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::core::cluster {

namespace {

using transport::MsgType;
using Message = transport::ClusterMessage;
namespace proto = transport::proto;
using Clock = std::chrono::steady_clock;

// A node silent this long is DEAD; so is a run whose driver stops renewing its lease.
constexpr auto kSilenceLimit = std::chrono::milliseconds(3000);
constexpr auto kTick = std::chrono::milliseconds(250);
// The job service looks at its drivers and its queue this often: a job ends or starts within it.
constexpr auto kJobTick = std::chrono::milliseconds(50);
// How long a dashboard request waits for the head's thread.
constexpr auto kAskTimeout = std::chrono::seconds(10);

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Node {
  std::string id, identity, host, address;
  int cpus = 0;
  std::int64_t memory = 0;
  std::vector<proto::GpuEntry> gpus;
  std::map<std::string, std::string> labels;
  bool alive = true;
  Clock::time_point last_seen = Clock::now();
  std::int64_t registered = 0;                // unix seconds
  std::map<int, proto::GpuUseEntry> gpu_use;  // by index, from the last heartbeat (NVML's)
  std::string isolation;                      // as it registered
  std::string users;                          // as it registered
};

struct Bundle {
  std::string node;
  std::vector<int> gpus;
  int cpus = 0;
  std::int64_t memory = 0;  // the memory limits of its workers
};

struct Run {
  std::string id, job, owner, driver;  // driver: its identity at the head ("" until known)
  // The member it runs for (its key's name; a submitted job's user): what its launches carry.
  std::string user;
  int restarts = 0;  // its groups' restarts so far, as its driver's lease said
  std::vector<Bundle> bundles;
  std::int64_t since = 0;
  Clock::time_point last_lease = Clock::now();
  // Learnt from the agents after a head restart (not reserved by this head): every node that
  // reports it adds its part.
  bool adopted = false;
  // Held by the job service for a submitted job whose driver is starting (not leased).
  std::int64_t hold_job = 0;
  // The CPU a submitted job's driver takes on the head's own node, while the job runs.
  bool driver_cpu = false;
};

// What `slots` (of `demands`, in order) take of each node, by node id: a CPU per worker, the
// workers' GPUs and their memory limits.
std::vector<Bundle> bundles_of(const std::vector<std::vector<Slot>>& slots,
                               const std::vector<GroupDemand>& demands) {
  std::map<std::string, Bundle> per_node;
  for (std::size_t g = 0; g < slots.size(); ++g) {
    for (const auto& sl : slots[g]) {
      Bundle& bu = per_node[sl.node];
      bu.node = sl.node;
      bu.cpus += 1;
      bu.memory += demands.at(g).memory;
      bu.gpus.insert(bu.gpus.end(), sl.gpus.begin(), sl.gpus.end());
    }
  }
  std::vector<Bundle> out;
  for (auto& [id, bu] : per_node) out.push_back(std::move(bu));
  return out;
}

// How long a hold waits for its job's driver to reserve.
constexpr auto kHoldLimit = std::chrono::seconds(120);

std::string hold_id(std::int64_t job) { return fmt::format("job-{}-starting", job); }
std::string driver_id(std::int64_t job) { return fmt::format("job-{}-driver", job); }

// The label every node carries in the scheduler's eyes (not in its own table): its id, so that
// a demand can name one node.
constexpr const char* kNodeLabel = "twinkle/node";

// Whether node `n`'s agent keeps memory limits (it registered with cgroups).
bool enforces_memory(const Node& n) { return n.isolation.rfind("cgroup", 0) == 0; }

std::vector<GroupDemand> to_demands(const std::vector<proto::GroupDemandEntry>& groups) {
  std::vector<GroupDemand> demands;
  for (const auto& g : groups) {
    GroupDemand d;
    d.name = g.name;
    d.workers = g.workers;
    d.gpus_per_worker = g.gpus_per_worker;
    d.strategy = placement_strategy(g.strategy).value_or(PlacementStrategy::pack);
    d.labels = g.labels;
    d.memory = g.memory;
    demands.push_back(std::move(d));
  }
  return demands;
}

}  // namespace

struct Head::State {
  HeadOptions options;
  zmq::context_t context;
  std::unique_ptr<transport::KeyGate> gate;
  zmq::socket_t router{context, zmq::socket_type::router};
  std::unique_ptr<transport::ConnectionWatch> watch;
  std::string endpoint;
  std::map<std::string, Node> nodes;
  std::vector<std::string> order;  // node ids in the order they first registered
  std::map<std::string, Run> runs;
  transport::DropLog drops{"the head's socket", [this](const std::string& line) { log(line); }};
  std::unique_ptr<jobs::JobService> jobs;

  // What the dashboard's threads ask of this one (ask()): queued, and `wake` (an eventfd) rings.
  struct Ask {
    jobs::Caller caller;
    Message m;
    std::promise<std::optional<Message>> answer;
  };
  std::mutex asks_mu;
  std::deque<std::shared_ptr<Ask>> asks;
  bool closing = false;             // under asks_mu: the head stops, asks get no answer
  std::atomic<bool> reload{false};  // reload_quotas() asked; `wake` rang
  Fd wake;
  std::unique_ptr<Dashboard> dashboard;

  void log(const std::string& line) const {
    if (options.log) options.log(line);
  }

  // The team of member `user` (its allow-list line's team=); "default" without one, and on a
  // cluster without keys.
  std::string team_of(const std::string& user) const {
    auto t = options.security.teams.find(user);
    return t == options.security.teams.end() ? "default" : t->second;
  }

  // A submitted job's driver speaks for the job's user.
  jobs::Caller caller(const std::string& key_name, const std::string& from) const {
    std::string user = key_name;
    if (auto job = jobs::driver_job(key_name); job && jobs) user = jobs->user_of(*job).value_or("");
    return jobs::Caller{user, options.security.admins.count(user) > 0, from, team_of(user)};
  }

  static bool for_jobs(Message& m) {
    return m.get<proto::UploadCheck>() || m.get<proto::UploadPart>() || m.get<proto::Submit>() ||
           m.get<proto::JobsQuery>() || m.get<proto::LogsQuery>() || m.get<proto::JobStop>() ||
           m.get<proto::JobResume>() || m.get<proto::QuotasQuery>();
  }

  void send(const std::string& to, const Message& m) {
    if (to.empty()) return;
    try {
      transport::send_message(router, m, &to);
    } catch (const zmq::error_t&) {
      // Gone since: it re-registers or times out.
    }
  }

  Node* node_by_identity(const std::string& identity) {
    for (auto& [id, n] : nodes) {
      if (n.identity == identity) return &n;
    }
    return nullptr;
  }

  // ----- resources ----------------------------------------------------------------------------

  std::vector<NodeCapacity> capacity(bool free) const {
    std::vector<NodeCapacity> out;
    for (const auto& id : order) {
      const Node& n = nodes.at(id);
      if (!n.alive) continue;
      NodeCapacity c;
      c.id = id;
      c.cpus = n.cpus;
      // Workers with a memory limit go only where cgroups enforce it.
      c.memory = enforces_memory(n) ? std::max<std::int64_t>(n.memory, 0) : 0;
      c.labels = n.labels;
      c.labels[kNodeLabel] = id;
      for (const auto& g : n.gpus) c.gpus.push_back(g.index);
      if (free) {
        for (const auto& [rid, r] : runs) {
          for (const auto& b : r.bundles) {
            if (b.node != id) continue;
            c.cpus -= b.cpus;
            if (c.memory >= 0) c.memory = std::max<std::int64_t>(0, c.memory - b.memory);
            for (int g : b.gpus)
              c.gpus.erase(std::remove(c.gpus.begin(), c.gpus.end(), g), c.gpus.end());
          }
        }
      }
      out.push_back(std::move(c));
    }
    return out;
  }

  // The live nodes, for "does not fit" messages; with each node's memory and whether it keeps
  // memory limits when `demands` ask for any.
  std::string cluster_text(const std::vector<GroupDemand>& demands = {}) const {
    const bool memory = std::any_of(demands.begin(), demands.end(),
                                    [](const GroupDemand& d) { return d.memory > 0; });
    std::vector<std::string> parts;
    for (const auto& id : order) {
      const Node& n = nodes.at(id);
      if (!n.alive) continue;
      std::string labels;
      for (const auto& [k, v] : n.labels)
        labels += fmt::format("{}{}={}", labels.empty() ? "" : ",", k, v);
      std::string mem;
      if (memory) {
        mem = fmt::format(
            ", {}{}", format_bytes(static_cast<std::uint64_t>(std::max<std::int64_t>(n.memory, 0))),
            enforces_memory(n) ? "" : " but no memory limits (no cgroups)");
      }
      parts.push_back(fmt::format("{} ({} CPUs, {} GPUs{}{})", id, n.cpus, n.gpus.size(), mem,
                                  labels.empty() ? "" : ", labels " + labels));
    }
    if (parts.empty())
      return "the cluster has no live node (start agents with `twinkle node start --address ...`)";
    return fmt::format("the cluster has {} live node{}: {}", parts.size(),
                       parts.size() == 1 ? "" : "s", fmt::join(parts, ", "));
  }

  // ----- messages -----------------------------------------------------------------------------

  void on_register(const std::string& from, proto::NodeRegister& b) {
    const std::string id = b.node;
    auto it = nodes.find(id);
    if (it != nodes.end() && it->second.alive && it->second.identity != from &&
        seconds_since(it->second.last_seen) < 1.0) {
      send(from, Message{0, proto::NodeWelcome{fmt::format("node id \"{}\" is taken by a live "
                                                           "node at {}; give this one another "
                                                           "--node-id",
                                                           id, it->second.address)}});
      log(fmt::format("refused a second node \"{}\" (the first is at {})", id, it->second.address));
      return;
    }
    const bool known = it != nodes.end();
    Node& n = nodes[id];
    if (!known) order.push_back(id);
    n.id = id;
    n.identity = from;
    n.host = std::move(b.host);
    n.address = std::move(b.address);
    n.cpus = b.cpus;
    n.memory = b.memory;
    n.gpus = std::move(b.gpus);
    n.labels = std::move(b.labels);
    n.isolation = std::move(b.isolation);
    n.users = std::move(b.users);
    n.alive = true;
    n.last_seen = Clock::now();
    n.registered = unix_now();
    // The jobs it still runs: a restarted head adopts them; those released meanwhile (the node
    // was cut off and declared dead) are stopped.
    std::vector<std::string> adopted;
    for (auto& j : b.jobs) {
      Bundle bundle{id, j.gpus, j.cpus, j.memory};
      auto r = runs.find(j.run);
      if (r == runs.end()) {
        Run& nr = runs[j.run];
        nr.id = j.run;
        nr.job = j.job;
        nr.owner = j.owner;
        nr.user = j.user;
        nr.since = j.since;
        nr.adopted = true;
        nr.bundles.push_back(std::move(bundle));
        adopted.push_back(j.run);
      } else if (std::none_of(r->second.bundles.begin(), r->second.bundles.end(),
                              [&](const Bundle& x) { return x.node == id; })) {
        if (r->second.adopted) {
          r->second.bundles.push_back(std::move(bundle));  // another node of an adopted run
        } else {
          send(from, Message{0, proto::KillJob{j.run}});
          log(
              fmt::format("node {} still ran run {}, whose part there was released; told it to "
                          "stop",
                          id, j.run));
        }
      }
    }
    send(from, Message{0, proto::NodeWelcome{}});
    log(fmt::format(
        "node {} {} (host {}, address {}, {} CPUs, {} GPUs){}", id,
        known ? "registered again" : "registered", n.host, n.address, n.cpus, n.gpus.size(),
        adopted.empty() ? "" : fmt::format("; adopted run(s) {}", fmt::join(adopted, ", "))));
  }

  void on_reserve(const std::string& from, const std::string& user, std::uint64_t request,
                  const proto::Reserve& b) {
    const std::string& run = b.run;
    const std::vector<GroupDemand> demands = to_demands(b.groups);
    // A submitted job's driver (it has its job's key, or the head's own, or the cluster has
    // none) takes over what was held for it; a job id from anyone else is not believed.
    const bool job_driver =
        user.empty() || user == "head" || (b.job_id && user == jobs::driver_name(*b.job_id));
    const std::optional<std::int64_t> job_id = job_driver && !b.dry_run ? b.job_id : std::nullopt;
    if (job_id) runs.erase(hold_id(*job_id));
    proto::Reservation r;
    const auto slots = fit(run, demands, r);
    if (slots && !b.dry_run) {
      Run& x = runs[run];
      x.id = run;
      x.job = b.job;
      x.owner = b.owner;
      x.driver = from;
      // Without keys the member is the one the driver names (its OS user, before "@host").
      x.user = user.empty() ? b.owner.substr(0, b.owner.find('@')) : user;
      if (job_id && jobs) {
        if (auto u = jobs->user_of(*job_id)) x.user = *u;
      }
      x.since = unix_now();
      x.last_lease = Clock::now();
      x.bundles = bundles_of(*slots, demands);
      std::vector<std::string> used;
      for (const auto& bu : x.bundles) used.push_back(bu.node);
      log(fmt::format("reserved for run {} (job {}, owner {}): {}", run, x.job, x.owner,
                      fmt::join(used, ", ")));
      if (jobs) {
        std::vector<proto::RankPlace> places;
        int gpus = 0, cpus = 0;
        for (std::size_t g = 0; g < slots->size(); ++g) {
          for (std::size_t k = 0; k < (*slots)[g].size(); ++k) {
            const auto& sl = (*slots)[g][k];
            places.push_back(
                proto::RankPlace{b.groups[g].name, static_cast<int>(k), sl.node, sl.gpus});
            gpus += static_cast<int>(sl.gpus.size());
            ++cpus;
          }
        }
        jobs->reserved(run, job_id, b.job, x.user, team_of(x.user), places, gpus, cpus,
                       static_cast<int>(x.bundles.size()));
      }
    }
    send(from, Message{request, std::move(r)});
  }

  // Room for workers of a run whose node is DEAD (their group restarts): on live nodes other than
  // `exclude`, from what nobody holds; the run holds the new slots from now on.
  void on_relocate(const std::string& from, const std::string& user, std::uint64_t request,
                   const proto::Relocate& b) {
    proto::Reservation r;
    auto run = runs.find(b.run);
    if (run == runs.end() || !speaks_for(run->second, from, user)) {
      r.kind = "infeasible";
      r.message = fmt::format("the head holds no reservation of run {} for this driver", b.run);
      send(from, Message{request, std::move(r)});
      return;
    }
    const std::vector<GroupDemand> demands = to_demands(b.groups);
    const bool ranks_match =
        b.ranks.size() == b.groups.size() &&
        std::equal(b.ranks.begin(), b.ranks.end(), b.groups.begin(),
                   [](const std::vector<int>& rs, const proto::GroupDemandEntry& g) {
                     return static_cast<int>(rs.size()) == g.workers;
                   });
    if (!ranks_match) {
      r.kind = "infeasible";
      r.message = "the relocation's ranks do not match its groups";
      send(from, Message{request, std::move(r)});
      return;
    }
    std::vector<NodeCapacity> free = capacity(true);
    std::erase_if(free, [&](const NodeCapacity& c) {
      return std::find(b.exclude.begin(), b.exclude.end(), c.id) != b.exclude.end();
    });
    std::string why;
    const auto slots = schedule(std::move(free), demands, &why);
    if (!slots) {
      r.kind = "busy";
      r.message = fmt::format("{}{}; {}", why,
                              b.exclude.empty()
                                  ? ""
                                  : fmt::format(" (not on {}: the group's other workers run there)",
                                                fmt::join(b.exclude, ", ")),
                              cluster_text(demands));
      send(from, Message{request, std::move(r)});
      return;
    }
    answer(*slots, r);
    std::vector<proto::RankPlace> places;
    for (std::size_t g = 0; g < slots->size(); ++g) {
      for (std::size_t k = 0; k < (*slots)[g].size(); ++k) {
        const Slot& sl = (*slots)[g][k];
        places.push_back(proto::RankPlace{b.groups[g].name, b.ranks[g][k], sl.node, sl.gpus});
      }
    }
    for (Bundle& add : bundles_of(*slots, demands)) {
      auto& held = run->second.bundles;
      auto same = std::find_if(held.begin(), held.end(),
                               [&](const Bundle& x) { return x.node == add.node; });
      if (same == held.end()) {
        held.push_back(std::move(add));
      } else {
        same->cpus += add.cpus;
        same->memory += add.memory;
        same->gpus.insert(same->gpus.end(), add.gpus.begin(), add.gpus.end());
      }
    }
    std::vector<std::string> moved;
    for (const auto& p : places)
      moved.push_back(fmt::format("{}:{} to {}", p.group, p.rank, p.node));
    log(fmt::format("run {} (job {}) moves worker(s) off a DEAD node: {}", b.run, run->second.job,
                    fmt::join(moved, ", ")));
    if (jobs) jobs->moved(b.run, places);
    send(from, Message{request, std::move(r)});
  }

  // Where `demands` would go now: the slots, with `r` the answer to send (ok, its nodes and
  // groups), or nullopt with `r` saying why not ("infeasible": never on this cluster; "busy":
  // held by others, named). `run`'s own reservation does not count as another's.
  // With `others_hold` false, what others hold counts as free (where it would go once it is).
  std::optional<std::vector<std::vector<Slot>>> fit(const std::string& run,
                                                    const std::vector<GroupDemand>& demands,
                                                    proto::Reservation& r,
                                                    bool others_hold = true) const {
    std::string why;
    if (!schedule(capacity(false), demands, &why)) {
      r.kind = "infeasible";
      r.message = fmt::format("{}; {}", why, cluster_text(demands));
      return std::nullopt;
    }
    auto slots = schedule(capacity(others_hold), demands, &why);
    if (!slots) {
      std::vector<std::string> holders;
      for (const auto& [rid, x] : runs) {
        if (rid == run) continue;
        holders.push_back(
            fmt::format("job {} (run {}, owner {}, since {})", x.job, rid, x.owner, x.since));
      }
      r.kind = "busy";
      r.message = why;
      r.holders =
          holders.empty() ? std::string("nobody") : fmt::format("{}", fmt::join(holders, "; "));
      return std::nullopt;
    }
    answer(*slots, r);
    return slots;
  }

  // `r` says ok with `slots`: per group, per worker, and the address of each node they use.
  void answer(const std::vector<std::vector<Slot>>& slots, proto::Reservation& r) const {
    r.ok = true;
    std::set<std::string> listed;
    for (const auto& g : slots) {
      std::vector<proto::SlotEntry> list;
      for (const auto& sl : g) {
        list.push_back(proto::SlotEntry{sl.node, sl.gpus});
        if (listed.insert(sl.node).second) {
          const Node& n = nodes.at(sl.node);
          r.nodes.push_back(proto::NodeAddress{sl.node, n.host, n.address});
        }
      }
      r.groups.push_back(std::move(list));
    }
  }

  void on_release(const std::string& run_id, const std::optional<std::string>& outcome = {}) {
    auto r = runs.find(run_id);
    if (r == runs.end()) return;
    if (jobs) jobs->released(run_id, false, outcome);
    for (const auto& b : r->second.bundles) {
      auto n = nodes.find(b.node);
      if (n != nodes.end() && n->second.alive)
        send(n->second.identity, Message{0, proto::KillJob{run_id}});
    }
    log(fmt::format("released run {} (job {})", run_id, r->second.job));
    runs.erase(r);
  }

  proto::NodesInfo nodes_info() const {
    proto::NodesInfo info;
    info.head = endpoint;
    for (const auto& id : order) {
      const Node& n = nodes.at(id);
      std::map<int, std::string> held;  // gpu -> run
      int cpus_used = 0;
      for (const auto& [rid, r] : runs) {
        for (const auto& b : r.bundles) {
          if (b.node != id) continue;
          cpus_used += b.cpus;
          for (int g : b.gpus) held[g] = rid;
        }
      }
      proto::NodeEntry e;
      e.id = id;
      e.host = n.host;
      e.address = n.address;
      e.state = n.alive ? "ALIVE" : "DEAD";
      e.cpus = n.cpus;
      e.cpus_free = std::max(0, n.cpus - cpus_used);
      e.memory = n.memory;
      for (const auto& g : n.gpus) {
        proto::GpuEntry x = g;
        x.run = held.count(g.index) ? held.at(g.index) : std::string();
        if (auto u = n.gpu_use.find(g.index); u != n.gpu_use.end() && n.alive) {
          x.util = u->second.util;
          x.memory_used = u->second.memory_used;
        }
        e.gpus.push_back(std::move(x));
      }
      e.labels = n.labels;
      e.heartbeat_age_s = seconds_since(n.last_seen);
      e.registered = n.registered;
      e.isolation = n.isolation;
      e.users = n.users;
      info.nodes.push_back(std::move(e));
    }
    for (const auto& [rid, r] : runs) {
      proto::ReservationEntry e{rid, r.job, r.owner, r.since, {}};
      for (const auto& b : r.bundles)
        e.bundles.push_back(proto::BundleEntry{b.node, b.gpus, b.cpus});
      info.reservations.push_back(std::move(e));
    }
    return info;
  }

  // Sends `m` on to the agent of `node`, or tells the sender that node is not live.
  void to_node(const std::string& from, const std::string& node, const Message& m) {
    auto n = nodes.find(node);
    if (n == nodes.end() || !n->second.alive) {
      send(from, Message{0, proto::NodeDead{node, n == nodes.end() ? std::string() : n->second.host,
                                            "", "the head does not know it as a live node"}});
      return;
    }
    send(n->second.identity, m);
  }

  // Whether a message about run `r` from connection `from` (its key named `user`) is its
  // driver's: the connection that reserved it or leased it last, or, once the driver reconnects
  // (a restarted head), the same member. Without keys anyone may speak for any run.
  bool speaks_for(const Run& r, const std::string& from, const std::string& user) const {
    if (r.driver == from || user.empty()) return true;
    std::string member = user;
    if (auto job = jobs::driver_job(user); job && jobs) member = jobs->user_of(*job).value_or("");
    return !member.empty() && member == r.user;
  }

  // The driver of `r` says its groups restarted `count` times so far: its job counts the new ones.
  void note_restarts(Run& r, int count) {
    if (count <= r.restarts) return;
    r.restarts = count;
    if (jobs) jobs->restarted(r.id, count);
  }

  // A driver's launch goes on to its node with the member the run is for, which the node's
  // --run-as maps to an account: only the run's own driver may launch its workers.
  void on_launch(const std::string& from, const std::string& user, const Message& m,
                 proto::Launch& b) {
    auto r = runs.find(b.run);
    if (r == runs.end() || !speaks_for(r->second, from, user)) {
      send(from, Message{0, proto::Launched{b.run, b.node,
                                            fmt::format("the head holds no reservation of run {} "
                                                        "for this driver; reserve first",
                                                        b.run)}});
      return;
    }
    b.user = r->second.user;
    to_node(from, b.node, m);
  }

  // Sends `m` on to the driver of `run`.
  void to_driver(const std::string& run, const Message& m) {
    auto r = runs.find(run);
    if (r != runs.end()) send(r->second.driver, m);
  }

  // ----- the job service's view of the cluster -----------------------------------------------

  // A submitted job's groups, and first its driver, which takes one CPU: on a node with its
  // driver_labels, or, without them, on the head's machine (when that is a node).
  std::vector<GroupDemand> with_driver(const std::vector<proto::GroupDemandEntry>& g,
                                       const jobs::Labels& driver_labels) const {
    auto demands = to_demands(g);
    if (!driver_labels.empty()) {
      GroupDemand d;
      std::vector<std::string> text;
      for (const auto& [k, v] : driver_labels) text.push_back(k + "=" + v);
      d.name = fmt::format("the driver (driver_labels {})", fmt::join(text, ","));
      d.workers = 1;
      d.labels = driver_labels;
      demands.insert(demands.begin(), std::move(d));
    } else if (!options.local_node.empty()) {
      GroupDemand d;
      d.name = "the driver (on the head's node " + options.local_node + ")";
      d.workers = 1;
      d.labels[kNodeLabel] = options.local_node;
      demands.insert(demands.begin(), std::move(d));
    }
    return demands;
  }

  // Would job demand `g` fit were the devices of `jobs` (their holds) and `runs` free?
  bool fits_without(const std::vector<proto::GroupDemandEntry>& g,
                    const jobs::Labels& driver_labels, const std::vector<std::int64_t>& jobs,
                    const std::vector<std::string>& gone) {
    std::map<std::string, Run> kept;
    for (auto r = runs.begin(); r != runs.end();) {
      const bool free = std::find(gone.begin(), gone.end(), r->first) != gone.end() ||
                        (r->second.hold_job &&
                         std::find(jobs.begin(), jobs.end(), r->second.hold_job) != jobs.end());
      if (free) {
        kept.insert(runs.extract(r++));
      } else {
        ++r;
      }
    }
    bool fits = false;
    try {
      fits = schedule(capacity(true), with_driver(g, driver_labels)).has_value();
    } catch (...) {
      runs.merge(kept);
      throw;
    }
    runs.merge(kept);
    return fits;
  }

  std::optional<jobs::Refusal> hold(std::int64_t job, const std::vector<proto::GroupDemandEntry>& g,
                                    const jobs::Labels& driver_labels, std::string* driver_node) {
    auto demands = with_driver(g, driver_labels);
    const bool driver_here = !options.local_node.empty() || !driver_labels.empty();
    std::string why;
    const std::string driver_note =
        !driver_labels.empty()
            ? " (besides its workers, its driver takes one CPU of a node with its driver_labels)"
        : driver_here ? fmt::format(
                            " (besides its workers, its driver takes one CPU of {}, the "
                            "head's node, where it runs)",
                            options.local_node)
                      : "";
    if (!schedule(capacity(false), demands, &why))
      return jobs::Refusal{fmt::format("it does not fit the live nodes: {}{}; {}", why, driver_note,
                                       cluster_text(demands)),
                           true};
    auto slots = schedule(capacity(true), demands, &why);
    if (!slots) {
      std::vector<std::string> holders;
      for (const auto& [rid, r] : runs) {
        holders.push_back(r.driver_cpu ? fmt::format("job {}'s driver", r.hold_job)
                          : r.hold_job ? fmt::format("job {} (starting)", r.hold_job)
                                       : fmt::format("{} (run {}, owner {})", r.job, rid, r.owner));
      }
      return jobs::Refusal{
          fmt::format("{}{}; held by {}", why, driver_note, fmt::join(holders, ", ")), false};
    }
    if (driver_here) {
      const std::string node = slots->front().front().node;
      if (!driver_labels.empty() && driver_node) *driver_node = node;
      hold_driver(job, node);
      slots->erase(slots->begin());
      demands.erase(demands.begin());
    }
    Run& x = runs[hold_id(job)];
    x.id = hold_id(job);
    x.job = fmt::format("job {}", job);
    x.owner = "the job service";
    x.hold_job = job;
    x.since = unix_now();
    x.last_lease = Clock::now();
    x.bundles = bundles_of(*slots, demands);
    return std::nullopt;
  }

  // The CPU of job `job`'s driver on `node` ("": the head's node, when the head has one), held
  // until the job ends; also taken again for a job that already runs when a restarted head
  // meets it.
  void hold_driver(std::int64_t job, std::string node) {
    if (node.empty()) node = options.local_node;
    if (node.empty() || runs.count(driver_id(job))) return;
    Run& d = runs[driver_id(job)];
    d.id = driver_id(job);
    d.job = fmt::format("job {} (its driver)", job);
    d.owner = "the job service";
    d.hold_job = job;
    d.driver_cpu = true;
    d.since = unix_now();
    d.bundles = {Bundle{node, {}, 1}};
  }

  void start_jobs() {
    if (!options.state_dir.empty()) {
      std::string address = endpoint;
      if (auto at = address.find("0.0.0.0"); at != std::string::npos)
        address.replace(at, 7, "127.0.0.1");
      jobs::ServiceOptions so;
      so.state_dir = options.state_dir;
      so.keep_jobs = options.keep_jobs;
      so.log_cap = options.job_log_cap;
      so.max_upload = options.max_upload;
      so.head_address = address;
      if (options.security.socket.secure())
        so.head_public = options.security.socket.keys->public_key;
      so.run_as = options.run_as;
      so.exe = options.exe;
      so.log = options.log;
      jobs::ClusterView view;
      view.hold = [this](std::int64_t job, const std::vector<proto::GroupDemandEntry>& g,
                         const jobs::Labels& labels,
                         std::string* node) { return hold(job, g, labels, node); };
      view.unhold = [this](std::int64_t job) {
        runs.erase(hold_id(job));
        runs.erase(driver_id(job));
      };
      view.release_run = [this](const std::string& run) { on_release(run); };
      view.run_known = [this](const std::string& run) { return runs.count(run) > 0; };
      view.hold_driver = [this](std::int64_t job, const std::string& node) {
        hold_driver(job, node);
      };
      view.fits_without = [this](const std::vector<proto::GroupDemandEntry>& g,
                                 const jobs::Labels& labels, const std::vector<std::int64_t>& jobs,
                                 const std::vector<std::string>& gone) {
        return fits_without(g, labels, jobs, gone);
      };
      view.send_node = [this](const std::string& node, const Message& m) {
        auto n = nodes.find(node);
        if (n == nodes.end() || !n->second.alive) return false;
        send(n->second.identity, m);
        return true;
      };
      view.node_alive = [this](const std::string& node) {
        auto n = nodes.find(node);
        return n != nodes.end() && n->second.alive;
      };
      // Each submitted job's driver has a key of its own, admitted while the job runs.
      view.admit_driver = [this](std::int64_t job, const std::string& key) {
        if (gate) gate->allow(key, jobs::driver_name(job));
      };
      view.revoke_driver = [this](const std::string& key) {
        if (gate) gate->revoke(key);
      };
      so.quotas =
          options.quotas_file.empty() ? jobs::no_quotas() : jobs::load_quotas(options.quotas_file);
      so.member_teams = options.security.teams;
      jobs = std::make_unique<jobs::JobService>(std::move(so), std::move(view));
    }
  }

  // On a dashboard thread: runs `m` on the head's thread as `caller` and waits for the answer.
  std::optional<Message> ask(const jobs::Caller& caller, Message m) {
    auto a = std::make_shared<Ask>();
    a->caller = caller;
    a->m = std::move(m);
    auto answer = a->answer.get_future();
    {
      std::lock_guard<std::mutex> lock(asks_mu);
      if (closing) return std::nullopt;
      asks.push_back(a);
    }
    const std::uint64_t one = 1;
    (void)!::write(wake.get(), &one, sizeof one);
    if (answer.wait_for(kAskTimeout) != std::future_status::ready) return std::nullopt;
    return answer.get();
  }

  // On the head's thread: answers what the dashboard asked.
  void answer_asks() {
    std::uint64_t n = 0;
    (void)!::read(wake.get(), &n, sizeof n);
    if (reload.exchange(false)) {
      try {
        if (!jobs) throw Error("this head keeps no jobs, so it has no quotas");
        jobs->reload_quotas();
      } catch (const std::exception& e) {
        log(fmt::format("quotas not read again, they stay as they were: {}", e.what()));
      }
    }
    std::deque<std::shared_ptr<Ask>> now;
    {
      std::lock_guard<std::mutex> lock(asks_mu);
      now.swap(asks);
    }
    for (auto& a : now) {
      std::optional<Message> answer;
      a->caller.team = team_of(a->caller.user);
      try {
        if (a->m.get<proto::NodesQuery>()) {
          answer = Message{0, nodes_info()};
        } else if (const auto* plan = a->m.get<proto::Reserve>()) {
          // The topology's preview: where the job would go now, or, when others hold what it
          // needs, once they no longer do (kind "busy", with the holders); nothing is reserved.
          proto::Reservation r;
          const auto demands = to_demands(plan->groups);
          if (!fit("", demands, r) && r.kind == "busy") {
            proto::Reservation later;
            (void)fit("", demands, later, false);
            later.kind = "busy";
            later.message = r.message;
            later.holders = r.holders;
            r = std::move(later);
          }
          answer = Message{0, std::move(r)};
        } else if (jobs && for_jobs(a->m)) {
          answer = jobs->handle(a->caller, 0, a->m);
        }
      } catch (const std::exception& e) {
        log(fmt::format("dashboard: {}", e.what()));
      }
      a->answer.set_value(std::move(answer));
    }
  }

  // The head stops: every ask in the queue, and every later one, gets no answer.
  void close_asks() {
    std::deque<std::shared_ptr<Ask>> left;
    {
      std::lock_guard<std::mutex> lock(asks_mu);
      closing = true;
      left.swap(asks);
    }
    for (auto& a : left) a->answer.set_value(std::nullopt);
  }

  void on_dashboard_link(const std::string& from, const std::string& user, std::uint64_t id,
                         const proto::DashboardLink& b) {
    proto::DashboardGrant g;
    if (!dashboard) {
      g.error =
          "this head serves no dashboard: start it with `twinkle node start --head --dashboard "
          "PORT`";
    } else {
      // The key's name; on a cluster without keys the client's own word.
      const std::string who = user.empty() ? b.user : user;
      g.url = dashboard->grant(who, options.security.admins.count(who) > 0);
      log(fmt::format("dashboard: a login link for {}", who));
    }
    send(from, Message{id, g});
  }

  void handle(const std::string& from, const std::string& user, Message& m) {
    if (jobs && for_jobs(m)) {
      send(from, jobs->handle(caller(user, from), m.id, m));
      return;
    }
    std::visit(
        [&](auto& b) {
          using T = std::decay_t<decltype(b)>;
          if constexpr (std::is_same_v<T, proto::NodeRegister>) {
            on_register(from, b);
          } else if constexpr (std::is_same_v<T, proto::Heartbeat>) {
            Node* n = node_by_identity(from);
            if (n && n->alive) {
              n->last_seen = Clock::now();
              n->gpu_use.clear();
              if (b.gpus)
                for (const auto& u : *b.gpus) n->gpu_use[u.index] = u;
            } else {
              send(from, Message{0, proto::Reregister{}});
            }
          } else if constexpr (std::is_same_v<T, proto::NodeLeave>) {
            Node* n = node_by_identity(from);
            if (n && n->alive) declare_dead(*n, b.reason);
          } else if constexpr (std::is_same_v<T, proto::NodesQuery>) {
            send(from, Message{m.id, nodes_info()});
          } else if constexpr (std::is_same_v<T, proto::DashboardLink>) {
            on_dashboard_link(from, user, m.id, b);
          } else if constexpr (std::is_same_v<T, proto::Reserve>) {
            on_reserve(from, user, m.id, b);
          } else if constexpr (std::is_same_v<T, proto::Relocate>) {
            on_relocate(from, user, m.id, b);
          } else if constexpr (std::is_same_v<T, proto::Lease>) {
            auto r = runs.find(b.run);
            if (r != runs.end() && speaks_for(r->second, from, user)) {
              r->second.last_lease = Clock::now();
              r->second.driver = from;
              note_restarts(r->second, b.restarts);
            }
          } else if constexpr (std::is_same_v<T, proto::Release>) {
            auto r = runs.find(b.run);
            if (r != runs.end() && speaks_for(r->second, from, user)) {
              note_restarts(r->second, b.restarts);
              on_release(b.run, b.outcome);
            }
          } else if constexpr (std::is_same_v<T, proto::Launch>) {
            on_launch(from, user, m, b);
          } else if constexpr (std::is_same_v<T, proto::DriverStatus> ||
                               std::is_same_v<T, proto::NeedArchive>) {
            // From the agent of the node a job's driver runs on (the job service checks that
            // it is that job's node).
            const Node* n = node_by_identity(from);
            if (!n || !n->alive || !jobs) {
              drops.drop(fmt::format("a {} message from {}, which is no live node",
                                     transport::to_string(T::kType), from.substr(0, 64)));
            } else if constexpr (std::is_same_v<T, proto::DriverStatus>) {
              send(from, Message{0, jobs->driver_status(n->id, b)});
            } else {
              send(from, Message{0, jobs->archive_part(n->id, b)});
            }
          } else if constexpr (std::is_same_v<T, proto::PluginBytes> ||
                               std::is_same_v<T, proto::StopJob>) {
            auto r = runs.find(b.run);
            if (r != runs.end() && speaks_for(r->second, from, user)) {
              to_node(from, b.node, m);
            } else if constexpr (std::is_same_v<T, proto::StopJob>) {
              // Released already (its agents were told to stop it), or not this driver's.
              send(from, Message{0, proto::Stopped{b.run, b.node, {}}});
            }
          } else if constexpr (std::is_same_v<T, proto::Launched> ||
                               std::is_same_v<T, proto::NeedPlugin> ||
                               std::is_same_v<T, proto::Stopped> ||
                               std::is_same_v<T, proto::WorkerExit> ||
                               std::is_same_v<T, proto::Output>) {
            to_driver(b.run, m);
          } else {
            drops.drop(
                fmt::format("a {} message is not for the head", transport::to_string(T::kType)));
          }
        },
        m.body);
  }

  // `n` is gone: its part of every run is released and each run's driver is told.
  void declare_dead(Node& n, const std::string& reason) {
    n.alive = false;
    log(fmt::format("node {} (host {}, address {}) is DEAD: {}", n.id, n.host, n.address, reason));
    for (auto& [rid, r] : runs) {
      auto b = std::find_if(r.bundles.begin(), r.bundles.end(),
                            [&](const Bundle& x) { return x.node == n.id; });
      if (b == r.bundles.end()) continue;
      r.bundles.erase(b);
      send(r.driver, Message{0, proto::NodeDead{n.id, n.host, n.address, reason}});
    }
  }

  void tick() {
    for (auto& [id, n] : nodes) {
      if (!n.alive || Clock::now() - n.last_seen < kSilenceLimit) continue;
      declare_dead(n, fmt::format("no heartbeat for {:.1f} s", seconds_since(n.last_seen)));
    }
    for (auto r = runs.begin(); r != runs.end();) {
      if (r->second.hold_job) {
        const bool keep = r->second.driver_cpu || Clock::now() - r->second.last_lease < kHoldLimit;
        r = keep ? std::next(r) : runs.erase(r);
        continue;
      }
      if (Clock::now() - r->second.last_lease < kSilenceLimit) {
        ++r;
        continue;
      }
      if (jobs) jobs->released(r->first, true);
      log(
          fmt::format("run {} (job {}): its driver has not renewed its lease for {:.1f} s; "
                      "stopping its workers and releasing its devices",
                      r->first, r->second.job, seconds_since(r->second.last_lease)));
      for (const auto& b : r->second.bundles) {
        auto n = nodes.find(b.node);
        if (n != nodes.end() && n->second.alive)
          send(n->second.identity, Message{0, proto::KillJob{r->first}});
      }
      r = runs.erase(r);
    }
  }
};

Head::Head(HeadOptions options) : s_(std::make_unique<State>()) {
  s_->options = std::move(options);
  State& s = *s_;
  if (s.options.security.socket.secure()) {
    s.gate = std::make_unique<transport::KeyGate>(
        s.context, s.options.security.allowed, [&s](const std::string& l) { s.log(l); },
        s.options.security.names);
  }
  s.router.set(zmq::sockopt::linger, 0);
  s.router.set(zmq::sockopt::router_mandatory, 1);
  // An agent that restarts with the same node id takes over its old connection.
  s.router.set(zmq::sockopt::router_handover, 1);
  s.router.set(zmq::sockopt::sndhwm, 0);
  s.router.set(zmq::sockopt::rcvhwm, 0);
  transport::secure_server(s.router, s.options.security.socket);
  transport::set_heartbeats(s.router, transport::kHeartbeatInterval, transport::kHeartbeatTimeout);
  s.watch = std::make_unique<transport::ConnectionWatch>(
      s.context, s.router,
      [&s](transport::ConnectionWatch::Event e, const std::string& address,
           const std::string& detail) {
        if (e == transport::ConnectionWatch::Event::refused_protocol)
          s.log(fmt::format("refused a connection on {}: {}", address, detail));
      });
  const std::string want =
      fmt::format("tcp://{}:{}", s.options.bind_host,
                  s.options.port == 0 ? std::string("*") : std::to_string(s.options.port));
  try {
    s.router.bind(want);
  } catch (const zmq::error_t& e) {
    throw TransportError(
        fmt::format("the head cannot listen on {}: {}{}", want, e.what(),
                    e.num() == EADDRINUSE ? "; another head runs there, or choose --port" : ""));
  }
  s.endpoint = s.router.get(zmq::sockopt::last_endpoint);
  s.start_jobs();
  s.wake = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!s.wake)
    throw Error(fmt::format("the head cannot make an eventfd: {}", std::strerror(errno)));
  if (s.options.dashboard_port >= 0) {
    DashboardOptions d;
    d.host = s.options.dashboard_host;
    d.port = s.options.dashboard_port;
    d.link_s = s.options.dashboard_link_s;
    d.tls_cert = s.options.dashboard_tls_cert;
    d.tls_key = s.options.dashboard_tls_key;
    d.names = s.options.dashboard_names;
    d.max_upload = s.options.max_upload;
    // The page's uploads are put together here before they go to the job service.
    if (!s.options.state_dir.empty()) d.scratch_dir = s.options.state_dir / "dashboard";
    d.log = s.options.log;
    s.dashboard = open_dashboard(
        std::move(d), [&s](const jobs::Caller& c, Message m) { return s.ask(c, std::move(m)); });
  }
}

Head::~Head() {
  s_->close_asks();
  s_->dashboard.reset();
  s_->watch.reset();
}

const std::string& Head::endpoint() const { return s_->endpoint; }

void Head::reload_quotas() {
  s_->reload = true;
  const std::uint64_t one = 1;
  (void)!::write(s_->wake.get(), &one, sizeof one);
}

std::string Head::dashboard_url() const {
  return s_->dashboard ? s_->dashboard->url() : std::string();
}

void Head::run(const std::atomic<bool>& stop) {
  State& s = *s_;
  auto next_tick = Clock::now() + kTick;
  auto next_job_tick = Clock::now() + kJobTick;
  while (!stop) {
    zmq::pollitem_t items[] = {{s.router.handle(), 0, ZMQ_POLLIN, 0},
                               {nullptr, s.wake.get(), ZMQ_POLLIN, 0}};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::min(next_tick, s.jobs ? next_job_tick : next_tick) - Clock::now());
    zmq::poll(items, 2, std::max(left, std::chrono::milliseconds(0)));
    if (items[1].revents & ZMQ_POLLIN) s.answer_asks();
    const zmq::pollitem_t& item = items[0];
    if (Clock::now() >= next_tick) {
      s.tick();
      next_tick = Clock::now() + kTick;
    }
    if (s.jobs && Clock::now() >= next_job_tick) {
      s.jobs->tick();
      next_job_tick = Clock::now() + kJobTick;
    }
    if (!(item.revents & ZMQ_POLLIN)) continue;
    for (int i = 0; i < 1000; ++i) {
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(s.router, std::back_inserter(frames), zmq::recv_flags::dontwait))
        break;
      if (frames.size() < 2) continue;
      const std::string from = frames.front().to_string();
      const std::string user = transport::user_id(frames.back());
      frames.erase(frames.begin());
      std::optional<Message> m;
      try {
        m = transport::decode_cluster_message(std::move(frames));
      } catch (const TransportError& e) {
        s.drops.drop(fmt::format("from {}: {}", from.substr(0, 64), e.what()));
        continue;
      }
      s.handle(from, user, *m);
    }
  }
}

}  // namespace twinkle::core::cluster
