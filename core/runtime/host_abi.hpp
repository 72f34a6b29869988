#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/job/mesh.hpp"
#include "twinkle/plugin.h"
#include "twinkle/value.hpp"

// The host side of the plugin ABI: what the runtime hands plugin functions (sinks, meshes, the
// driver's host table) and how their C calls reach C++.
namespace twinkle::core {

// What a plugin function wrote to the sink it was given. `adopt` turns the plugin's value into
// ours (it must be copied out of the plugin's memory); by default a plain decode.
struct SinkCapture {
  std::optional<Value> value;
  std::optional<std::string> error;
  std::function<Value(const twk_value_v1&)> adopt;
  twk_sink_v1 sink();
};

// A DeviceMesh in the plugin ABI's form (twk_mesh_v1), owning the arrays it points into.
// Not copyable (the view points into itself).
class MeshAbi {
 public:
  explicit MeshAbi(const DeviceMesh& mesh);
  MeshAbi(const MeshAbi&) = delete;
  MeshAbi& operator=(const MeshAbi&) = delete;

  const twk_mesh_v1* view() const { return &view_; }

 private:
  std::vector<std::string> names_;
  std::vector<const char*> name_ptrs_;
  std::vector<std::int32_t> sizes_;
  std::vector<std::int32_t> coords_;
  std::vector<std::int32_t> data_ranks_;
  twk_mesh_v1 view_{};
};

// What a driver entry can ask of the runtime. Errors are exceptions; the host table turns them
// into TWK_ERROR and a message for the plugin (nothing throws across the ABI).
class DriverOps {
 public:
  virtual ~DriverOps() = default;
  virtual void log(std::int32_t level, std::string_view message) = 0;
  virtual std::uint64_t create(std::string_view cls, std::string_view group,
                               const twk_value_v1& args) = 0;
  // `caller` is "file.cpp:42".
  virtual std::uint64_t call(std::uint64_t instance, std::string_view method,
                             const twk_value_v1& args, const std::string& caller) = 0;
  virtual Value wait(std::uint64_t future) = 0;
  virtual void release(std::uint64_t future) noexcept = 0;
  virtual void comm_create(std::string_view name, const Value& members, double timeout_s) = 0;
  // Makes an instance made elsewhere (a handle passed as an argument) callable from here.
  virtual void attach(std::string_view cls, std::string_view group, std::uint64_t instance) = 0;
};

// The host table for driver entries (and the calls of worker methods); its host context must be a
// DriverOps*.
twk_host_v1 driver_host_table();

}  // namespace twinkle::core
