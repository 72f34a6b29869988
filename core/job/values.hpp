#pragma once

#include "core/job/job.hpp"
#include "core/job/mesh.hpp"
#include "twinkle/value.hpp"

// The job model as Values, for the wire: a mesh travels to its workers, a whole Job to a head.
namespace twinkle::core {

// A mesh as {dims: [[name, size], ...], ep} and back.
Value mesh_to_value(const DeviceMesh& mesh);
// Throws TransportError for a malformed description.
DeviceMesh mesh_from_value(const Value& v);

// A whole job and back: job_from_value(job_to_value(j)) equals j field by field. Throws
// TransportError naming the field for a malformed description.
// Node and group labels ({key: value}).
Value labels_to_value(const std::map<std::string, std::string>& labels);
std::map<std::string, std::string> labels_from_value(const Value& v);

Value job_to_value(const Job& job);
Job job_from_value(const Value& v);

}  // namespace twinkle::core
