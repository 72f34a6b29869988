#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/runtime/call_table.hpp"

namespace twinkle::core {

// What is known when a run fails.
struct FailureFacts {
  std::string job;
  std::string run_id;
  std::optional<LostWorker> lost;  // the first worker lost: the root cause when present
  std::string error;               // what the driver entry (or the start-up) reported
};

// The one summary a failed run prints (docs/ARCHITECTURE.md, Results and errors), root cause first:
//   twinkle: job "digits" failed (run 1a2b3c4d)
//     root cause: worker model:2 (host h, pid 42) exited with code 3; its last stderr lines:
//       | ...
//     the driver was waiting on: Model.step (driver caller: train.cpp:42)
//     then the driver: ...            (only when it says something the root cause does not)
std::string failure_summary(const FailureFacts& facts);

// The line the failure notification carries: the root cause.
std::string root_cause(const FailureFacts& facts);

}  // namespace twinkle::core
