#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <zmq.hpp>

#include "core/runtime/call_chain.hpp"
#include "core/runtime/call_table.hpp"
#include "plugins/loader.hpp"
#include "transports/zmq/auth.hpp"
#include "transports/zmq/channel.hpp"
#include "transports/zmq/peers.hpp"

// A worker's calls to other groups (docs/ARCHITECTURE.md, Calls between groups): its connections
// to the run's other workers (a PeerChannel), the call table over them, and the chain of what it
// runs with the cycle checks (CallChain). Made from the driver's welcome. Used from the worker's
// thread.
namespace twinkle::core {

class GroupCalls {
 public:
  // What the worker's other sockets need while a call of its own waits: the driver's link and
  // the socket other workers call it on are read by `on_link` and `on_serve`.
  struct Watched {
    transport::Waitable link;
    std::function<void()> on_link;
    transport::Waitable serve;
    std::function<void()> on_serve;
  };

  // `name`: this worker's ("model:1"); `security`: the run's keys, if any (every worker of the
  // run has the same pair, so it is also the server key it connects to).
  GroupCalls(zmq::context_t& context, const std::string& name,
             const transport::proto::Welcome& welcome, const plugins::Plugin& plugin,
             const transport::SocketSecurity& security, std::chrono::milliseconds timeout,
             Watched watched);

  // HostOps, from the worker's plugin: `rank` of `world` in this worker's group (execute = peer).
  // create() returns the handle and what the driver records of it (proto::Made).
  std::pair<std::uint64_t, transport::proto::Made> create(std::string_view cls,
                                                          std::string_view group,
                                                          const twk_value_v1& args, int rank,
                                                          int world);
  std::uint64_t call(std::uint64_t instance, std::string_view method, const twk_value_v1& args,
                     const std::string& caller, int rank, int world);
  EncodedValue wait(std::uint64_t future) { return table_->wait(future); }
  void release(std::uint64_t future) { table_->release(future); }
  void attach(std::string_view cls, std::string_view group, std::uint64_t instance);

  // The driver's news of the run's workers: `peer` lost, or a group's replacements serving
  // elsewhere (calls waiting on the old ones fail with `text`).
  void peer_lost(std::size_t peer, std::string text);
  void peers_replaced(const transport::proto::PeersReplaced& moved);

  // The run-wide index of the worker called `name` (nullopt: not a worker of this run).
  std::optional<std::size_t> peer_index(const std::string& name) const;
  std::size_t self() const { return self_; }
  const std::vector<WorkerInfo>& workers() const { return table_->workers(); }
  transport::PeerChannel& peers() { return *peers_; }
  CallChain& chain() { return *chain_; }

 private:
  const plugins::ClassInfo& known_class(std::string_view name, const std::string& what) const;
  std::size_t known_group(std::string_view name, const std::string& what) const;

  const plugins::Plugin& plugin_;
  std::size_t self_ = 0;                           // this worker's index in the run
  std::unique_ptr<transport::PeerChannel> peers_;  // this worker's connections to the others
  std::unique_ptr<CallTable> table_;               // its calls to other groups
  std::unique_ptr<CallChain> chain_;               // what runs now, and the cycle checks
};

}  // namespace twinkle::core
