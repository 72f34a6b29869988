#pragma once

#include <vector>

#include "core/job/job.hpp"
#include "transports/zmq/protocol.hpp"

// What a job asks of a cluster's head (docs/ARCHITECTURE.md, Job service): the same for the
// queue of submitted jobs and for a driver's reservation.
namespace twinkle::core::jobs {

// The groups of `job`, in order: workers, GPUs per worker, placement strategy and labels.
std::vector<transport::proto::GroupDemandEntry> group_demands(const Job& job);

}  // namespace twinkle::core::jobs
