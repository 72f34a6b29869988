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

class Communicators;

// What a plugin function wrote to the sink it was given. `adopt` turns the plugin's value into
// ours (it must be copied out of the plugin's memory); by default a plain decode.
struct SinkCapture {
  std::optional<Value> value;
  std::optional<std::string> error;
  std::function<Value(const twk_value_v1&)> adopt;
  twk_sink_v1 sink();
};

// The same for a value that is passed on without being decoded (a worker's reply): `adopt` copies
// it out of the plugin's memory, by default with copy_encoded.
struct EncodedSinkCapture {
  std::optional<EncodedValue> value;
  std::optional<std::string> error;
  std::function<EncodedValue(const twk_value_v1&)> adopt;
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

// What plugin code can ask of the runtime that hosts it: a driver entry (the driver) or a worker
// method (a worker, for its calls between groups). Errors are exceptions; the host table turns
// them into TWK_ERROR and a message for the plugin (nothing throws across the ABI).
class HostOps {
 public:
  virtual ~HostOps() = default;
  virtual void log(std::int32_t level, std::string_view message) = 0;
  virtual std::uint64_t create(std::string_view cls, std::string_view group,
                               const twk_value_v1& args) = 0;
  // `caller` is "file.cpp:42".
  virtual std::uint64_t call(std::uint64_t instance, std::string_view method,
                             const twk_value_v1& args, const std::string& caller) = 0;
  // The collected result, encoded (the host table hands it to the plugin as it is).
  virtual EncodedValue wait(std::uint64_t future) = 0;
  virtual void release(std::uint64_t future) noexcept = 0;
  virtual void comm_create(std::string_view name, const Value& members, double timeout_s) = 0;
  // Makes an instance made elsewhere (a handle passed as an argument) callable from here.
  virtual void attach(std::string_view cls, std::string_view group, std::uint64_t instance) = 0;
  // Driver entries only (docs/ARCHITECTURE.md, Checkpoints): publish a checkpoint of `step`
  // (false: the job has none configured), the one the run resumed from (null: none), and
  // whether a stop was requested. A worker's methods get errors for the first two, false for
  // the last.
  virtual bool checkpoint(std::int64_t step, const Value& meta);
  virtual Value resumed();
  virtual bool stop_requested() { return false; }
  // A worker's communicators, which the host table's collectives run on (set_collectives);
  // null where there are none (the driver, a worker before its welcome).
  virtual Communicators* communicators() { return nullptr; }
};

// The host table's log, create, call, wait, release, comm_create and attach; its host context
// must be a HostOps*. Workers add the collectives.
twk_host_v1 host_table();

}  // namespace twinkle::core
