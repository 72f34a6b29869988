#include "core/runtime/state_copy.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace twinkle::core {

namespace proto = transport::proto;
using transport::Message;

// Everything sent before this was of the group as it was: the group's communicators are made
// again at the new generation (their rendezvous keys are new, so the replacements meet the
// survivors there), and replacements that asked for this worker's state get it now. A donor
// takes its state here, while its replacement starts: the copy into new shared memory is then off
// the replacement's path, and nothing can change the state before the pull but a call or create
// that this worker runs first (calls to the group wait for it to be back).
void StateCopy::regroup(const proto::Regroup& g) {
  comms_.regroup(std::max(comms_.generation(), g.generation));
  taken_.reset();
  if (g.donor) taken_ = state();
  std::vector<Inbox::Pending> held = std::move(held_);
  held_.clear();
  for (Inbox::Pending& p : held) pull(std::move(p));
}

void StateCopy::pull(Inbox::Pending p) {
  if (p.message.get<proto::StatePull>()->generation > comms_.generation()) {
    held_.push_back(std::move(p));  // served once this worker is regrouped
  } else {
    serve_.reply(p.from, Message{p.message.id, take_state()});
  }
}

// This worker's state for a replacement, its tensors in shared memory for a local one.
proto::State StateCopy::state() {
  return instances_.state(
      name_, [this](const twk_value_v1& v) { return transport::adopt_to_shm(v, serve_.pool()); });
}

// The state taken at the regroup when nothing ran since, else the state now.
proto::State StateCopy::take_state() {
  if (!taken_) return state();
  proto::State s = std::move(*taken_);
  taken_.reset();
  return s;
}

// Asked for on the donor's socket for calls, worker to worker; loaded with load().
proto::Recovered StateCopy::recover(const proto::Recover& r) {
  const auto& workers = calls_.workers();
  const std::size_t self = calls_.self();
  if (r.donor >= workers.size() || r.donor == self)
    return proto::Recovered{fmt::format("no worker {} to recover from", r.donor), 0, 0, 0};
  const std::string donor = workers[r.donor].name;
  const std::string what = fmt::format("recovering the state of {} from {}", name_, donor);
  const std::uint64_t id = (static_cast<std::uint64_t>(self + 1) << 40) | (std::uint64_t{1} << 39);
  const auto started = std::chrono::steady_clock::now();
  try {
    calls_.peers().send(r.donor, Message{id, proto::StatePull{r.generation}});
  } catch (const std::exception& e) {
    return proto::Recovered{fmt::format("{}: {}", what, e.what()), 0, 0, 0};
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  std::optional<proto::State> got;
  while (!got) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return proto::Recovered{fmt::format("{}: no answer in {:g} s (the job's timeout_s)", what,
                                          std::chrono::duration<double>(timeout_).count()),
                              0, 0, 0};
    }
    auto e = calls_.peers().next(left);
    if (!e || e->peer != r.donor) continue;
    if (e->kind == transport::ChannelEvent::Kind::lost)
      return proto::Recovered{fmt::format("{}: {} was lost: {}", what, donor, e->reason), 0, 0, 0};
    if (e->kind != transport::ChannelEvent::Kind::message || e->message.id != id) continue;
    if (auto* st = e->message.get<proto::State>()) got = std::move(*st);
  }
  if (got->error) return proto::Recovered{fmt::format("{}: {}", what, *got->error), 0, 0, 0};
  const Instances::Loaded loaded = instances_.load(got->entries, what);
  if (loaded.error) return proto::Recovered{loaded.error, loaded.instances, loaded.bytes, 0};
  return proto::Recovered{
      std::nullopt, loaded.instances, loaded.bytes,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()};
}

}  // namespace twinkle::core
