#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "core/job/mesh.hpp"
#include "transports/communicator.hpp"
#include "transports/zmq/auth.hpp"
#include "transports/zmq/kv.hpp"
#include "transports/zmq/protocol.hpp"
#include "twinkle/plugin.h"

// A worker's communicators (docs/ARCHITECTURE.md, Collectives): the group's, one per mesh
// dimension, and those across groups that the driver declared. Used from the worker's thread.
namespace twinkle::core {

// Where a worker's communicators meet and what they are made of.
struct CommunicatorSetup {
  std::string group;  // its group's name
  int rank = 0;       // in the group
  int world = 1;
  DeviceMesh mesh = DeviceMesh::data_parallel(1);
  std::string device;       // "cpu" | "cuda"
  std::string collectives;  // cpu groups: "auto" | "shm" | "gloo"
  std::chrono::milliseconds timeout{600'000};
  std::string kv_endpoint;  // the run's rendezvous store
  transport::SocketSecurity security;
  std::string node_ip;  // remote workers: the address Gloo binds to ("": loopback)
  int generation = 0;   // restarts of the group: a restarted group's rendezvous keys are new
};

class Communicators {
 public:
  Communicators(zmq::context_t& context, CommunicatorSetup setup);

  // This worker's place in a communicator across groups (the driver's comm_join). Declared again
  // at a new generation (a member's group restarted), it is made afresh on next use; the old one
  // is kept until the end (a call in progress may hold it).
  void join(const transport::proto::CommJoin& m);
  // The rendezvous name of communicator across groups `name` at `generation`: "cross/NAME", then
  // "cross/NAME@GENERATION" after a member's group restarted.
  static std::string cross_key(const std::string& name, int generation) {
    return generation ? "cross/" + name + "@" + std::to_string(generation) : "cross/" + name;
  }
  // Whether `name` is a communicator across groups that this worker is in.
  bool is_cross(const std::string& name) const { return cross_.count(name) > 0; }

  // The communicator of `dim` ("" = the group, a mesh dimension, or a communicator across
  // groups), made on first use. Throws ValueError for a name that is none of them and
  // TransportError when the members do not meet.
  transport::Communicator& get(const std::string& dim);

  // Runs collective `op` ("all_reduce", ..., "communicator" for comm_info) with `f` on the
  // communicator of `dim`: TWK_OK, or TWK_ERROR with a message in `err` that names the
  // collective, the group (or the communicator across groups) and this worker's rank.
  std::int32_t run(const char* dim, twk_sink_v1* err, const char* op,
                   const std::function<void(transport::Communicator&)>& f);

  // Destroys every communicator (shutdown).
  void clear() {
    comms_.clear();
    stale_.clear();
  }
  // The group's lost ranks were replaced (restart = "worker"): its communicators are made again
  // on next use, with the rendezvous keys of `generation`. Communicators across groups stay until
  // the driver declares them again (join).
  int generation() const { return setup_.generation; }
  void regroup(int generation) {
    setup_.generation = generation;
    std::erase_if(comms_, [this](const auto& c) { return !cross_.count(c.first); });
  }

 private:
  // The group's name in rendezvous keys: "model", "model@2" after its second restart.
  std::string group_key() const {
    return setup_.generation ? setup_.group + "@" + std::to_string(setup_.generation)
                             : setup_.group;
  }
  struct Cross {
    int rank = 0;
    std::vector<std::string> members;  // "group:index" by rank
    std::chrono::milliseconds timeout{0};
    int generation = 0;  // of its keys (cross_key)
  };

  void meet(const std::string& name, const Cross& c, transport::CommConfig& config);

  zmq::context_t& context_;
  CommunicatorSetup setup_;
  std::unique_ptr<transport::KvClient> kv_;
  std::map<std::string, std::unique_ptr<transport::Communicator>> comms_;
  std::map<std::string, Cross> cross_;  // by name
  std::map<std::string, int> made_at_;  // communicators across groups made: at which generation
  std::vector<std::unique_ptr<transport::Communicator>> stale_;  // of earlier generations
};

// Fills the collectives of a worker's host table (comm_info, all_reduce, broadcast, all_gather,
// reduce_scatter, barrier): each runs through Communicators::run of its host context's
// HostOps::communicators(), checking the dtype and reduce op the plugin passed.
void set_collectives(twk_host_v1& host);

}  // namespace twinkle::core
