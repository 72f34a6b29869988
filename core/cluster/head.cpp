#include "core/cluster/head.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "core/cluster/scheduler.hpp"
#include "core/job/values.hpp"
#include "transports/zmq/auth.hpp"
#include "transports/zmq/message.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core::cluster {

namespace {

using transport::Message;
using transport::MsgType;
using Clock = std::chrono::steady_clock;

// A node silent this long is DEAD; so is a run whose driver stops renewing its lease.
constexpr auto kSilenceLimit = std::chrono::milliseconds(3000);
constexpr auto kTick = std::chrono::milliseconds(250);

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct Node {
  std::string id, identity, host, address;
  int cpus = 0;
  std::int64_t memory = 0;
  Value gpus = Value::list();  // [{index, name, memory, uuid}]
  std::map<std::string, std::string> labels;
  bool alive = true;
  Clock::time_point last_seen = Clock::now();
  std::int64_t registered = 0;  // unix seconds
};

struct Bundle {
  std::string node;
  std::vector<int> gpus;
  int cpus = 0;
};

struct Run {
  std::string id, job, owner, driver;  // driver: its identity at the head ("" until known)
  std::vector<Bundle> bundles;
  std::int64_t since = 0;
  Clock::time_point last_lease = Clock::now();
  // Learnt from the agents after a head restart (not reserved by this head): every node that
  // reports it adds its part.
  bool adopted = false;
};

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

