#include "core/jobs/demand.hpp"

#include <string>

namespace twinkle::core::jobs {

std::vector<transport::proto::GroupDemandEntry> group_demands(const Job& job) {
  std::vector<transport::proto::GroupDemandEntry> out;
  for (const auto& g : job.groups) {
    out.push_back(transport::proto::GroupDemandEntry{
        g.name, g.workers(), g.device == DeviceType::cuda ? g.gpus_per_worker : 0,
        std::string(to_string(g.placement.value_or(job.placement))), g.labels,
        static_cast<std::int64_t>(g.memory)});
  }
  return out;
}

}  // namespace twinkle::core::jobs
