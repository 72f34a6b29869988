#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/job/mesh.hpp"
#include "twinkle/value.hpp"

namespace twinkle::core {

enum class Mode { local, remote };
enum class DeviceType { cpu, cuda };
// How a group's workers spread over a cluster's nodes (Ray's placement strategies): pack onto as
// few nodes as possible, or spread over as many, best effort or strict.
enum class PlacementStrategy { pack, spread, strict_pack, strict_spread };

// Limits of a job file (documented in twinkle-job(5)).
inline constexpr std::size_t kMaxJobFileBytes = 1 << 20;  // 1 MiB
inline constexpr int kMaxDepth = 256;                     // nesting of tables, lists, keys
inline constexpr int kMaxRanks = 65536;                   // ranks 0..65535, in all groups
inline constexpr int kMaxGpusPerWorker = 1024;
inline constexpr std::size_t kMaxGroupName = 64;  // [A-Za-z0-9_.-]{1,64}
inline constexpr double kMaxTimeoutS = 7 * 86400.0;
inline constexpr int kMaxCheckpointKeep = 1000;  // job.checkpoint_keep
inline constexpr int kMaxRestarts = 1000;        // group.max_restarts

std::string_view to_string(Mode m);
std::string_view to_string(DeviceType d);
std::string_view to_string(PlacementStrategy s);
std::optional<PlacementStrategy> placement_strategy(std::string_view text);

// Where a value came from: "job.toml:12:9", or "--set group.model.ranks" for an override.
struct SourceRef {
  std::string text;
};

struct GroupSpec {
  std::string name;
  std::vector<int> ranks;  // global ranks, in the order of the group's workers
  DeviceType device = DeviceType::cpu;
  int gpus_per_worker = 1;
  // Remote mode: each worker's memory limit in bytes (0: none), enforced by the node's cgroups
  // and checked against the nodes' memory by the scheduler.
  std::uint64_t memory = 0;
  DeviceMesh mesh = DeviceMesh::data_parallel(1);
  std::optional<PlacementStrategy> placement;  // remote mode; unset: the job's
  std::map<std::string, std::string> labels;   // remote mode: nodes must carry all of them
  SourceRef where;                             // the [[group]] table
  SourceRef ranks_where;                       // its ranks key (or the table when absent)
  // Restarts (docs/ARCHITECTURE.md, Restarts): how many times in restart_window_s the group's
  // lost workers are replaced (0: a lost worker ends the run), how ("worker": only the lost
  // ranks, the others keep their processes and state; "group": every worker of the group), and
  // where a replacement's state comes from ("peer": a live copy from a surviving data-parallel
  // replica; "checkpoint": its part of the newest checkpoint; "none": it starts fresh). Without
  // the key, recover is "peer" for restart = "worker" in a mesh with dp >= 2, else
  // "checkpoint" when the job has a checkpoint_dir, else "none".
  int max_restarts = 0;
  std::string restart = "worker";
  double restart_window_s = 600;
  std::string recover;  // "" until the job is read: then "peer", "checkpoint" or "none"

  int workers() const { return static_cast<int>(ranks.size()); }
};

struct NotifySpec {
  std::string webhook;
  std::string kind = "json";  // "json" | "dingtalk"
  std::string secret;
};

// A parsed and validated job file (docs/ARCHITECTURE.md, Job file). Plain data; copyable.
struct Job {
  std::filesystem::path file;  // as given on the command line
  std::string name;
  Mode mode = Mode::local;
  std::string plugin;                 // as written in the file
  std::filesystem::path plugin_path;  // resolved against the job file's folder
  SourceRef plugin_where;
  std::string driver = "main";
  std::int64_t seed = 0;
  double timeout_s = 600;
  std::string collectives = "auto";  // "auto" | "shm" | "gloo": the cpu groups' backend
  std::string address;
  std::string launcher;          // "" (by mode) | "slurm": remote mode inside a Slurm allocation
  int nproc_per_node = 0;        // 0: not set
  double queue_timeout_s = 300;  // remote mode: how long to wait for busy devices
  PlacementStrategy placement = PlacementStrategy::pack;
  // Checkpoints (docs/ARCHITECTURE.md, Checkpoints): where they go (resolved against the job
  // file's folder; empty: none), how many complete ones are kept, whether a run resumes from the
  // newest without --resume ("auto"), and how long a stop request leaves the driver entry.
  std::filesystem::path checkpoint_dir;
  int checkpoint_keep = 3;
  bool resume_auto = false;
  double stop_grace_s = 30;
  // A submitted job on a cluster with quotas (docs/ARCHITECTURE.md, Teams and quotas): false,
  // it never runs beyond its team's quota, so it is never preempted.
  bool preemptible = true;
  // A submitted job's driver runs on a node that carries all of these labels (its agent starts
  // it); empty: on the head's machine. `twinkle run` runs the driver where it is typed.
  std::map<std::string, std::string> driver_labels;
  std::vector<GroupSpec> groups;
  Value args = Value::map();  // [args], free-form
  std::optional<NotifySpec> notify;

  const GroupSpec* find_group(std::string_view name) const;
  int world_size() const;  // 1 + the highest rank of any group
};

// One `--set section.key=value` override. `group.NAME.key=value` addresses the group named NAME.
struct Override {
  std::string key;
  std::string value;
};
// Parses "key=value"; throws ConfigError naming the flag when there is no '=' or no key.
Override parse_override(std::string_view text);

// Reads, overrides and validates a job file. Throws ConfigError whose message starts with
// "FILE:LINE:COLUMN: " (or "--set KEY: ") and says the fix.
Job load_job(const std::filesystem::path& file, const std::vector<Override>& overrides = {});
// Same, from text; `file` names it in messages and anchors the plugin path.
Job parse_job(std::string_view text, const std::filesystem::path& file,
              const std::vector<Override>& overrides = {});

// The cpu groups' collectives backend for a run of `job`: `env` (the value of TWINKLE_COLLECTIVES,
// or null) overrides job.collectives. Throws ConfigError if `env` is not "auto", "shm" or "gloo".
std::string collectives_backend(const Job& job, const char* env);

// The closest of `candidates` to `word` within a small edit distance, for "did you mean" hints.
std::optional<std::string> closest_match(std::string_view word,
                                         const std::vector<std::string>& candidates);

}  // namespace twinkle::core