  void log(const std::string& line) const {
    if (options.log) options.log(line);
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
      c.labels = n.labels;
      for (const auto& g : n.gpus) c.gpus.push_back(g["index"].as<int>());
      if (free) {
        for (const auto& [rid, r] : runs) {
          for (const auto& b : r.bundles) {
            if (b.node != id) continue;
            c.cpus -= b.cpus;
            for (int g : b.gpus)
              c.gpus.erase(std::remove(c.gpus.begin(), c.gpus.end(), g), c.gpus.end());
          }
        }
      }
      out.push_back(std::move(c));
    }
    return out;
  }

  std::string cluster_text() const {
    std::vector<std::string> parts;
    for (const auto& id : order) {
      const Node& n = nodes.at(id);
      if (!n.alive) continue;
      std::string labels;
      for (const auto& [k, v] : n.labels)
        labels += fmt::format("{}{}={}", labels.empty() ? "" : ",", k, v);
      parts.push_back(fmt::format("{} ({} CPUs, {} GPUs{})", id, n.cpus, n.gpus.size(),
                                  labels.empty() ? "" : ", labels " + labels));
    }
    if (parts.empty())
      return "the cluster has no live node (start agents with `twinkle node start --address ...`)";
    return fmt::format("the cluster has {} live node{}: {}", parts.size(),
                       parts.size() == 1 ? "" : "s", fmt::join(parts, ", "));
  }

  // ----- messages -----------------------------------------------------------------------------

  void on_register(const std::string& from, Message& m) {
    const Value& b = m.body;
    const std::string id = b["node"].as<std::string>();
    auto it = nodes.find(id);
    if (it != nodes.end() && it->second.alive && it->second.identity != from &&
        seconds_since(it->second.last_seen) < 1.0) {
      send(from,
           Message{MsgType::node_welcome, 0,
                   Value::map({{"ok", false},
                               {"error", fmt::format("node id \"{}\" is taken by a live node at "
                                                     "{}; give this one another --node-id",
                                                     id, it->second.address)}})});
      log(fmt::format("refused a second node \"{}\" (the first is at {})", id, it->second.address));
      return;
    }
    const bool known = it != nodes.end();
    Node& n = nodes[id];
    if (!known) order.push_back(id);
    n.id = id;
    n.identity = from;
    n.host = b["host"].as<std::string>();
    n.address = b["address"].as<std::string>();
    n.cpus = b["cpus"].as<int>();
    n.memory = b["memory"].as<std::int64_t>();
    n.gpus = b["gpus"];
    n.labels = labels_from_value(b["labels"]);
    n.alive = true;
    n.last_seen = Clock::now();
    n.registered = unix_now();
    // The jobs it still runs: a restarted head adopts them; those released meanwhile (the node
    // was cut off and declared dead) are stopped.
    std::vector<std::string> adopted;
    for (const auto& j : b["jobs"]) {
      const std::string run = j["run"].as<std::string>();
      Bundle bundle{id, j["gpus"].as<std::vector<int>>(), j["cpus"].as<int>()};
      auto r = runs.find(run);
      if (r == runs.end()) {
        Run& nr = runs[run];
        nr.id = run;
        nr.job = j["job"].as<std::string>();
        nr.owner = j["owner"].as<std::string>();
        nr.since = j["since"].as<std::int64_t>();
        nr.adopted = true;
        nr.bundles.push_back(std::move(bundle));
        adopted.push_back(run);
      } else if (std::none_of(r->second.bundles.begin(), r->second.bundles.end(),
                              [&](const Bundle& x) { return x.node == id; })) {
        if (r->second.adopted) {
          r->second.bundles.push_back(std::move(bundle));  // another node of an adopted run
        } else {
          send(from, Message{MsgType::kill_job, 0, Value::map({{"run", run}})});
          log(
              fmt::format("node {} still ran run {}, whose part there was released; told it to "
                          "stop",
                          id, run));
        }
      }
    }
    send(from, Message{MsgType::node_welcome, 0, Value::map({{"ok", true}})});
    log(fmt::format(
        "node {} {} (host {}, address {}, {} CPUs, {} GPUs){}", id,
        known ? "registered again" : "registered", n.host, n.address, n.cpus, n.gpus.size(),
        adopted.empty() ? "" : fmt::format("; adopted run(s) {}", fmt::join(adopted, ", "))));
  }

  void on_reserve(const std::string& from, Message& m) {
    const Value& b = m.body;
    const std::string run = b["run"].as<std::string>();
    const bool dry_run = b.contains("dry_run") && b["dry_run"].as<bool>();
    std::vector<GroupDemand> demands;
    for (const auto& g : b["groups"]) {
      GroupDemand d;
      d.name = g["name"].as<std::string>();
      d.workers = g["workers"].as<int>();
      d.gpus_per_worker = g["gpus_per_worker"].as<int>();
      auto s = placement_strategy(g["strategy"].as<std::string>());
      d.strategy = s.value_or(PlacementStrategy::pack);
      d.labels = labels_from_value(g["labels"]);
      demands.push_back(std::move(d));
    }
    auto reply = [&](Value body) {
      send(from, Message{MsgType::reservation, m.id, std::move(body)});
    };
    std::string why;
    if (!schedule(capacity(false), demands, &why)) {
      reply(Value::map({{"ok", false},
                        {"kind", "infeasible"},
                        {"message", fmt::format("{}; {}", why, cluster_text())}}));
      return;
    }
    auto slots = schedule(capacity(true), demands, &why);
    if (!slots) {
      std::vector<std::string> holders;
      for (const auto& [rid, r] : runs) {
        if (rid == run) continue;
        holders.push_back(
            fmt::format("job {} (run {}, owner {}, since {})", r.job, rid, r.owner, r.since));
      }
      reply(
          Value::map({{"ok", false},
                      {"kind", "busy"},
                      {"message", why},
                      {"holders", holders.empty() ? std::string("nobody")
                                                  : fmt::format("{}", fmt::join(holders, "; "))}}));
      return;
    }
    Value groups = Value::list();
    Value where = Value::map();
    std::map<std::string, Bundle> per_node;
    for (const auto& g : *slots) {
      Value list = Value::list();
      for (const auto& s : g) {
        list.push_back(Value::map({{"node", s.node}, {"gpus", Value(s.gpus)}}));
        Bundle& bu = per_node[s.node];
        bu.node = s.node;
        bu.cpus += 1;
        bu.gpus.insert(bu.gpus.end(), s.gpus.begin(), s.gpus.end());
        const Node& n = nodes.at(s.node);
        where[s.node] = Value::map({{"host", n.host}, {"address", n.address}});
      }
      groups.push_back(std::move(list));
    }
    if (!dry_run) {
      Run& r = runs[run];
      r.id = run;
      r.job = b["job"].as<std::string>();
      r.owner = b["owner"].as<std::string>();
      r.driver = from;
      r.since = unix_now();
      r.last_lease = Clock::now();
      r.bundles.clear();
      for (auto& [id, bu] : per_node) r.bundles.push_back(bu);
      std::vector<std::string> used;
      for (const auto& [id, bu] : per_node) used.push_back(id);
      log(fmt::format("reserved for run {} (job {}, owner {}): {}", run, r.job, r.owner,
                      fmt::join(used, ", ")));
    }
    reply(Value::map({{"ok", true}, {"groups", groups}, {"nodes", where}}));
  }

  void on_release(const std::string& run_id) {
    auto r = runs.find(run_id);
    if (r == runs.end()) return;
    for (const auto& b : r->second.bundles) {
      auto n = nodes.find(b.node);
      if (n != nodes.end() && n->second.alive)
        send(n->second.identity, Message{MsgType::kill_job, 0, Value::map({{"run", run_id}})});
    }
    log(fmt::format("released run {} (job {})", run_id, r->second.job));
    runs.erase(r);
  }

  Value nodes_info() const {
    Value list = Value::list();
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
      Value gpus = Value::list();
      for (const auto& g : n.gpus) {
        Value x = g;
        const int index = g["index"].as<int>();
        x["run"] = held.count(index) ? held.at(index) : std::string();
        gpus.push_back(std::move(x));
      }
      list.push_back(Value::map({{"id", id},
                                 {"host", n.host},
                                 {"address", n.address},
                                 {"state", n.alive ? "ALIVE" : "DEAD"},
                                 {"cpus", n.cpus},
                                 {"cpus_free", std::max(0, n.cpus - cpus_used)},
                                 {"memory", n.memory},
                                 {"gpus", gpus},
                                 {"labels", labels_to_value(n.labels)},
                                 {"heartbeat_age_s", seconds_since(n.last_seen)},
                                 {"registered", n.registered}}));
    }
    Value res = Value::list();
    for (const auto& [rid, r] : runs) {
      Value bundles = Value::list();
      for (const auto& b : r.bundles) {
        bundles.push_back(
            Value::map({{"node", b.node}, {"gpus", Value(b.gpus)}, {"cpus", b.cpus}}));
      }
      res.push_back(Value::map({{"run", rid},
                                {"job", r.job},
                                {"owner", r.owner},
                                {"since", r.since},
                                {"bundles", bundles}}));
    }
    return Value::map({{"head", endpoint}, {"nodes", list}, {"reservations", res}});
  }

  void handle(const std::string& from, Message& m) {
    switch (m.type) {
      case MsgType::node_register: on_register(from, m); break;
      case MsgType::heartbeat: {
        Node* n = node_by_identity(from);
        if (n && n->alive) {
          n->last_seen = Clock::now();
        } else {
          send(from, Message{MsgType::reregister, 0, Value()});
        }
        break;
      }
      case MsgType::node_leave: {
        Node* n = node_by_identity(from);
        if (n && n->alive) declare_dead(*n, m.body["reason"].as<std::string>());
        break;
      }
      case MsgType::nodes_query:
        send(from, Message{MsgType::nodes_info, m.id, nodes_info()});
        break;
      case MsgType::reserve: on_reserve(from, m); break;
      case MsgType::lease: {
        auto r = runs.find(m.body["run"].as<std::string>());
        if (r != runs.end()) {
          r->second.last_lease = Clock::now();
          r->second.driver = from;
        }
        break;
      }
      case MsgType::release: on_release(m.body["run"].as<std::string>()); break;
      case MsgType::launch:
      case MsgType::plugin:
      case MsgType::stop_job: {
        const std::string node = m.body["node"].as<std::string>();
        auto n = nodes.find(node);
        if (n == nodes.end() || !n->second.alive) {
          send(from,
               Message{MsgType::node_dead, 0,
                       Value::map({{"node", node},
                                   {"host", n == nodes.end() ? std::string() : n->second.host},
                                   {"reason", "the head does not know it as a live node"}})});
          break;
        }
        send(n->second.identity, m);
        break;
      }
      case MsgType::launched:
      case MsgType::need_plugin:
      case MsgType::stopped:
      case MsgType::worker_exit:
      case MsgType::output: {
        auto r = runs.find(m.body["run"].as<std::string>());
        if (r != runs.end()) send(r->second.driver, m);
        break;
      }
      default: log(fmt::format("dropped an unexpected {} message", transport::to_string(m.type)));
    }
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
      send(
          r.driver,
          Message{
              MsgType::node_dead, 0,
              Value::map(
                  {{"node", n.id}, {"host", n.host}, {"address", n.address}, {"reason", reason}})});
    }
  }

  void tick() {
    for (auto& [id, n] : nodes) {
      if (!n.alive || Clock::now() - n.last_seen < kSilenceLimit) continue;
      declare_dead(n, fmt::format("no heartbeat for {:.1f} s", seconds_since(n.last_seen)));
    }
    for (auto r = runs.begin(); r != runs.end();) {
      if (Clock::now() - r->second.last_lease < kSilenceLimit) {
        ++r;
        continue;
      }
      log(
          fmt::format("run {} (job {}): its driver has not renewed its lease for {:.1f} s; "
                      "stopping its workers and releasing its devices",
                      r->first, r->second.job, seconds_since(r->second.last_lease)));
      for (const auto& b : r->second.bundles) {
        auto n = nodes.find(b.node);
        if (n != nodes.end() && n->second.alive)
          send(n->second.identity, Message{MsgType::kill_job, 0, Value::map({{"run", r->first}})});
      }
      r = runs.erase(r);
    }
  }
};

