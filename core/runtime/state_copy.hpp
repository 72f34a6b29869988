#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "core/runtime/communicators.hpp"
#include "core/runtime/group_calls.hpp"
#include "core/runtime/inbox.hpp"
#include "core/runtime/instances.hpp"
#include "transports/zmq/peers.hpp"

// A worker's side of restart = "worker" with recover = "peer" (docs/ARCHITECTURE.md, Restarts):
// as a survivor it makes its group's communicators again at the new generation and, as a donor,
// takes its state at the regroup and gives it to the replacement that pulls it; as a replacement
// it pulls its instances' state from a surviving replica and loads it. Used from the worker's
// thread.
namespace twinkle::core {

class StateCopy {
 public:
  // `name`: this worker's; `timeout`: the job's, for a pull that gets no answer.
  StateCopy(std::string name, Instances& instances, Communicators& comms,
            transport::ServeSocket& serve, GroupCalls& calls, std::chrono::milliseconds timeout)
      : name_(std::move(name)),
        instances_(instances),
        comms_(comms),
        serve_(serve),
        calls_(calls),
        timeout_(timeout) {}

  // A create or call is about to run: the state taken for a replacement is not this worker's
  // any more.
  void changed() { taken_.reset(); }
  // Everything sent before this was of the group as it was.
  void regroup(const transport::proto::Regroup& g);
  // A replacement's pull (a StatePull from another worker): answered now, or once this worker
  // is regrouped at the pull's generation.
  void pull(Inbox::Pending p);
  // This replacement's instances take the state of the same instances on `r.donor`.
  transport::proto::Recovered recover(const transport::proto::Recover& r);

 private:
  transport::proto::State state();
  transport::proto::State take_state();

  std::string name_;
  Instances& instances_;
  Communicators& comms_;
  transport::ServeSocket& serve_;
  GroupCalls& calls_;
  std::chrono::milliseconds timeout_;
  std::vector<Inbox::Pending> held_;              // pulls of a newer generation than this one's
  std::optional<transport::proto::State> taken_;  // a donor's state, taken at its regroup
};

}  // namespace twinkle::core
