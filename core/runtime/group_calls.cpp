#include "core/runtime/group_calls.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/job/values.hpp"

namespace twinkle::core {

namespace proto = transport::proto;

namespace {

// How often a worker waiting for another group looks for a cycle of calls (probes).
constexpr auto kProbeInterval = std::chrono::milliseconds(300);

}  // namespace

GroupCalls::GroupCalls(zmq::context_t& context, const std::string& name,
                       const proto::Welcome& welcome, const plugins::Plugin& plugin,
                       const transport::SocketSecurity& security, std::chrono::milliseconds timeout,
                       Watched watched)
    : plugin_(plugin), self_(welcome.self) {
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
  transport::SocketSecurity client;
  if (security.keys) {
    client.keys = security.keys;
    client.server_key = security.keys->public_key;  // every worker of the run has this pair
  }
  peers_ = std::make_unique<transport::PeerChannel>(context, name, std::move(names),
                                                    std::move(endpoints), client);
  // While a call waits for another group, the same handlers run: they queue what must wait and
  // answer at once what would otherwise never finish (a cycle of calls).
  peers_->watch(watched.link, std::move(watched.on_link));
  peers_->watch(watched.serve, std::move(watched.on_serve));
  peers_->every(kProbeInterval, [this] { chain_->send_probes(); });
  CustomFunctions custom{[this](std::string_view n) { return plugin_.find_dispatcher(n); },
                         [this](std::string_view n) { return plugin_.find_collector(n); }};
  const double timeout_s = std::chrono::duration<double>(timeout).count();
  table_ =
      std::make_unique<CallTable>(*peers_, std::move(groups), std::move(workers), std::move(custom),
                                  timeout_s, static_cast<std::uint64_t>(self_ + 1) << 40);
  table_->set_caller_label("worker caller");
  chain_ = std::make_unique<CallChain>(
      name, CallChain::Peers{[this] { return table_->waiting_peers(); },
                             [this](const std::string& n) { return peer_index(n); },
                             [this](std::size_t p, const proto::Probe& probe) {
                               try {
                                 peers_->send(p, transport::Message{0, probe});
                               } catch (const TransportError&) {
                                 // That worker is gone: the driver tells everyone.
                               }
                             },
                             [this](std::size_t p, const std::string& error) {
                               table_->fail_waiting(p, error);
                               peers_->wake();  // the waiting call sees its error now
                             }});
}

std::pair<std::uint64_t, proto::Made> GroupCalls::create(std::string_view cls_name,
                                                         std::string_view group,
                                                         const twk_value_v1& args, int rank,
                                                         int world) {
  const plugins::ClassInfo& cls = known_class(cls_name, "create");
  const std::size_t gi = known_group(group, "create " + std::string(cls_name));
  EncodedValue a = peers_->adopt(args);
  const std::uint64_t id = table_->create(cls, gi, a, PeerCaller{rank, world}, chain_->chain());
  return {id, proto::Made{gi, table_->workers_of(id), cls.name, std::move(a)}};
}

std::uint64_t GroupCalls::call(std::uint64_t instance, std::string_view method,
                               const twk_value_v1& args, const std::string& caller, int rank,
                               int world) {
  return table_->call(instance, method, peers_->adopt(args), caller, PeerCaller{rank, world},
                      chain_->chain());
}

void GroupCalls::attach(std::string_view cls_name, std::string_view group, std::uint64_t instance) {
  const plugins::ClassInfo& cls = known_class(cls_name, "handle");
  table_->attach(instance, cls, known_group(group, "handle of " + std::string(cls_name)));
}

void GroupCalls::peer_lost(std::size_t peer, std::string text) {
  peers_->lost(peer, std::move(text));
}

void GroupCalls::peers_replaced(const proto::PeersReplaced& moved) {
  for (const auto& w : moved.workers) {
    const auto peer = peer_index(w.name);
    if (!peer || *peer == self_) continue;
    table_->replace_worker(*peer, w.pid, w.host, w.serve, moved.text);
    peers_->repoint(*peer, w.serve);
  }
  peers_->wake();
}

std::optional<std::size_t> GroupCalls::peer_index(const std::string& name) const {
  for (std::size_t i = 0; i < table_->workers().size(); ++i) {
    if (table_->workers()[i].name == name) return i;
  }
  return std::nullopt;
}

const plugins::ClassInfo& GroupCalls::known_class(std::string_view name,
                                                  const std::string& what) const {
  if (const plugins::ClassInfo* cls = plugin_.find_class(name)) return *cls;
  std::vector<std::string> names;
  for (const auto& c : plugin_.classes()) names.push_back(c.name);
  throw CallError(fmt::format("{}: the plugin has no class {} (it has: {})", what, name,
                              fmt::join(names, ", ")));
}

std::size_t GroupCalls::known_group(std::string_view name, const std::string& what) const {
  if (auto gi = table_->find_group(name)) return *gi;
  std::vector<std::string> names;
  for (const auto& g : table_->groups()) names.push_back(g.name);
  throw CallError(fmt::format("{}: the job has no group \"{}\" (it has: {})", what, name,
                              fmt::join(names, ", ")));
}

}  // namespace twinkle::core
