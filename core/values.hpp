#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <toml++/toml.h>

#include "core/mesh.hpp"
#include "twinkle/plugin.h"
#include "twinkle/value.hpp"

namespace twinkle::core {

// The job's [args] (or any TOML node) as a Value: tables become maps, arrays lists, dates and
// times their TOML text.
Value to_value(const toml::node& node);

// A mesh as a Value for the wire ({dims: [[name, size], ...], ep}) and back. mesh_from_value
// throws TransportError for a malformed description.
Value mesh_to_value(const DeviceMesh& mesh);
DeviceMesh mesh_from_value(const Value& v);

// What a plugin function wrote to the sink it was given. With `to_shm`, tensors of the value
// that are large enough are copied straight into shared memory (ready to be sent on).
struct SinkCapture {
  std::optional<Value> value;
  std::optional<std::string> error;
  twk_sink_v1 sink(bool to_shm = false);
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

}  // namespace twinkle::core
