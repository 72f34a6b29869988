#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/cluster_flags.hpp"
#include "cli/commands.hpp"
#include "core/cluster/head_link.hpp"
#include "core/cluster/slurm.hpp"
#include "core/job/json_value.hpp"
#include "core/job/resources.hpp"
#include "twinkle/value.hpp"

namespace twinkle::cli {

namespace {

using core::to_json;

struct NodesOptions {
  bool json = false;
  ClusterFlags cluster;
};

// `twinkle nodes --address`: the head's node table and reservations, like `ray status`.
int run_cluster_nodes(const NodesOptions& o, const std::string& address) {
  core::cluster::HeadLink link(address, core::cluster::member_security(o.cluster.keys, address),
                               fmt::format("nodes/{}", getpid()));
  const auto nodes = link.request<transport::proto::NodesInfo>(
      core::cluster::Message{1, transport::proto::NodesQuery{}}, std::chrono::seconds(10));
  const Value info = transport::proto::to_value(nodes);
  if (o.json) {
    nlohmann::json j = to_json(info);
    j["mode"] = "remote";
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("cluster at {}\n", address);
  fmt::print("{:<16} {:<16} {:<6} {:>9}  {:>9}  {:>10}  {:>9}  {}\n", "NODE", "ADDRESS", "STATE",
             "CPUS FREE", "GPUS FREE", "MEMORY", "HEARTBEAT", "LABELS");
  for (const auto& n : info["nodes"]) {
    int gpus_free = 0;
    for (const auto& g : n["gpus"]) gpus_free += g["run"].as<std::string>().empty() ? 1 : 0;
    std::string labels;
    for (const auto& [k, v] : n["labels"].map_items())
      labels += fmt::format("{}{}={}", labels.empty() ? "" : ",", k, v.as<std::string>());
    const std::string alive = n["state"].as<std::string>();
    fmt::print("{:<16} {:<16} {:<6} {:>9}  {:>9}  {:>10}  {:>8.1f}s  {}\n",
               n["id"].as<std::string>(), n["address"].as<std::string>(), alive,
               fmt::format("{}/{}", n["cpus_free"].as<int>(), n["cpus"].as<int>()),
               fmt::format("{}/{}", gpus_free, n["gpus"].list_items().size()),
               core::format_bytes(static_cast<std::uint64_t>(n["memory"].as<std::int64_t>())),
               n["heartbeat_age_s"].as<double>(), labels.empty() ? "-" : labels);
    if (const auto iso = n["isolation"].as<std::string>(); !iso.empty())
      fmt::print("  isolation: {}\n", iso);
    if (const auto users = n["users"].as<std::string>(); !users.empty())
      fmt::print("  users: {}\n", users);
    for (const auto& g : n["gpus"]) {
      const std::string run = g["run"].as<std::string>();
      const auto mem = g["memory"].as<std::int64_t>();
      fmt::print("  gpu {:<3} {:<32} {:<10} {}\n", g["index"].as<int>(),
                 g["name"].as<std::string>().empty() ? "(declared)" : g["name"].as<std::string>(),
                 mem ? core::format_bytes(static_cast<std::uint64_t>(mem)) : "",
                 run.empty() ? "free" : "run " + run);
    }
  }
  if (info["nodes"].list_items().empty())
    fmt::print("(no nodes: start agents with `twinkle node start --address {}`)\n", address);
  const auto& res = info["reservations"].list_items();
  fmt::print("\n{} reservation{}\n", res.size(), res.size() == 1 ? "" : "s");
  for (const auto& r : res) {
    std::string where;
    for (const auto& b : r["bundles"]) {
      std::string gpus;
      for (const auto& g : b["gpus"])
        gpus += (gpus.empty() ? "" : ",") + std::to_string(g.as<int>());
      where +=
          fmt::format("{}{} ({} CPUs{})", where.empty() ? "" : ", ", b["node"].as<std::string>(),
                      b["cpus"].as<int>(), gpus.empty() ? "" : ", GPUs " + gpus);
    }
    const auto since = static_cast<std::time_t>(r["since"].as<std::int64_t>());
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", std::localtime(&since));
    fmt::print("  run {}  job {}  owner {}  since {}: {}\n", r["run"].as<std::string>(),
               r["job"].as<std::string>(), r["owner"].as<std::string>(), stamp, where);
  }
  return 0;
}

// Inside a Slurm allocation: its nodes and what the job holds on each.
int run_slurm_nodes(const NodesOptions& o) {
  const auto a = core::cluster::slurm_allocation();
  if (o.json) {
    nlohmann::json nodes = nlohmann::json::array();
    for (const auto& n : a.nodes) {
      nodes.push_back({{"id", n.name},
                       {"address", n.address},
                       {"state", "ALLOCATED"},
                       {"cpus", n.cpus},
                       {"gpus", n.gpus}});
    }
    fmt::print("{}\n",
               nlohmann::json{{"mode", "slurm"}, {"job_id", a.job_id}, {"nodes", nodes}}.dump(2));
    return 0;
  }
  fmt::print("Slurm job {}: {} node{} (launcher = \"slurm\" runs one agent on each)\n", a.job_id,
             a.nodes.size(), a.nodes.size() == 1 ? "" : "s");
  fmt::print("{:<20} {:<16} {:>5} {:>5}\n", "NODE", "ADDRESS", "CPUS", "GPUS");
  for (const auto& n : a.nodes)
    fmt::print("{:<20} {:<16} {:>5} {:>5}\n", n.name, n.address, n.cpus, n.gpus);
  return 0;
}

int run_nodes(const NodesOptions& o) {
  if (const std::string address = o.cluster.resolve(); !address.empty())
    return run_cluster_nodes(o, address);
  if (const char* job = std::getenv("SLURM_JOB_ID"); job && *job) return run_slurm_nodes(o);
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
  add_cluster_flags(sub, o->cluster);
  sub->callback([o, &action] { action = [o] { return run_nodes(*o); }; });
}

}  // namespace twinkle::cli
