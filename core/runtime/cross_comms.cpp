#include "core/runtime/cross_comms.hpp"

#include <algorithm>
#include <optional>

#include <fmt/format.h>

#include "core/job/mesh.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core {

namespace proto = transport::proto;

void CrossComms::create(const std::string& name, const Value& members, double timeout_s,
                        const Job& job, const CallTable& table) {
  if (comms_.count(name))
    throw CallError(fmt::format("communicator \"{}\" is declared already", name));
  Comm c = members_of(name, members, job, table);
  c.timeout_s = timeout_s > 0 ? timeout_s : job.timeout_s;
  comms_.emplace(name, std::move(c));
  declare(name);
}

std::vector<std::string> CrossComms::with_group(std::size_t g, const CallTable& table) const {
  std::vector<std::string> out;
  for (const auto& [name, c] : comms_) {
    if (std::any_of(c.peers.begin(), c.peers.end(),
                    [&](std::size_t p) { return table.workers()[p].group == g; }))
      out.push_back(name);
  }
  return out;
}

void CrossComms::renew(const std::string& name) {
  ++comms_.at(name).generation;
  declare(name);
}

void CrossComms::declare(const std::string& name) const {
  const Comm& c = comms_.at(name);
  for (std::size_t r = 0; r < c.peers.size(); ++r) {
    try {
      send_(c.peers[r], transport::Message{0, proto::CommJoin{name, static_cast<int>(r), c.names,
                                                              c.timeout_s, c.generation}});
    } catch (const TransportError&) {
      // That member is gone; its loss is on its way.
    }
  }
}

CrossComms::Comm CrossComms::members_of(const std::string& name, const Value& members,
                                        const Job& job, const CallTable& table) {
  const bool name_ok = !name.empty() && name.size() <= kMaxGroupName &&
                       name.find_first_not_of(
                           "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                           "0123456789_.-") == std::string::npos;
  if (!name_ok) {
    throw CallError(fmt::format(
        "communicator \"{}\": use 1 to {} letters, digits, '_', '.' or '-' for its name", name,
        kMaxGroupName));
  }
  if (name == "ep" || DeviceMesh::is_known_dim(name)) {
    throw CallError(fmt::format(
        "communicator \"{}\": the name of a mesh dimension; ctx.comm(\"{}\") means that "
        "dimension, so choose another name",
        name, name));
  }
  Comm out;
  std::optional<DeviceType> device;
  for (const auto& m : members) {
    const std::string group = m[0].as<std::string>();
    const auto gi = table.find_group(group);
    if (!gi) {
      throw CallError(fmt::format("communicator \"{}\": the job has no group \"{}\"", name, group));
    }
    const GroupInfo& g = table.groups()[*gi];
    const GroupSpec& spec = job.groups.at(*gi);
    if (device && *device != spec.device) {
      throw CallError(fmt::format(
          "communicator \"{}\": its members must share one device type (group {} is {})", name,
          group, to_string(spec.device)));
    }
    device = spec.device;
    std::vector<int> ranks = m[1].as<std::vector<int>>();
    if (ranks.empty()) {
      for (std::size_t i = 0; i < g.peers.size(); ++i) ranks.push_back(static_cast<int>(i));
    }
    for (int r : ranks) {
      if (r < 0 || r >= static_cast<int>(g.peers.size())) {
        throw CallError(fmt::format("communicator \"{}\": group {} has workers 0 to {}, not {}",
                                    name, group, g.peers.size() - 1, r));
      }
      const std::size_t peer = g.peers[static_cast<std::size_t>(r)];
      if (std::find(out.peers.begin(), out.peers.end(), peer) != out.peers.end()) {
        throw CallError(fmt::format("communicator \"{}\": {}:{} is listed twice", name, group, r));
      }
      out.peers.push_back(peer);
      out.names.push_back(fmt::format("{}:{}", group, r));
    }
  }
  if (out.peers.empty()) throw CallError(fmt::format("communicator \"{}\" has no members", name));
  return out;
}

}  // namespace twinkle::core
