#include "core/values.hpp"

#include <sstream>

#include <fmt/format.h>

#include "core/error.hpp"
#include "transports/shm/segment.hpp"

namespace twinkle::core {

Value to_value(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table: {
      Value m = Value::map();
      for (auto&& [k, v] : *node.as_table()) m[k.str()] = to_value(v);
      return m;
    }
    case toml::node_type::array: {
      Value l = Value::list();
      for (auto&& v : *node.as_array()) l.push_back(to_value(v));
      return l;
    }
    case toml::node_type::string: return Value(*node.value<std::string>());
    case toml::node_type::integer: return Value(*node.value<std::int64_t>());
    case toml::node_type::floating_point: return Value(*node.value<double>());
    case toml::node_type::boolean: return Value(*node.value<bool>());
    default: {
      std::ostringstream s;
      node.visit([&](auto&& v) { s << v; });
      return Value(s.str());
    }
  }
}

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

twk_sink_v1 SinkCapture::sink(bool to_shm) {
  auto error = [](void* t, const char* m) { static_cast<SinkCapture*>(t)->error = m ? m : ""; };
  if (to_shm) {
    return {this,
            [](void* t, const twk_value_v1* v) {
              static_cast<SinkCapture*>(t)->value = transport::decode_to_shm(*v);
            },
            error};
  }
  return {this,
          [](void* t, const twk_value_v1* v) { static_cast<SinkCapture*>(t)->value = decode(*v); },
          error};
}

MeshAbi::MeshAbi(const DeviceMesh& mesh) {
  for (const auto& d : mesh.dims()) {
    names_.push_back(d.name);
    sizes_.push_back(d.size);
  }
  for (const auto& n : names_) name_ptrs_.push_back(n.c_str());
  for (int r = 0; r < mesh.world_size(); ++r) {
    for (int c : mesh.coords(r)) coords_.push_back(c);
    data_ranks_.push_back(mesh.data_rank(r));
  }
  view_ = twk_mesh_v1{sizeof(twk_mesh_v1), static_cast<std::uint32_t>(names_.size()),
                      name_ptrs_.data(),   sizes_.data(),
                      mesh.ep(),           mesh.world_size(),
                      mesh.data_world(),   coords_.data(),
                      data_ranks_.data()};
}

}  // namespace twinkle::core
