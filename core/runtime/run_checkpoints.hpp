#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "core/job/job.hpp"
#include "core/runtime/call_table.hpp"
#include "core/runtime/checkpoint.hpp"
#include "twinkle/value.hpp"

// A run's checkpoints as its driver sees them (docs/ARCHITECTURE.md, Checkpoints): the one it
// resumes from, writing one (every worker its part, then the manifest), the newest that a group's
// restart may start from, and where a run stopped on request stands. Used from the driver's
// thread only.
namespace twinkle::core {

class RunCheckpoints {
 public:
  // `job` outlives this object.
  RunCheckpoints(const Job& job, std::string run_id) : job_(job), run_id_(std::move(run_id)) {}

  // The job's checkpoint_dir, absolute.
  std::filesystem::path root() const;
  // With --resume (`asked`) or resume = "auto": the newest complete checkpoint, checked against
  // the job before anything starts. Returns what to tell the user once the topology is printed.
  // Throws ConfigError when --resume cannot be honoured (no checkpoint_dir, no checkpoint, one
  // of other groups or meshes).
  std::string choose_resume(bool asked);
  // The checkpoint this run started from.
  const std::optional<checkpoint::Found>& resume() const { return resume_; }
  // {step, meta} of that checkpoint for the driver entry; null when it started fresh.
  Value resumed() const;

  // Writes the checkpoint of `step`: every worker of `table` its part into a hidden folder, then
  // the manifest makes it a checkpoint. False without a checkpoint_dir. Throws CallError naming
  // the step and what failed; nothing published changes then.
  bool write(std::int64_t step, const Value& meta, CallTable& table);
  // The newest checkpoint of this run or of the one it resumed from (a group's restart with
  // recover = "checkpoint"); none when there is no such checkpoint.
  std::optional<checkpoint::Found> for_restart() const;
  // "after the checkpoint of step N (DIR)", for a run stopped on request.
  std::string where() const;

 private:
  const Job& job_;
  std::string run_id_;
  std::optional<checkpoint::Found> resume_;  // the checkpoint this run started from
  std::filesystem::path last_;               // the newest this run published
  std::optional<std::int64_t> last_step_;
};

}  // namespace twinkle::core
