#include "core/runtime/cgroup.hpp"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core {

namespace fs = std::filesystem;

namespace {

constexpr std::int64_t kPeriodUs = 100000;  // the CPU quota's period: 100 ms

std::string read_text(const fs::path& file) {
  std::ifstream in(file);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Writes `value` to a cgroup file (one write, as the kernel wants it); errno's text on failure.
std::string write_value(const fs::path& file, const std::string& value) {
  std::ofstream out(file);
  if (!out) return std::strerror(errno);
  out << value;
  out.flush();
  if (!out) return std::strerror(errno ? errno : EIO);
  return "";
}

// mkdir that is content when the folder is there; errno's text on failure.
std::string make_folder(const fs::path& dir) {
  std::error_code ec;
  fs::create_directory(dir, ec);
  return ec ? ec.message() : "";
}

// The number after `key` in a flat keyed file ("oom_kill 1"), 0 when absent.
std::int64_t keyed(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  std::string k;
  std::int64_t v = 0;
  while (in >> k >> v) {
    if (k == key) return v;
  }
  return 0;
}

// A cgroup folder's name for a worker ("model:3" -> "model.3").
std::string folder_name(std::string worker) {
  for (auto& c : worker)
    if (c == ':' || c == '/') c = '.';
  return worker;
}

void remove_folder(const fs::path& dir) {
  if (!dir.empty()) ::rmdir(dir.c_str());  // a cgroup folder goes with rmdir, never unlink
}

}  // namespace

std::string CgroupSupport::describe() const {
  switch (kind) {
    case Kind::v2: return "cgroup v2 (cpu, memory)";
    case Kind::v1: return "cgroup v1 (cpu, memory)";
    case Kind::none: break;
  }
  return "not enforced: " + why_not;
}

CgroupSupport probe_cgroups(const fs::path& root) {
  CgroupSupport s;
  std::error_code ec;
  if (fs::exists(root / "cgroup.controllers", ec)) {
    std::istringstream words(read_text(root / "cgroup.controllers"));
    const std::set<std::string> controllers{std::istream_iterator<std::string>(words), {}};
    if (!controllers.count("cpu") || !controllers.count("memory")) {
      s.why_not = fmt::format("{} lacks the cpu or memory controller", root.string());
      return s;
    }
    const fs::path mine = root / "twinkle";
    if (auto why = make_folder(mine); !why.empty()) {
      s.why_not = fmt::format("cannot create {}: {} (run the agent as root)", mine.string(), why);
      return s;
    }
    // The controllers reach twinkle/ and, through it, each run's folder.
    (void)write_value(root / "cgroup.subtree_control", "+cpu +memory");
    if (auto why = write_value(mine / "cgroup.subtree_control", "+cpu +memory"); !why.empty()) {
      s.why_not =
          fmt::format("cannot enable the cpu and memory controllers in {}: {}", mine.string(), why);
      remove_folder(mine);
      return s;
    }
    s.kind = CgroupSupport::Kind::v2;
    s.cpu = s.memory = mine;
    return s;
  }
  fs::path cpu, memory;
  for (const char* name : {"cpu", "cpu,cpuacct", "cpuacct,cpu"}) {
    if (fs::exists(root / name / "cpu.cfs_quota_us", ec)) {
      cpu = root / name;
      break;
    }
  }
  if (fs::exists(root / "memory" / "memory.limit_in_bytes", ec)) memory = root / "memory";
  if (cpu.empty() || memory.empty()) {
    s.why_not =
        fmt::format("no cgroup v2 and no v1 cpu and memory hierarchies under {}", root.string());
    return s;
  }
  for (const auto& dir : {cpu / "twinkle", memory / "twinkle"}) {
    if (auto why = make_folder(dir); !why.empty()) {
      s.why_not = fmt::format("cannot create {}: {} (run the agent as root)", dir.string(), why);
      return s;
    }
  }
  s.kind = CgroupSupport::Kind::v1;
  s.cpu = cpu / "twinkle";
  s.memory = memory / "twinkle";
  return s;
}

RunCgroup::RunCgroup(const CgroupSupport& support, const std::string& run, int cpus)
    : s_(support), run_(folder_name(run)) {
  if (s_.kind == CgroupSupport::Kind::none)
    throw Error("cgroups are not usable here: " + s_.why_not);
  auto fail = [&](const fs::path& at, const std::string& why) {
    remove_folder(s_.memory / run_);
    remove_folder(s_.cpu / run_);
    throw Error(fmt::format("cannot set up the run's cgroup {}: {}", at.string(), why));
  };
  const fs::path cpu = s_.cpu / run_;
  if (auto why = make_folder(cpu); !why.empty()) fail(cpu, why);
  if (auto [at, why] = write_quota(cpus); !why.empty()) fail(at, why);
  if (s_.kind == CgroupSupport::Kind::v2) {
    if (auto why = write_value(cpu / "cgroup.subtree_control", "+memory"); !why.empty())
      fail(cpu / "cgroup.subtree_control", why);
  } else {
    const fs::path memory = s_.memory / run_;
    if (auto why = make_folder(memory); !why.empty()) fail(memory, why);
  }
}

std::pair<fs::path, std::string> RunCgroup::write_quota(int cpus) const {
  const fs::path cpu = s_.cpu / run_;
  const std::int64_t quota = static_cast<std::int64_t>(cpus) * kPeriodUs;
  if (s_.kind == CgroupSupport::Kind::v2)
    return {cpu / "cpu.max", write_value(cpu / "cpu.max", fmt::format("{} {}", quota, kPeriodUs))};
  if (auto why = write_value(cpu / "cpu.cfs_period_us", std::to_string(kPeriodUs)); !why.empty())
    return {cpu / "cpu.cfs_period_us", why};
  return {cpu / "cpu.cfs_quota_us", write_value(cpu / "cpu.cfs_quota_us", std::to_string(quota))};
}

void RunCgroup::set_cpus(int cpus) {
  if (auto [at, why] = write_quota(cpus); !why.empty())
    throw Error(fmt::format("cannot set the run's CPU quota in {}: {}", at.string(), why));
}

RunCgroup::~RunCgroup() {
  for (const auto& worker : workers_) remove_folder(folder(s_.memory, worker));
  remove_folder(s_.memory / run_);
  if (s_.cpu != s_.memory) remove_folder(s_.cpu / run_);
  workers_.clear();
}

fs::path RunCgroup::folder(const fs::path& root, const std::string& worker) const {
  return root / run_ / folder_name(worker);
}

void RunCgroup::add(const std::string& worker, pid_t pid, std::uint64_t memory) {
  const fs::path dir = folder(s_.memory, worker);
  if (auto why = make_folder(dir); !why.empty())
    throw Error(fmt::format("cannot create the cgroup {}: {}", dir.string(), why));
  workers_.insert(worker);
  if (memory > 0) {
    const bool v2 = s_.kind == CgroupSupport::Kind::v2;
    const fs::path limit = dir / (v2 ? "memory.max" : "memory.limit_in_bytes");
    if (auto why = write_value(limit, std::to_string(memory)); !why.empty())
      throw Error(fmt::format("cannot set {} to {}: {}", limit.string(), memory, why));
    // No swap beyond it, where the kernel accounts swap: over the limit is killed, not swapped.
    std::error_code ec;
    if (v2 && fs::exists(dir / "memory.swap.max", ec)) {
      (void)write_value(dir / "memory.swap.max", "0");
    } else if (!v2 && fs::exists(dir / "memory.memsw.limit_in_bytes", ec)) {
      (void)write_value(dir / "memory.memsw.limit_in_bytes", std::to_string(memory));
    }
  }
  const std::string p = std::to_string(pid);
  if (auto why = write_value(dir / "cgroup.procs", p); !why.empty()) {
    // Gone already (it failed at once): its exit says why, not this.
    if (::kill(pid, 0) != 0 && errno == ESRCH) return;
    throw Error(fmt::format("cannot move pid {} into {}: {}", pid, dir.string(), why));
  }
  if (s_.kind == CgroupSupport::Kind::v1) {
    const fs::path cpu = s_.cpu / run_ / "cgroup.procs";
    if (auto why = write_value(cpu, p); !why.empty())
      throw Error(
          fmt::format("cannot move pid {} into {}: {}", pid, cpu.parent_path().string(), why));
  }
}

bool RunCgroup::oom_killed(const std::string& worker) const {
  // A kill by the OOM killer in a cgroup that reached its own limit: the machine's OOM killer
  // also counts in oom_kill, but then the limit was neither hit nor reached.
  const fs::path dir = folder(s_.memory, worker);
  auto number = [&](const char* file) { return std::atoll(read_text(dir / file).c_str()); };
  if (s_.kind == CgroupSupport::Kind::v2) {
    const std::string events = read_text(dir / "memory.events");
    if (keyed(events, "oom_kill") == 0) return false;
    const auto max = number("memory.max");  // "max" reads as 0: no limit
    return keyed(events, "oom") > 0 || (max > 0 && number("memory.peak") >= max);
  }
  if (keyed(read_text(dir / "memory.oom_control"), "oom_kill") == 0) return false;
  return number("memory.failcnt") > 0 || number("memory.memsw.failcnt") > 0 ||
         number("memory.max_usage_in_bytes") >= number("memory.limit_in_bytes");
}

void sweep_cgroups(const CgroupSupport& support, const std::string& suffix) {
  if (support.kind == CgroupSupport::Kind::none) return;
  for (const auto& root : {support.cpu, support.memory}) {
    std::error_code ec;
    for (const auto& run : fs::directory_iterator(root, ec)) {
      const std::string name = run.path().filename().string();
      if (!run.is_directory() || name.size() <= suffix.size() ||
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      std::error_code inner;
      for (const auto& w : fs::directory_iterator(run.path(), inner))
        if (w.is_directory()) remove_folder(w.path());
      remove_folder(run.path());
    }
  }
}

}  // namespace twinkle::core
