// libFuzzer target: the wire protocol's decoders (transports/zmq/message.cpp framing and the
// message structs of transports/zmq/protocol.cpp), for control and cluster messages alike.
// Input: frames, each a 2-byte little-endian length and that many bytes (at most 8 frames).
// Any input must decode or raise ProtocolError; what decodes must encode again.
#include <cstddef>
#include <cstdint>
#include <vector>

#include <zmq.hpp>

#include "transports/zmq/message.hpp"
#include "twinkle/errors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<zmq::message_t> frames;
  std::size_t at = 0;
  while (at + 2 <= size && frames.size() < 8) {
    std::size_t len = data[at] | (std::size_t(data[at + 1]) << 8);
    at += 2;
    if (len > size - at) len = size - at;
    frames.emplace_back(data + at, len);
    at += len;
  }
  std::vector<zmq::message_t> copy;
  for (auto& f : frames) copy.emplace_back(f.data(), f.size());
  try {
    twinkle::transport::Message m = twinkle::transport::decode_message(std::move(frames));
    (void)twinkle::transport::encode_message(m);
  } catch (const twinkle::transport::ProtocolError&) {
  }
  try {
    twinkle::transport::ClusterMessage m =
        twinkle::transport::decode_cluster_message(std::move(copy));
    (void)twinkle::transport::encode_message(m);
  } catch (const twinkle::transport::ProtocolError&) {
  }
  return 0;
}
