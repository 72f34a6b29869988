#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <set>
#include <string>
#include <utility>

// A run's workers in control groups of their own (docs/ARCHITECTURE.md, Isolation): the run's
// CPU quota (the CPUs its workers hold on this node) and each worker's memory limit, and whether
// the kernel's OOM killer ended a worker. cgroup v2 where it is mounted with the cpu and memory
// controllers, else the v1 cpu and memory hierarchies; nothing where neither can be written.
namespace twinkle::core {

struct CgroupSupport {
  enum class Kind { none, v1, v2 };
  Kind kind = Kind::none;
  std::filesystem::path cpu, memory;  // v1: the two hierarchies' twinkle folders; v2: both the same
  std::string why_not;                // Kind::none: why

  // "cgroup v2 (cpu, memory)", "cgroup v1 (cpu, memory)" or "not enforced: WHY".
  std::string describe() const;
};

// Looks under `root` (/sys/fs/cgroup) for a hierarchy this process may make folders in, and
// makes its `twinkle` folder there (v2: with the cpu and memory controllers enabled for it).
// Never throws: what does not work is said in `why_not`.
CgroupSupport probe_cgroups(const std::filesystem::path& root = "/sys/fs/cgroup");

// Removes the run folders whose names end in `suffix` (".NODE": this agent's) that a killed
// agent left; folders that still hold processes stay.
void sweep_cgroups(const CgroupSupport& support, const std::string& suffix);

// One run's cgroups on this node: twinkle/RUN with the CPU quota, and twinkle/RUN/WORKER per
// worker with its memory limit. The destructor removes them (once the workers are gone; a
// folder that still has processes is left). Not thread-safe: one owner.
class RunCgroup {
 public:
  // Throws Error naming the folder when it cannot be made or the quota cannot be set.
  RunCgroup(const CgroupSupport& support, const std::string& run, int cpus);
  RunCgroup(const RunCgroup&) = delete;
  RunCgroup& operator=(const RunCgroup&) = delete;
  ~RunCgroup();

  // Moves `pid` into `worker`'s cgroup with a memory limit of `memory` bytes (0: none). Throws
  // Error naming the file when the kernel refuses.
  void add(const std::string& worker, pid_t pid, std::uint64_t memory);
  // True when the kernel's OOM killer killed a process of `worker`'s cgroup. Reads the kernel's
  // counter only: safe from any thread, also while add() runs.
  bool oom_killed(const std::string& worker) const;
  // The run holds `cpus` CPUs here now (workers moved to this node from a DEAD one).
  void set_cpus(int cpus);

 private:
  // Writes the CPU quota of `cpus`; the file and why not on failure.
  std::pair<std::filesystem::path, std::string> write_quota(int cpus) const;
  std::filesystem::path folder(const std::filesystem::path& root, const std::string& worker) const;

  CgroupSupport s_;
  std::string run_;
  std::set<std::string> workers_;  // their folders (add()'s thread only)
};

}  // namespace twinkle::core
