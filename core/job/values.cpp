#include "core/job/values.hpp"

#include <sstream>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core {

Value mesh_to_value(const DeviceMesh& mesh) {
  Value dims = Value::list();
  for (const auto& d : mesh.dims()) dims.push_back(Value::list({d.name, d.size}));
  return Value::map({{"dims", dims}, {"ep", mesh.ep()}});
}

DeviceMesh mesh_from_value(const Value& v) {
  try {
    std::vector<MeshDim> dims;
    for (const auto& d : v["dims"]) dims.push_back({d[0].as<std::string>(), d[1].as<int>()});
    return DeviceMesh(std::move(dims), v["ep"].as<int>());
  } catch (const std::exception& e) {
    throw TransportError(fmt::format("malformed mesh description: {}", e.what()));
  }
}

namespace {

PlacementStrategy strategy(const std::string& text) {
  auto s = placement_strategy(text);
  if (!s) throw ValueError("placement " + text);
  return *s;
}

}  // namespace

Value labels_to_value(const std::map<std::string, std::string>& labels) {
  Value out = Value::map();
  for (const auto& [k, v] : labels) out[k] = v;
  return out;
}

std::map<std::string, std::string> labels_from_value(const Value& v) {
  std::map<std::string, std::string> out;
  for (const auto& [k, item] : v.map_items()) out[k] = item.as<std::string>();
  return out;
}

Value job_to_value(const Job& job) {
  Value groups = Value::list();
  for (const auto& g : job.groups) {
    groups.push_back(Value::map(
        {{"name", g.name},
         {"ranks", Value(g.ranks)},
         {"device", std::string(to_string(g.device))},
         {"gpus_per_worker", g.gpus_per_worker},
         {"mesh", mesh_to_value(g.mesh)},
         {"placement", g.placement ? std::string(to_string(*g.placement)) : std::string()},
         {"labels", labels_to_value(g.labels)},
         {"where", g.where.text},
         {"ranks_where", g.ranks_where.text}}));
  }
  Value out = Value::map({{"file", job.file.string()},
                          {"name", job.name},
                          {"mode", std::string(to_string(job.mode))},
                          {"plugin", job.plugin},
                          {"plugin_path", job.plugin_path.string()},
                          {"plugin_where", job.plugin_where.text},
                          {"driver", job.driver},
                          {"seed", job.seed},
                          {"timeout_s", job.timeout_s},
                          {"address", job.address},
                          {"nproc_per_node", job.nproc_per_node},
                          {"queue_timeout_s", job.queue_timeout_s},
                          {"launcher", job.launcher},
                          {"placement", std::string(to_string(job.placement))},
                          {"groups", groups},
                          {"args", job.args}});
  if (job.notify) {
    out["notify"] = Value::map({{"webhook", job.notify->webhook},
                                {"kind", job.notify->kind},
                                {"secret", job.notify->secret}});
  }
  return out;
}

Job job_from_value(const Value& v) {
  try {
    Job job;
    job.file = v["file"].as<std::string>();
    job.name = v["name"].as<std::string>();
    const auto mode = v["mode"].as<std::string>();
    if (mode != "local" && mode != "remote") throw ValueError("mode " + mode);
    job.mode = mode == "local" ? Mode::local : Mode::remote;
    job.plugin = v["plugin"].as<std::string>();
    job.plugin_path = v["plugin_path"].as<std::string>();
    job.plugin_where.text = v["plugin_where"].as<std::string>();
    job.driver = v["driver"].as<std::string>();
    job.seed = v["seed"].as<std::int64_t>();
    job.timeout_s = v["timeout_s"].as<double>();
    job.address = v["address"].as<std::string>();
    job.nproc_per_node = v["nproc_per_node"].as<int>();
    job.queue_timeout_s = v["queue_timeout_s"].as<double>();
    job.launcher = v["launcher"].as<std::string>();
    job.placement = strategy(v["placement"].as<std::string>());
    for (const auto& g : v["groups"]) {
      GroupSpec s;
      s.name = g["name"].as<std::string>();
      s.ranks = g["ranks"].as<std::vector<int>>();
      const auto device = g["device"].as<std::string>();
      if (device != "cpu" && device != "cuda") throw ValueError("device " + device);
      s.device = device == "cpu" ? DeviceType::cpu : DeviceType::cuda;
      s.gpus_per_worker = g["gpus_per_worker"].as<int>();
      s.mesh = mesh_from_value(g["mesh"]);
      if (const auto p = g["placement"].as<std::string>(); !p.empty()) s.placement = strategy(p);
      s.labels = labels_from_value(g["labels"]);
      s.where.text = g["where"].as<std::string>();
      s.ranks_where.text = g["ranks_where"].as<std::string>();
      job.groups.push_back(std::move(s));
    }
    job.args = v["args"];
    if (v.contains("notify")) {
      const Value& n = v["notify"];
      job.notify = NotifySpec{n["webhook"].as<std::string>(), n["kind"].as<std::string>(),
                              n["secret"].as<std::string>()};
    }
    return job;
  } catch (const std::exception& e) {
    throw TransportError(fmt::format("malformed job description: {}", e.what()));
  }
}

}  // namespace twinkle::core
