#include "core/runtime/communicators.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/runtime/host_abi.hpp"
#include "transports/gloo/communicator.hpp"
#include "transports/nccl/communicator.hpp"
#include "transports/shm/communicator.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core {

Communicators::Communicators(zmq::context_t& context, CommunicatorSetup setup)
    : context_(context), setup_(std::move(setup)) {}

void Communicators::join(const transport::proto::CommJoin& m) {
  Cross c;
  c.rank = m.rank;
  c.members = m.members;
  c.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(m.timeout_s * 1000));
  c.generation = m.generation;
  cross_[m.name] = std::move(c);
}

// A communicator across groups: every member first says it joined, so that one that never does
// is named (instead of a rendezvous key nobody recognises).
void Communicators::meet(const std::string& name, const Cross& c, transport::CommConfig& config) {
  config.name = cross_key(name, c.generation);
  config.rank = c.rank;
  config.size = static_cast<int>(c.members.size());
  config.timeout = c.timeout;
  kv_->set(fmt::format("{}/joined/{}", config.name, c.rank), "1");
  const auto deadline = std::chrono::steady_clock::now() + c.timeout;
  std::vector<std::string> missing;
  for (int r = 0; r < config.size; ++r) {
    // Past the deadline a member that did join still answers within a round trip.
    const auto left = std::max(std::chrono::milliseconds(500),
                               std::chrono::duration_cast<std::chrono::milliseconds>(
                                   deadline - std::chrono::steady_clock::now()));
    try {
      kv_->get(fmt::format("{}/joined/{}", config.name, r), left);
    } catch (const TransportError&) {
      missing.push_back(fmt::format("rank {} ({})", r, c.members[static_cast<std::size_t>(r)]));
    }
  }
  if (!missing.empty()) {
    throw TransportError(fmt::format(
        "communicator {}: {} never joined within {:g} s; every member must make the same "
        "collective calls on it",
        name, fmt::join(missing, ", "), static_cast<double>(c.timeout.count()) / 1000.0));
  }
}

// The members of a mesh dimension's communicator are the ranks that share every other mesh
// coordinate; its store keys are named after the group, the dimension and the sub-group's index
// so that every member finds the same ones.
transport::Communicator& Communicators::get(const std::string& dim) {
  const auto cross = cross_.find(dim);
  if (auto it = comms_.find(dim); it != comms_.end()) {
    if (cross == cross_.end() || made_at_[dim] == cross->second.generation) return *it->second;
    stale_.push_back(std::move(it->second));  // declared again since it was made
    comms_.erase(it);
  }
  const CommunicatorSetup& s = setup_;
  transport::CommConfig config;
  config.timeout = s.timeout;
  if (!s.node_ip.empty()) config.host = s.node_ip;
  if (!kv_) kv_ = std::make_unique<transport::KvClient>(context_, s.kv_endpoint, s.security);
  if (cross != cross_.end()) {
    meet(dim, cross->second, config);
    made_at_[dim] = cross->second.generation;
  } else if (dim.empty()) {
    config.name = fmt::format("{}/all", group_key());
    config.rank = s.rank;
    config.size = s.world;
  } else {
    if (dim != "ep" && !DeviceMesh::is_known_dim(dim)) {
      throw ValueError(fmt::format(
          "no mesh dimension \"{}\" (known: pp, dp, fsdp, cp, tp, ep; this group's mesh "
          "is {}), nor a communicator across groups that this worker is in",
          dim, s.mesh.dimensions_text(true)));
    }
    const auto groups = s.mesh.groups(dim);
    for (std::size_t i = 0; i < groups.size(); ++i) {
      auto at = std::find(groups[i].begin(), groups[i].end(), s.rank);
      if (at == groups[i].end()) continue;
      config.name = fmt::format("{}/{}/{}", group_key(), dim, i);
      config.rank = static_cast<int>(at - groups[i].begin());
      config.size = static_cast<int>(groups[i].size());
    }
  }
  std::unique_ptr<transport::Communicator> c;
  if (s.device == "cuda") {
    c = transport::create_nccl_communicator(*kv_, config);
  } else if (s.collectives == "gloo") {
    c = transport::create_gloo_communicator(*kv_, config);
  } else {
    // Every member takes the same branch: they all see the same host ids.
    const bool local = transport::members_share_host(*kv_, config);
    if (local) {
      c = transport::create_shm_communicator(*kv_, config);
    } else if (s.collectives == "shm") {
      throw TransportError(fmt::format(
          "collectives = \"shm\" but the members of {} are on more than one host; use \"auto\" "
          "or \"gloo\"",
          config.name));
    } else {
      c = transport::create_gloo_communicator(*kv_, config);
    }
  }
  return *comms_.emplace(dim, std::move(c)).first->second;
}

