#pragma once

#include <memory>
#include <string>

#include "core/cluster/security.hpp"
#include "core/runtime/launcher.hpp"
#include "transports/zmq/protocol.hpp"

namespace twinkle::core::cluster {

// The driver's view of a cluster (runtime's RemoteSite): reservations and a lease at the head at
// `address`, workers started through the agents. Throws TransportError when the head refuses this
// member or does not answer.
std::unique_ptr<RemoteSite> connect_site(const std::string& address, const KeyOptions& keys);
// The same with the keys given (a cluster made for one run).
std::unique_ptr<RemoteSite> connect_site(const std::string& address,
                                         const transport::SocketSecurity& security);

// The placement of `job` that the head's reservation (or, `planned`, its plan: nothing held)
// `reply` gives. Throws TransportError when the answer does not fit the job (another head's
// build).
Placement placement_of(const Job& job, const transport::proto::Reservation& reply,
                       bool planned = false);

}  // namespace twinkle::core::cluster
