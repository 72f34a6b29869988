#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/job/job.hpp"
#include "core/runtime/call_table.hpp"
#include "transports/zmq/protocol.hpp"
#include "twinkle/value.hpp"

// The communicators across groups that a driver entry declared (docs/ARCHITECTURE.md,
// Collectives and Restarts), on the driver: their members checked, each member told its rank on
// its ordered channel before any call that uses it, and declared again at a new generation when
// a member's group restarts. Used from the driver's thread only.
namespace twinkle::core {

class CrossComms {
 public:
  // Sends a message to worker `peer` (throws TransportError when it is gone).
  using Send = std::function<void(std::size_t peer, const transport::Message&)>;
  explicit CrossComms(Send send) : send_(std::move(send)) {}

  // Declares communicator `name` of `members` ([[group, [indices]]...]; no indices: the whole
  // group) and tells each member its rank. Throws CallError for a name that is taken, not a
  // valid name or a mesh dimension's, an unknown group or worker, a worker listed twice, groups
  // of different device types, or no member. `timeout_s` <= 0: the job's.
  void create(const std::string& name, const Value& members, double timeout_s, const Job& job,
              const CallTable& table);
  // The names of those that include a worker of group `g`.
  std::vector<std::string> with_group(std::size_t g, const CallTable& table) const;
  // How many times `name` was declared again.
  int generation(const std::string& name) const { return comms_.at(name).generation; }
  // Declares `name` again at its next generation (a member's group is restarting).
  void renew(const std::string& name);
  // Tells every member of `name` its rank and the generation again (a member that is gone is
  // skipped: its loss is on its way).
  void declare(const std::string& name) const;

 private:
  struct Comm {
    std::vector<std::size_t> peers;  // by rank
    std::vector<std::string> names;  // "group:index" by rank
    double timeout_s = 0;
    int generation = 0;
  };
  static Comm members_of(const std::string& name, const Value& members, const Job& job,
                         const CallTable& table);

  Send send_;
  std::map<std::string, Comm> comms_;
};

}  // namespace twinkle::core
