#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "core/job/resources.hpp"

namespace twinkle::cli {

namespace {

struct NodesOptions {
  bool json = false;
};

int run_nodes(const NodesOptions& o) {
  core::NodeResources r = core::discover_local();
  if (o.json) {
    nlohmann::json gpus = nlohmann::json::array();
    for (const auto& g : r.gpus) {
      gpus.push_back({{"index", g.index},
                      {"name", g.name},
                      {"memory_bytes", g.memory_bytes},
                      {"uuid", g.uuid}});
    }
    nlohmann::json node = {{"host", r.hostname},
                           {"state", "ALIVE"},
                           {"cpus", r.cpus},
                           {"memory_bytes", r.memory_bytes},
                           {"memory_available_bytes", r.memory_available_bytes},
                           {"gpu_source", std::string(core::to_string(r.gpu_source))},
                           {"driver_version", r.driver_version},
                           {"gpus", gpus}};
    fmt::print("{}\n", nlohmann::json{{"mode", "local"}, {"nodes", {node}}}.dump(2));
    return 0;
  }
  fmt::print("{:<20} {:<6} {:>5}  {:>20}  {}\n", "HOST", "STATE", "CPUS", "MEMORY (avail/total)",
             "GPUS");
  std::string mem = fmt::format("{} / {}", core::format_bytes(r.memory_available_bytes),
                                core::format_bytes(r.memory_bytes));
  fmt::print("{:<20} {:<6} {:>5}  {:>20}  {}\n", r.hostname, "ALIVE", r.cpus, mem, r.gpus.size());
  for (const auto& g : r.gpus) {
    std::string line =
        fmt::format("  gpu {:<3} {:<32} {}", g.index, g.name.empty() ? "(name unknown)" : g.name,
                    g.memory_bytes ? core::format_bytes(g.memory_bytes) : "");
    fmt::print("{}\n", line.substr(0, line.find_last_not_of(' ') + 1));
  }
  if (r.gpus.empty() && r.gpu_source == core::GpuSource::nvml) {
    fmt::print("  no GPU visible (NVML lists none, or CUDA_VISIBLE_DEVICES hides them)\n");
  } else if (r.gpus.empty()) {
    fmt::print("  no GPU found (no NVML driver library, no CUDA_VISIBLE_DEVICES)\n");
  } else
    fmt::print("  GPUs found through {}\n", core::to_string(r.gpu_source));
  return 0;
}

}  // namespace

void setup_nodes(CLI::App& app, Action& action) {
  auto o = std::make_shared<NodesOptions>();
  auto* sub = app.add_subcommand("nodes", "List this machine's resources: GPUs, CPUs, memory");
  sub->add_flag("--json", o->json, "Print as JSON for scripts");
  sub->callback([o, &action] { action = [o] { return run_nodes(*o); }; });
}

}  // namespace twinkle::cli
