#include "core/runtime/run_restarts.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/runtime/communicators.hpp"

namespace twinkle::core {

RunRestarts::RunRestarts(Parts parts) : p_(std::move(parts)) {
  const std::size_t groups = p_.table.groups().size();
  generation_.assign(groups, 0);
  times_.assign(groups, {});
  resume_.assign(groups, std::nullopt);
}

void RunRestarts::install() {
  const auto& groups = p_.table.groups();
  std::vector<bool> restartable(p_.table.workers().size(), false);
  bool any = false;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    if (p_.job.groups[gi].max_restarts == 0) continue;
    any = true;
    for (std::size_t p : groups[gi].peers) restartable[p] = true;
  }
  if (!any) return;
  p_.launcher.set_restartable(std::move(restartable));
  p_.table.set_restarts(
      Restarts{[this](std::size_t peer, const std::string& text) { return decide(peer, text); },
               [this](std::size_t g, const std::vector<std::size_t>& peers) { respawn(g, peers); },
               [this](std::size_t g, const std::string& donors) { back(g, donors); },
               [this](std::size_t g) { return recovered_from(g); },
               [this](std::size_t g) { return p_.job.groups.at(g).max_restarts > 0; },
               [this](std::size_t g) { return p_.job.groups.at(g).restart == "group"; },
               [this](std::size_t g) { return p_.job.groups.at(g).recover == "peer"; },
               [this](std::size_t g) { return generation_.at(g); },
               [this](std::size_t g) {
                 for (const auto& name : p_.comms.with_group(g, p_.table)) p_.comms.declare(name);
               },
               p_.find_class});
}

// Whether the loss of `peer` restarts its group: the group's budget in its window, and no rank
// that keeps dying before it completes a call.
Restarts::Decision RunRestarts::decide(std::size_t peer, const std::string& text) {
  const WorkerInfo& w = p_.table.workers()[peer];
  const GroupSpec& spec = p_.job.groups.at(w.group);
  if (spec.max_restarts == 0) return {};
  const auto now = std::chrono::steady_clock::now();
  const auto window = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(spec.restart_window_s));
  auto& deaths = early_deaths_[peer];
  if (w.completed) deaths.clear();
  deaths.push_back(now);
  while (!deaths.empty() && deaths.front() < now - window) deaths.pop_front();
  if (deaths.size() >= kCrashLoopDeaths) {
    return {std::nullopt,
            fmt::format("rank {} of group {} died {} times in {:.0f} s before completing a call "
                        "(a crash loop; no more restarts): {}",
                        w.index, spec.name, deaths.size(),
                        std::chrono::duration<double>(now - deaths.front()).count(), text)};
  }
  auto& times = times_[w.group];
  while (!times.empty() && times.front() < now - window) times.pop_front();
  if (static_cast<int>(times.size()) >= spec.max_restarts) {
    return {std::nullopt,
            fmt::format("{}; group {} has no restarts left ({} in the last {:g} s: "
                        "max_restarts = {})",
                        text, spec.name, times.size(), spec.restart_window_s, spec.max_restarts)};
  }
  // The first restart at once, then 1 s doubling to 30 s.
  const auto after = std::chrono::milliseconds(
      times.empty() ? 0
                    : std::min<std::int64_t>(30'000, std::int64_t{1000} << std::min<std::size_t>(
                                                         times.size() - 1, 5)));
  times.push_back(now);
  ++generation_[w.group];
  // The communicators of the group's earlier generations never form now: a survivor waiting at
  // their rendezvous (for the lost rank) gets an error and goes on to its regroup.
  std::vector<std::string> retired{spec.name + "/"};
  for (int gen = 1; gen < generation_[w.group]; ++gen)
    retired.push_back(fmt::format("{}@{}/", spec.name, gen));
  // So are those of the communicators across groups that include it: they are declared again at
  // once (their members in other groups meet at the new keys, where the replacements join them
  // once the group is back: reform).
  std::vector<std::string> cross = p_.comms.with_group(w.group, p_.table);
  for (const auto& name : cross)
    retired.push_back(Communicators::cross_key(name, p_.comms.generation(name)) + "/");
  p_.kv.retire(std::move(retired), fmt::format("a worker of group {} was lost and is being "
                                               "replaced; this communicator will not form",
                                               spec.name));
  for (const auto& name : cross) p_.comms.renew(name);
  log_.push_back(Record{spec.name, w.index, text, now, std::nullopt, generation_[w.group], ""});
  std::fflush(stdout);
  std::fprintf(stderr, "twinkle: restarting group %s (restart %zu of %d in %g s)%s: %s\n",
               spec.name.c_str(), times.size(), spec.max_restarts, spec.restart_window_s,
               after.count() ? fmt::format(" in {:g} s", after.count() / 1000.0).c_str() : "",
               text.substr(0, text.find('\n')).c_str());
  std::fflush(stderr);
  return {std::optional<std::chrono::milliseconds>(after), ""};
}

