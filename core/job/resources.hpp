#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace twinkle::core {

struct GpuInfo {
  int index = 0;                   // physical index (NVML order, or the CUDA_VISIBLE_DEVICES entry)
  std::string name;                // empty when unknown
  std::uint64_t memory_bytes = 0;  // 0 when unknown
  std::string uuid;
};

// Where the GPU list came from, for the topology and `twinkle nodes`.
enum class GpuSource { none, nvml, visible_devices, declared };
std::string_view to_string(GpuSource s);

struct NodeResources {
  std::string hostname;
  int cpus = 0;
  std::uint64_t memory_bytes = 0;
  std::uint64_t memory_available_bytes = 0;
  std::vector<GpuInfo> gpus;
  GpuSource gpu_source = GpuSource::none;
  std::string driver_version;  // NVML's, when known
};

// Resources of this machine. GPUs come from NVML (libnvidia-ml.so.1 loaded at run time, limited to
// CUDA_VISIBLE_DEVICES when that is set), else from CUDA_VISIBLE_DEVICES alone, else
// `declared_gpus` GPUs with unknown names. CPUs are those this process may run on; memory from
// /proc/meminfo.
NodeResources discover_local(std::optional<int> declared_gpus = std::nullopt);

// Parses a CUDA_VISIBLE_DEVICES value into indices; entries that are not plain indices (UUIDs, MIG
// names) are kept in order with index = their position. Empty or "-1"/"none" gives no GPUs.
std::vector<GpuInfo> parse_visible_devices(const std::string& value);

// "23.4 GiB"
std::string format_bytes(std::uint64_t bytes);

// One GPU's use at a moment, as NVML reports it.
struct GpuUse {
  int index = 0;                  // physical (NVML's)
  int util = 0;                   // percent of the last sample period its kernels ran
  std::uint64_t memory_used = 0;  // bytes
};

// Samples the GPUs' use through NVML (docs/ARCHITECTURE.md, Dashboard), which it opens once and
// keeps open. Without NVML (no driver, no GPU) there is nothing to sample: sample() is nullopt,
// never a made-up number.
class GpuMeter {
 public:
  GpuMeter();
  GpuMeter(const GpuMeter&) = delete;
  GpuMeter& operator=(const GpuMeter&) = delete;
  ~GpuMeter();
  // The use of each GPU of `indices` that NVML reports; nullopt without NVML.
  std::optional<std::vector<GpuUse>> sample(const std::vector<int>& indices);

 private:
  struct Lib;
  std::unique_ptr<Lib> lib_;
};

}  // namespace twinkle::core
