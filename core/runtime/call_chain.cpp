#include "core/runtime/call_chain.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace twinkle::core {

namespace proto = transport::proto;

std::string CallChain::link_text(const proto::ChainLink& f) {
  return fmt::format("{} {}{}", f.worker, f.what,
                     f.caller.empty() ? "" : " (called at " + f.caller + ")");
}

std::string CallChain::current() const {
  const Chain& c = chain();
  return c.empty() ? name_ : link_text(c.back());
}

void CallChain::begin(const Chain& chain, bool from_driver, std::function<std::string()> what,
                      const std::string& caller) {
  incoming_ = &chain;
  caller_ = &caller;
  what_ = std::move(what);
  from_driver_ = from_driver;
  built_ = false;
  token_ = ++tokens_;
  busy_ = true;
}

const CallChain::Chain& CallChain::chain() const {
  if (!busy_ || built_) return chain_;
  chain_.clear();
  if (from_driver_) {
    chain_.push_back(proto::ChainLink{"driver", 0, "entry", *caller_});
  } else {
    chain_ = *incoming_;
  }
  chain_.push_back(proto::ChainLink{name_, token_, what_(), from_driver_ ? "" : *caller_});
  built_ = true;
  return chain_;
}

void CallChain::end() {
  busy_ = false;
  built_ = false;
  incoming_ = nullptr;
  caller_ = nullptr;
  what_ = nullptr;
  chain_.clear();
}

std::optional<std::string> CallChain::find_cycle(const Chain& chain, const std::string& from,
                                                 const std::string& what,
                                                 const std::string& caller) const {
  if (!busy_) return std::nullopt;
  const std::string asked =
      fmt::format("{} {}{}", name_, what, caller.empty() ? "" : " (called at " + caller + ")");
  const std::string now = current();
  std::vector<std::string> path;
  bool through_me = false;
  for (const auto& f : chain) {
    if (!through_me && f.worker == name_ && f.token == token_) through_me = true;
    if (through_me) path.push_back(link_text(f));
  }
  if (!through_me) {
    // Not nested in this worker's call, but from a worker that this call waits for.
    const auto index = peers_.index_of(from);
    const auto waits = peers_.waiting();  // the call in wait(), if any
    if (!index || std::find(waits.begin(), waits.end(), *index) == waits.end()) return std::nullopt;
    path = {now, chain.empty() ? from : link_text(chain.back())};
  }
  path.push_back(asked);
  return fmt::format(
      "deadlock: a cycle of calls: {}; {} runs one call at a time and is still in {}, so this "
      "call could never start. Return what the caller needs instead of calling back",
      fmt::join(path, " -> "), name_, now);
}

// Rings of workers that wait on each other are found by edge chasing: a worker that waits sends
// a probe along each call it waits for; a worker that gets one while it waits itself passes it
// on along its own; a probe that comes back to the worker that sent it, while it still waits in
// the same call, went round a cycle.
void CallChain::send_probes() {
  if (!busy_) return;
  const auto waits = peers_.waiting();
  if (waits.empty()) return;
  forward(proto::Probe{name_, token_, {name_}, {current()}}, waits);
}

void CallChain::forward(const proto::Probe& probe, const std::vector<std::size_t>& to) {
  for (std::size_t p : to) peers_.send_probe(p, probe);
}

void CallChain::on_probe(proto::Probe& probe) {
  if (!busy_) return;
  if (probe.origin == name_) {
    if (probe.token != token_ || probe.nodes.size() < 2) return;
    const auto first = peers_.index_of(probe.nodes[1]);
    if (!first) return;
    peers_.fail_waiting(
        *first, fmt::format("deadlock: a cycle of calls that wait on each other: {} -> {}; a "
                            "worker runs one call at a time, so none of them could finish. "
                            "Return what the caller needs instead of calling back",
                            fmt::join(probe.path, " -> "), name_));
    return;
  }
  for (const auto& n : probe.nodes) {
    if (n == name_) return;  // a cycle that the others report
  }
  const auto waits = peers_.waiting();
  if (waits.empty()) return;
  probe.nodes.push_back(name_);
  probe.path.push_back(current());
  forward(probe, waits);
}

}  // namespace twinkle::core
