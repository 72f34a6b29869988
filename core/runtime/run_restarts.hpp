#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/job/job.hpp"
#include "core/runtime/call_table.hpp"
#include "core/runtime/checkpoint.hpp"
#include "core/runtime/cross_comms.hpp"
#include "core/runtime/launcher.hpp"
#include "core/runtime/run_checkpoints.hpp"
#include "transports/zmq/kv.hpp"

// A run's restarts as its driver decides them (docs/ARCHITECTURE.md, Restarts): whether the loss
// of a worker restarts its group (the group's budget in its window, no crash loop), replacing its
// workers, what state they start from, the generation of its communicators, and the lines the
// user reads ("restarting group ...", "group ... is back", the list at the end). The call table
// asks through the Restarts it is given (install). Used from the driver's thread only.
namespace twinkle::core {

class RunRestarts {
 public:
  // What the restarts act on; all of them outlive this object. `replaced`: run before workers
  // are replaced (their pids and serve endpoints change); `find_class`: the plugin's class of a
  // name (Restarts::find_class).
  struct Parts {
    const Job& job;
    CallTable& table;
    transport::KvServer& kv;
    CrossComms& comms;
    Launcher& launcher;
    RunCheckpoints& checkpoints;
    std::function<void()> replaced;
    std::function<const plugins::ClassInfo*(std::string_view name)> find_class;
  };
  explicit RunRestarts(Parts parts);

  // Gives the call table and the launcher the restarts of the groups whose max_restarts is not
  // 0; nothing where none has any.
  void install();

  // How many times group `g` restarted (0 before its first; the welcome says it).
  int generation(std::size_t g) const { return generation_.at(g); }
  // The checkpoint the current replacements of group `g` start from; none without one.
  const std::optional<checkpoint::Found>& resume_of(std::size_t g) const { return resume_.at(g); }
  // The restarts of the run, one line each on stderr, for the end; nothing without any.
  void print() const;

 private:
  Restarts::Decision decide(std::size_t peer, const std::string& text);
  void respawn(std::size_t g, const std::vector<std::size_t>& peers);
  std::string recovered_from(std::size_t g) const;
  void back(std::size_t g, const std::string& donors);

  struct Record {
    std::string group;
    int rank = 0;
    std::string cause;  // the loss's text
    std::chrono::steady_clock::time_point lost_at;
    std::optional<double> recovered_s;  // until the group was back
    int number = 0;                     // the group's generation it started
    std::string how;                    // "model:2 replaced, state copied model:2 from model:0"
  };
  using Times = std::deque<std::chrono::steady_clock::time_point>;
  static constexpr std::size_t kCrashLoopDeaths = 3;

  Parts p_;
  std::vector<Record> log_;
  std::vector<std::string> replaced_;          // the workers the last respawn replaced
  std::string replaced_where_;                 // where they started, when the launcher says
  std::vector<int> generation_;                // by group
  std::vector<Times> times_;                   // by group: its restarts in the window
  std::map<std::size_t, Times> early_deaths_;  // by peer: deaths before it completed a call
  std::vector<std::optional<checkpoint::Found>> resume_;  // by group
};

}  // namespace twinkle::core
