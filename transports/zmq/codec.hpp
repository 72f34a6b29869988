#pragma once

#include <msgpack.hpp>

#include <vector>

#include "transports/zmq/protocol.hpp"

// Between the framing (message.cpp) and the message structs (protocol.cpp): how a body is
// written into and read out of msgpack. Internal to transports/zmq.
namespace twinkle::transport::detail {

using Packer = msgpack::packer<msgpack::sbuffer>;

// Writes `body` at the end of `buf`, appending the tensors it refers to.
void pack_body(msgpack::sbuffer& buf, const proto::Control& body, std::vector<Tensor>& tensors);
void pack_body(msgpack::sbuffer& buf, const proto::Cluster& body, std::vector<Tensor>& tensors);

bool is_control(MsgType t);
bool is_cluster(MsgType t);

// The body of a message of type `t` (a control or a cluster type, as is_control/is_cluster say)
// whose tensor references index `tensors`. Throws ProtocolError naming the field that is wrong.
proto::Control unpack_control(MsgType t, const msgpack::object& body,
                              const std::vector<Tensor>& tensors);
proto::Cluster unpack_cluster(MsgType t, const msgpack::object& body,
                              const std::vector<Tensor>& tensors);

}  // namespace twinkle::transport::detail
