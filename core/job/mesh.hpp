#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace twinkle::core {

// One named dimension of a device mesh.
struct MeshDim {
  std::string name;
  int size = 1;
};

// A DeviceMesh lays a group's workers (indices 0..world-1 inside the group) out over named
// dimensions taken from {pp, dp, fsdp, cp, tp}, row-major with the first dimension outermost. The
// default order is pp, dp, fsdp, cp, tp, so tp peers are adjacent ranks.
//
// `ep` (expert parallel) is an overlay on the data dimensions: it must divide dp x fsdp, defines
// communicator groups only, and never changes the world size or the data slicing. Ranks that share
// every non-data coordinate form data-parallel rows; each row is cut into contiguous blocks of `ep`
// data ranks, and each block is one ep group.
//
// Immutable after construction; safe to share between threads.
class DeviceMesh {
 public:
  // The canonical dimension names in their default layout order.
  static const std::vector<std::string>& canonical_dims();
  static bool is_known_dim(std::string_view name);

  // `dims` are in layout order, outermost first; sizes must be >= 1 and names unique and known.
  // `ep` is the overlay size (1 = none). Throws std::invalid_argument with a plain reason; the job
  // file parser adds the file position.
  explicit DeviceMesh(std::vector<MeshDim> dims, int ep = 1);

  // The default mesh of a group with `workers` workers: dp = workers.
  static DeviceMesh data_parallel(int workers);

  const std::vector<MeshDim>& dims() const { return dims_; }
  int world_size() const { return world_; }
  int ep() const { return ep_; }
  bool has(std::string_view dim) const;
  // Size of a dimension; 1 for a dimension the mesh does not have.
  int size(std::string_view dim) const;

  // Coordinates of `rank`, one per dimension in layout order.
  std::vector<int> coords(int rank) const;
  // The coordinate of `rank` along `dim`; 0 for a dimension the mesh does not have.
  int coord(int rank, std::string_view dim) const;
  int rank_of(const std::vector<int>& coords) const;

  // data_rank = dp_rank * fsdp + fsdp_rank; data_world = dp * fsdp.
  int data_rank(int rank) const;
  int data_world() const { return size("dp") * size("fsdp"); }

  // The communicator groups of one dimension: every list holds the ranks that share all other
  // coordinates, ordered by their coordinate along `dim`. For "ep", the ep blocks described above.
  // For a dimension the mesh does not have, every rank is its own group.
  std::vector<std::vector<int>> groups(std::string_view dim) const;
  // The group of `dim` that contains `rank`, and the rank's index in it.
  std::vector<int> group_of(int rank, std::string_view dim) const;
  int rank_in(int rank, std::string_view dim) const;

  // The ranks whose pp coordinate is the last stage (every rank when there is no pp).
  std::vector<int> last_pp_ranks() const;

  // "dp=2 × tp=2" (or with "x" when ascii) and "DP=2, TP=2".
  std::string dimensions_text(bool ascii = false) const;
  std::string parallelism_text() const;

 private:
  int index_of(std::string_view dim) const;  // -1 when absent
  void check_rank(int rank) const;

  std::vector<MeshDim> dims_;
  std::vector<int> strides_;
  int world_ = 1;
  int ep_ = 1;
};

}  // namespace twinkle::core
