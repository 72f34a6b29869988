#include "core/cluster/scheduler.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "core/job/size.hpp"

namespace twinkle::core::cluster {

namespace {

bool eligible(const NodeCapacity& n, const GroupDemand& d) {
  for (const auto& [k, v] : d.labels) {
    auto it = n.labels.find(k);
    if (it == n.labels.end() || it->second != v) return false;
  }
  return true;
}

// How many more workers of `d` node `n` holds.
int room(const NodeCapacity& n, const GroupDemand& d) {
  int r = n.cpus;
  if (d.gpus_per_worker > 0) r = std::min(r, static_cast<int>(n.gpus.size()) / d.gpus_per_worker);
  if (d.memory > 0 && n.memory >= 0)
    r = static_cast<int>(std::min<std::int64_t>(r, n.memory / d.memory));
  return std::max(r, 0);
}

Slot take(NodeCapacity& n, const GroupDemand& d) {
  Slot s;
  s.node = n.id;
  n.cpus -= 1;
  if (d.memory > 0 && n.memory >= 0) n.memory -= d.memory;
  s.gpus.assign(n.gpus.begin(), n.gpus.begin() + d.gpus_per_worker);
  n.gpus.erase(n.gpus.begin(), n.gpus.begin() + d.gpus_per_worker);
  return s;
}

std::string need_text(const GroupDemand& d, int workers) {
  const std::string memory =
      d.memory > 0 ? format_size(static_cast<std::uint64_t>(d.memory)) : std::string();
  if (d.gpus_per_worker > 0) {
    return memory.empty()
               ? fmt::format("{} worker(s) of {} GPU(s) and 1 CPU each", workers, d.gpus_per_worker)
               : fmt::format("{} worker(s) of {} GPU(s), 1 CPU and {} each", workers,
                             d.gpus_per_worker, memory);
  }
  return memory.empty() ? fmt::format("{} worker(s) of 1 CPU each", workers)
                        : fmt::format("{} worker(s) of 1 CPU and {} each", workers, memory);
}

std::optional<std::vector<Slot>> place_group(std::vector<NodeCapacity>& nodes, const GroupDemand& d,
                                             std::string* why) {
  std::vector<NodeCapacity*> cand;
  for (auto& n : nodes) {
    if (eligible(n, d)) cand.push_back(&n);
  }
  auto fail = [&](const std::string& text) -> std::optional<std::vector<Slot>> {
    if (why)
      *why = fmt::format("group \"{}\" ({}, placement {}): {}", d.name, need_text(d, d.workers),
                         to_string(d.strategy), text);
    return std::nullopt;
  };
  if (cand.empty()) {
    std::string labels;
    for (const auto& [k, v] : d.labels)
      labels += fmt::format("{}{}={}", labels.empty() ? "" : ",", k, v);
    return fail(labels.empty() ? std::string("no node can take it")
                               : fmt::format("no node carries the labels {}", labels));
  }
  // Most room first; ties keep the node table's order.
  std::stable_sort(cand.begin(), cand.end(), [&](const NodeCapacity* a, const NodeCapacity* b) {
    return room(*a, d) > room(*b, d);
  });
  std::vector<Slot> out;
  switch (d.strategy) {
    case PlacementStrategy::strict_pack: {
      for (auto* n : cand) {
        if (room(*n, d) < d.workers) continue;
        for (int i = 0; i < d.workers; ++i) out.push_back(take(*n, d));
        return out;
      }
      return fail(fmt::format("no single node has room for all of them (the most any has is {})",
                              room(*cand.front(), d)));
    }
    case PlacementStrategy::strict_spread: {
      for (auto* n : cand) {
        if (static_cast<int>(out.size()) == d.workers) break;
        if (room(*n, d) >= 1) out.push_back(take(*n, d));
      }
      if (static_cast<int>(out.size()) == d.workers) return out;
      return fail(fmt::format("they need {} distinct nodes with room, and {} have it", d.workers,
                              out.size()));
    }
    case PlacementStrategy::pack: {
      for (auto* n : cand) {
        while (static_cast<int>(out.size()) < d.workers && room(*n, d) >= 1)
          out.push_back(take(*n, d));
      }
      break;
    }
    case PlacementStrategy::spread: {
      bool progress = true;
      while (static_cast<int>(out.size()) < d.workers && progress) {
        progress = false;
        for (auto* n : cand) {
          if (static_cast<int>(out.size()) == d.workers) break;
          if (room(*n, d) >= 1) {
            out.push_back(take(*n, d));
            progress = true;
          }
        }
      }
      break;
    }
  }
  if (static_cast<int>(out.size()) == d.workers) return out;
  return fail(fmt::format("the nodes have room for {} of them", out.size()));
}

}  // namespace

std::optional<std::vector<std::vector<Slot>>> schedule(std::vector<NodeCapacity> nodes,
                                                       const std::vector<GroupDemand>& demands,
                                                       std::string* why) {
  std::vector<std::vector<Slot>> out;
  for (const auto& d : demands) {
    // What a job file can ask for (twinkle-job(5), LIMITS); a request beyond it is malformed.
    if (d.workers < 0 || d.workers > kMaxRanks || d.gpus_per_worker < 0 ||
        d.gpus_per_worker > kMaxGpusPerWorker) {
      if (why) {
        *why =
            fmt::format("group \"{}\": {} workers of {} GPUs each is not a request a job can make",
                        d.name, d.workers, d.gpus_per_worker);
      }
      return std::nullopt;
    }
    auto slots = place_group(nodes, d, why);
    if (!slots) return std::nullopt;
    out.push_back(std::move(*slots));
  }
  return out;
}

}  // namespace twinkle::core::cluster