std::int32_t Communicators::run(const char* dim_c, twk_sink_v1* err, const char* op,
                                const std::function<void(transport::Communicator&)>& f) {
  const std::string dim = dim_c ? dim_c : "";
  try {
    f(get(dim));
    return TWK_OK;
  } catch (const std::exception& e) {
    const std::string msg =
        is_cross(dim) ? fmt::format("{} communicator {} failed on {}:{}: {}",
                                    std::string_view(op) == "communicator" ? "joining" : op, dim,
                                    setup_.group, setup_.rank, e.what())
                      : fmt::format("{} over group {}{} failed on rank {}: {}", op, setup_.group,
                                    dim.empty() ? "" : " (dim " + dim + ")", setup_.rank, e.what());
    if (err && err->set_error) err->set_error(err->target, msg.c_str());
    return TWK_ERROR;
  }
}

namespace {

DType checked_dtype(std::int32_t d) {
  if (!dtype_known(d)) throw ValueError("unknown dtype " + std::to_string(d));
  return static_cast<DType>(d);
}

transport::ReduceOp checked_op(std::int32_t op) {
  if (op < TWK_REDUCE_SUM || op > TWK_REDUCE_MIN)
    throw ValueError("unknown reduce op " + std::to_string(op));
  return static_cast<transport::ReduceOp>(op);
}

std::int32_t collective(void* host_ctx, const char* dim, twk_sink_v1* err, const char* op,
                        const std::function<void(transport::Communicator&)>& f) {
  Communicators* comms = static_cast<HostOps*>(host_ctx)->communicators();
  if (!comms) {
    const std::string msg = fmt::format("{}: collectives run in worker methods only", op);
    if (err && err->set_error) err->set_error(err->target, msg.c_str());
    return TWK_ERROR;
  }
  return comms->run(dim, err, op, f);
}

}  // namespace

void set_collectives(twk_host_v1& host) {
  host.comm_info = [](void* w, const char* dim, std::int32_t* rank, std::int32_t* size,
                      twk_sink_v1* err) {
    return collective(w, dim, err, "communicator", [&](transport::Communicator& c) {
      *rank = c.rank();
      *size = c.size();
    });
  };
  host.all_reduce = [](void* w, const char* dim, void* data, std::uint64_t count,
                       std::int32_t dtype, std::int32_t op, twk_sink_v1* err) {
    return collective(w, dim, err, "all_reduce", [&](transport::Communicator& c) {
      c.all_reduce(data, count, checked_dtype(dtype), checked_op(op));
    });
  };
  host.broadcast = [](void* w, const char* dim, void* data, std::uint64_t count, std::int32_t dtype,
                      std::int32_t root, twk_sink_v1* err) {
    return collective(w, dim, err, "broadcast", [&](transport::Communicator& c) {
      c.broadcast(data, count, checked_dtype(dtype), root);
    });
  };
  host.all_gather = [](void* w, const char* dim, const void* in, void* out, std::uint64_t count,
                       std::int32_t dtype, twk_sink_v1* err) {
    return collective(w, dim, err, "all_gather", [&](transport::Communicator& c) {
      c.all_gather(in, out, count, checked_dtype(dtype));
    });
  };
  host.reduce_scatter = [](void* w, const char* dim, const void* in, void* out, std::uint64_t count,
                           std::int32_t dtype, std::int32_t op, twk_sink_v1* err) {
    return collective(w, dim, err, "reduce_scatter", [&](transport::Communicator& c) {
      c.reduce_scatter(in, out, count, checked_dtype(dtype), checked_op(op));
    });
  };
  host.barrier = [](void* w, const char* dim, twk_sink_v1* err) {
    return collective(w, dim, err, "barrier", [](transport::Communicator& c) { c.barrier(); });
  };
}

}  // namespace twinkle::core
