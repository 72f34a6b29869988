#include "core/job/mesh.hpp"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

namespace twinkle::core {

const std::vector<std::string>& DeviceMesh::canonical_dims() {
  static const std::vector<std::string> kDims = {"pp", "dp", "fsdp", "cp", "tp"};
  return kDims;
}

bool DeviceMesh::is_known_dim(std::string_view name) {
  const auto& dims = canonical_dims();
  return std::find(dims.begin(), dims.end(), name) != dims.end();
}

DeviceMesh::DeviceMesh(std::vector<MeshDim> dims, int ep) : dims_(std::move(dims)), ep_(ep) {
  for (size_t i = 0; i < dims_.size(); ++i) {
    const auto& d = dims_[i];
    if (!is_known_dim(d.name)) {
      throw std::invalid_argument(fmt::format("unknown mesh dimension \"{}\"", d.name));
    }
    if (d.size < 1) {
      throw std::invalid_argument(
          fmt::format("mesh dimension {} must be >= 1, not {}", d.name, d.size));
    }
    for (size_t j = 0; j < i; ++j) {
      if (dims_[j].name == d.name) {
        throw std::invalid_argument(fmt::format("mesh dimension {} appears twice", d.name));
      }
    }
  }
  strides_.assign(dims_.size(), 1);
  for (size_t i = dims_.size(); i-- > 0;) {
    strides_[i] = world_;
    world_ *= dims_[i].size;
  }
  if (ep_ < 1) throw std::invalid_argument(fmt::format("ep must be >= 1, not {}", ep_));
  if (data_world() % ep_ != 0) {
    throw std::invalid_argument(
        fmt::format("ep={} does not divide dp x fsdp = {}", ep_, data_world()));
  }
}

DeviceMesh DeviceMesh::data_parallel(int workers) { return DeviceMesh({{"dp", workers}}); }

int DeviceMesh::index_of(std::string_view dim) const {
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (dims_[i].name == dim) return static_cast<int>(i);
  }
  return -1;
}

bool DeviceMesh::has(std::string_view dim) const { return index_of(dim) >= 0; }

int DeviceMesh::size(std::string_view dim) const {
  if (dim == "ep") return ep_;
  int i = index_of(dim);
  return i < 0 ? 1 : dims_[i].size;
}

void DeviceMesh::check_rank(int rank) const {
  if (rank < 0 || rank >= world_) {
    throw std::out_of_range(fmt::format("rank {} is outside the mesh of {} ranks", rank, world_));
  }
}

std::vector<int> DeviceMesh::coords(int rank) const {
  check_rank(rank);
  std::vector<int> c(dims_.size());
  for (size_t i = 0; i < dims_.size(); ++i) c[i] = (rank / strides_[i]) % dims_[i].size;
  return c;
}

int DeviceMesh::coord(int rank, std::string_view dim) const {
  check_rank(rank);
  if (dim == "ep") return data_rank(rank) % ep_;
  int i = index_of(dim);
  return i < 0 ? 0 : (rank / strides_[i]) % dims_[i].size;
}

int DeviceMesh::rank_of(const std::vector<int>& c) const {
  if (c.size() != dims_.size()) {
    throw std::invalid_argument(
        fmt::format("{} coordinates given for a mesh of {} dimensions", c.size(), dims_.size()));
  }
  int rank = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (c[i] < 0 || c[i] >= dims_[i].size) {
      throw std::out_of_range(fmt::format("coordinate {} is outside dimension {} of size {}", c[i],
                                          dims_[i].name, dims_[i].size));
    }
    rank += c[i] * strides_[i];
  }
  return rank;
}

int DeviceMesh::data_rank(int rank) const {
  return coord(rank, "dp") * size("fsdp") + coord(rank, "fsdp");
}

std::vector<std::vector<int>> DeviceMesh::groups(std::string_view dim) const {
  std::vector<std::vector<int>> out;
  if (dim == "ep") {
    // Rows of equal non-data coordinates, in data-rank order, cut into blocks of ep.
    std::vector<std::vector<int>> rows;
    std::vector<int> row_of(world_, -1);
    for (int r = 0; r < world_; ++r) {
      if (row_of[r] >= 0) continue;
      std::vector<int> row(data_world(), -1);
      auto c = coords(r);
      int dp_i = index_of("dp"), fsdp_i = index_of("fsdp");
      for (int d = 0; d < data_world(); ++d) {
        if (dp_i >= 0) c[dp_i] = d / size("fsdp");
        if (fsdp_i >= 0) c[fsdp_i] = d % size("fsdp");
        row[d] = rank_of(c);
        row_of[row[d]] = static_cast<int>(rows.size());
      }
      rows.push_back(std::move(row));
    }
    for (const auto& row : rows) {
      for (size_t b = 0; b < row.size(); b += ep_) {
        out.emplace_back(row.begin() + b, row.begin() + b + ep_);
      }
    }
    return out;
  }
  int i = index_of(dim);
  if (i < 0) {
    for (int r = 0; r < world_; ++r) out.push_back({r});
    return out;
  }
  for (int r = 0; r < world_; ++r) {
    if (coords(r)[i] != 0) continue;
    std::vector<int> g;
    for (int k = 0; k < dims_[i].size; ++k) g.push_back(r + k * strides_[i]);
    out.push_back(std::move(g));
  }
  return out;
}

std::vector<int> DeviceMesh::group_of(int rank, std::string_view dim) const {
  check_rank(rank);
  for (auto& g : groups(dim)) {
    if (std::find(g.begin(), g.end(), rank) != g.end()) return g;
  }
  return {rank};
}

int DeviceMesh::rank_in(int rank, std::string_view dim) const {
  auto g = group_of(rank, dim);
  return static_cast<int>(std::find(g.begin(), g.end(), rank) - g.begin());
}

std::vector<int> DeviceMesh::last_pp_ranks() const {
  std::vector<int> out;
  int last = size("pp") - 1;
  for (int r = 0; r < world_; ++r) {
    if (coord(r, "pp") == last) out.push_back(r);
  }
  return out;
}

std::string DeviceMesh::dimensions_text(bool ascii) const {
  std::string s;
  for (const auto& d : dims_) {
    if (!s.empty()) s += ascii ? " x " : " × ";
    s += fmt::format("{}={}", d.name, d.size);
  }
  if (ep_ > 1) s += fmt::format(" (ep={})", ep_);
  return s;
}

std::string DeviceMesh::parallelism_text() const {
  std::string s;
  for (const auto& d : dims_) {
    if (!s.empty()) s += ", ";
    std::string up = d.name;
    std::transform(up.begin(), up.end(), up.begin(),
                   [](unsigned char ch) { return std::toupper(ch); });
    s += fmt::format("{}={}", up, d.size);
  }
  if (ep_ > 1) s += fmt::format(", EP={}", ep_);
  return s;
}

}  // namespace twinkle::core
