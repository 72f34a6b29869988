#include "core/job/resources.hpp"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace twinkle::core {

std::string_view to_string(GpuSource s) {
  switch (s) {
    case GpuSource::nvml: return "nvml";
    case GpuSource::visible_devices: return "CUDA_VISIBLE_DEVICES";
    case GpuSource::declared: return "--gpus";
    case GpuSource::none: break;
  }
  return "none";
}

std::string format_bytes(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", v, units[u]);
}

std::vector<GpuInfo> parse_visible_devices(const std::string& value) {
  std::vector<GpuInfo> out;
  if (value.empty() || value == "-1" || value == "none" || value == "NoDevFiles") return out;
  std::stringstream ss(value);
  int position = 0;
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) continue;
    GpuInfo g;
    char* end = nullptr;
    long idx = std::strtol(item.c_str(), &end, 10);
    if (end && *end == '\0' && idx >= 0) {
      // CUDA stops at the first invalid entry, such as -1.
      g.index = static_cast<int>(idx);
    } else if (item[0] == '-') {
      break;
    } else {
      g.index = position;
      g.uuid = item;
    }
    out.push_back(g);
    ++position;
  }
  return out;
}

namespace {

// The few NVML entry points Twinkle needs, declared here so that nothing of the driver is needed
// at build time.
struct Nvml {
  using Device = void*;
  int (*init)() = nullptr;
  int (*shutdown)() = nullptr;
  int (*count)(unsigned*) = nullptr;
  int (*handle)(unsigned, Device*) = nullptr;
  int (*name)(Device, char*, unsigned) = nullptr;
  int (*uuid)(Device, char*, unsigned) = nullptr;
  int (*memory)(Device, void*) = nullptr;
  int (*driver)(char*, unsigned) = nullptr;
};

struct NvmlMemory {
  unsigned long long total, free, used;
};

struct NvmlUtilization {
  unsigned gpu, memory;
};

std::vector<GpuInfo> nvml_gpus(std::string& driver_version, bool& available) {
  available = false;
  std::vector<GpuInfo> out;
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return out;
  Nvml n;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::decay_t<decltype(fn)>>(dlsym(lib, name));
  };
  sym(n.init, "nvmlInit_v2");
  sym(n.shutdown, "nvmlShutdown");
  sym(n.count, "nvmlDeviceGetCount_v2");
  sym(n.handle, "nvmlDeviceGetHandleByIndex_v2");
  sym(n.name, "nvmlDeviceGetName");
  sym(n.uuid, "nvmlDeviceGetUUID");
  sym(n.memory, "nvmlDeviceGetMemoryInfo");
  sym(n.driver, "nvmlSystemGetDriverVersion");
  if (n.init && n.shutdown && n.count && n.handle && n.init() == 0) {
    unsigned count = 0;
    if (n.count(&count) == 0) {
      available = true;
      for (unsigned i = 0; i < count; ++i) {
        GpuInfo g;
        g.index = static_cast<int>(i);
        Nvml::Device dev = nullptr;
        if (n.handle(i, &dev) == 0) {
          char buf[256] = {};
          if (n.name && n.name(dev, buf, sizeof buf) == 0) g.name = buf;
          char id[96] = {};
          if (n.uuid && n.uuid(dev, id, sizeof id) == 0) g.uuid = id;
          NvmlMemory mem{};
          if (n.memory && n.memory(dev, &mem) == 0) g.memory_bytes = mem.total;
        }
        out.push_back(g);
      }
      char ver[96] = {};
      if (n.driver && n.driver(ver, sizeof ver) == 0) driver_version = ver;
    }
    n.shutdown();
  }
  dlclose(lib);
  return out;
}

std::uint64_t meminfo(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  std::string k;
  std::uint64_t kb = 0;
  std::string unit;
  while (in >> k >> kb >> unit) {
    if (k == key + ":") return kb * 1024;
  }
  return 0;
}

}  // namespace

struct GpuMeter::Lib {
  void* handle = nullptr;
  int (*shutdown)() = nullptr;
  int (*device)(unsigned, void**) = nullptr;
  int (*utilization)(void*, NvmlUtilization*) = nullptr;
  int (*memory)(void*, NvmlMemory*) = nullptr;
};

GpuMeter::GpuMeter() {
  void* h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return;
  auto lib = std::make_unique<Lib>();
  lib->handle = h;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::decay_t<decltype(fn)>>(dlsym(h, name));
  };
  int (*init)() = nullptr;
  sym(init, "nvmlInit_v2");
  sym(lib->shutdown, "nvmlShutdown");
  sym(lib->device, "nvmlDeviceGetHandleByIndex_v2");
  sym(lib->utilization, "nvmlDeviceGetUtilizationRates");
  sym(lib->memory, "nvmlDeviceGetMemoryInfo");
  if (!init || !lib->shutdown || !lib->device || !lib->utilization || !lib->memory || init() != 0) {
    dlclose(h);
    return;
  }
  lib_ = std::move(lib);
}

GpuMeter::~GpuMeter() {
  if (!lib_) return;
  lib_->shutdown();
  dlclose(lib_->handle);
}

std::optional<std::vector<GpuUse>> GpuMeter::sample(const std::vector<int>& indices) {
  if (!lib_) return std::nullopt;
  std::vector<GpuUse> out;
  for (int i : indices) {
    void* dev = nullptr;
    NvmlUtilization u{};
    NvmlMemory m{};
    if (i < 0 || lib_->device(static_cast<unsigned>(i), &dev) != 0 ||
        lib_->utilization(dev, &u) != 0 || lib_->memory(dev, &m) != 0)
      continue;  // this one said nothing now: nothing is reported for it
    out.push_back(GpuUse{i, static_cast<int>(u.gpu), m.used});
  }
  return out;
}

NodeResources discover_local(std::optional<int> declared_gpus) {
  NodeResources r;
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) == 0) r.hostname = host;
  cpu_set_t set;
  r.cpus = sched_getaffinity(0, sizeof set, &set) == 0
               ? CPU_COUNT(&set)
               : static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  r.memory_bytes = meminfo("MemTotal");
  r.memory_available_bytes = meminfo("MemAvailable");

  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  bool nvml_ok = false;
  auto gpus = nvml_gpus(r.driver_version, nvml_ok);
  if (nvml_ok) {
    r.gpu_source = GpuSource::nvml;
    if (visible) {
      // Keep NVML's facts for the GPUs this process may use, in CUDA_VISIBLE_DEVICES order.
      for (const auto& v : parse_visible_devices(visible)) {
        for (const auto& g : gpus) {
          if ((v.uuid.empty() && g.index == v.index) ||
              (!v.uuid.empty() && g.uuid.starts_with(v.uuid))) {
            r.gpus.push_back(g);
          }
        }
      }
    } else {
      r.gpus = std::move(gpus);
    }
  } else if (visible && !parse_visible_devices(visible).empty()) {
    r.gpu_source = GpuSource::visible_devices;
    r.gpus = parse_visible_devices(visible);
  } else if (declared_gpus && *declared_gpus > 0) {
    r.gpu_source = GpuSource::declared;
    for (int i = 0; i < *declared_gpus; ++i) r.gpus.push_back(GpuInfo{i, "", 0, ""});
  }
  return r;
}

}  // namespace twinkle::core
