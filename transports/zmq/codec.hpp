#pragma once

#include <msgpack.hpp>

#include <vector>

#include "transports/zmq/protocol.hpp"
#include "twinkle/msgpack_reader.hpp"

// Between the framing (message.cpp) and the message structs (protocol.cpp): how a body is
// written into and read out of msgpack. Internal to transports/zmq.
namespace twinkle::transport::detail {

using twinkle::detail::Item;
using twinkle::detail::NotMsgpack;
using twinkle::detail::Reader;

using Packer = msgpack::packer<msgpack::sbuffer>;

// Writes `body` at the end of `buf`, appending the tensors it refers to.
void pack_body(msgpack::sbuffer& buf, const proto::Control& body, std::vector<Tensor>& tensors);
void pack_body(msgpack::sbuffer& buf, const proto::Cluster& body, std::vector<Tensor>& tensors);

bool is_control(MsgType t);
bool is_cluster(MsgType t);

// Decodes the body `r` is at, of type `t` (a control or a cluster type, as is_control/is_cluster
// say), into `out`; its tensor references index `tensors`. The body's bytes are msgpack (checked
// by the framing with Reader::skip). Throws ProtocolError naming the field that is wrong.
void unpack_body(MsgType t, Reader& r, const std::vector<Tensor>& tensors, proto::Control& out);
void unpack_body(MsgType t, Reader& r, const std::vector<Tensor>& tensors, proto::Cluster& out);

}  // namespace twinkle::transport::detail