// Replaces `peers` of group `g` (every worker with restart = "group"); with recover =
// "checkpoint" they get their parts of the newest checkpoint of this run (or of the one it
// resumed from).
void RunRestarts::respawn(std::size_t g, const std::vector<std::size_t>& peers) {
  p_.replaced();
  resume_[g].reset();
  if (p_.job.groups[g].recover == "checkpoint") resume_[g] = p_.checkpoints.for_restart();
  const std::string count = std::to_string(generation_[g]);
  replaced_where_ = p_.launcher.restart(
      peers, {"TWINKLE_RESTART_COUNT=" + count, "TORCHELASTIC_RESTART_COUNT=" + count});
  replaced_.clear();
  for (std::size_t p : peers) replaced_.push_back(p_.table.workers()[p].name);
}

std::string RunRestarts::recovered_from(std::size_t g) const {
  const std::string& recover = p_.job.groups[g].recover;
  if (recover == "peer") return ", with the state of a surviving replica";
  if (recover != "checkpoint") return ", without state";
  if (resume_[g])
    return fmt::format(", with the state of the checkpoint of step {}", resume_[g]->manifest.step);
  return ", without state: no checkpoint yet";
}

void RunRestarts::back(std::size_t g, const std::string& donors) {
  const std::string& name = p_.table.groups()[g].name;
  for (auto it = log_.rbegin(); it != log_.rend(); ++it) {
    if (it->group != name || it->recovered_s) continue;
    it->recovered_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - it->lost_at).count();
    std::fflush(stdout);
    std::string how = ", without state";
    if (!donors.empty()) {
      how = ", state copied " + donors;
    } else if (resume_[g]) {
      how = fmt::format(", from the checkpoint of step {}", resume_[g]->manifest.step);
    }
    it->how = fmt::format("{} replaced{}{}", fmt::join(replaced_, ", "),
                          replaced_where_.empty() ? "" : " (" + replaced_where_ + ")", how);
    std::fprintf(stderr, "twinkle: group %s is back (restart %d, %.2f s after the loss; %s)\n",
                 name.c_str(), it->number, *it->recovered_s, it->how.c_str());
    std::fflush(stderr);
    break;
  }
}

void RunRestarts::print() const {
  if (log_.empty()) return;
  std::fflush(stdout);
  std::fprintf(stderr, "twinkle: %zu restart(s) in this run:\n", log_.size());
  for (const auto& r : log_) {
    std::fprintf(stderr, "  group %s, rank %d: %s; %s\n", r.group.c_str(), r.rank,
                 r.cause.substr(0, r.cause.find('\n')).c_str(),
                 r.recovered_s ? fmt::format("back in {:.2f} s ({})", *r.recovered_s, r.how).c_str()
                               : "not back");
  }
  std::fflush(stderr);
}

}  // namespace twinkle::core