Head::Head(HeadOptions options) : s_(std::make_unique<State>()) {
  s_->options = std::move(options);
  State& s = *s_;
  if (s.options.security.socket.secure()) {
    s.gate = std::make_unique<transport::KeyGate>(s.context, s.options.security.allowed,
                                                  [&s](const std::string& l) { s.log(l); });
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
}

Head::~Head() { s_->watch.reset(); }

const std::string& Head::endpoint() const { return s_->endpoint; }

void Head::run(const std::atomic<bool>& stop) {
  State& s = *s_;
  auto next_tick = Clock::now() + kTick;
  while (!stop) {
    zmq::pollitem_t item{s.router.handle(), 0, ZMQ_POLLIN, 0};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(next_tick - Clock::now());
    zmq::poll(&item, 1, std::max(left, std::chrono::milliseconds(0)));
    if (Clock::now() >= next_tick) {
      s.tick();
      next_tick = Clock::now() + kTick;
    }
    if (!(item.revents & ZMQ_POLLIN)) continue;
    for (int i = 0; i < 1000; ++i) {
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(s.router, std::back_inserter(frames), zmq::recv_flags::dontwait))
        break;
      if (frames.size() < 2) continue;
      const std::string from = frames.front().to_string();
      frames.erase(frames.begin());
      try {
        Message m = transport::decode_message(std::move(frames));
        s.handle(from, m);
      } catch (const std::exception& e) {
        s.log(fmt::format("dropped a malformed message from {}: {}", from.substr(0, 64), e.what()));
      }
    }
  }
}

}  // namespace twinkle::core::cluster
