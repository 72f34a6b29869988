#pragma once

#include <memory>

#include "transports/communicator.hpp"

namespace twinkle::transport {

// A Gloo communicator (TCP transport) for cpu groups. Connects a full mesh through `store`;
// throws TransportError if the rendezvous does not complete within config.timeout.
// Reductions: float32, float64, int32, int64, uint8, int8 and float16; bool and bfloat16 are
// refused with an error. The implementation is the module libtwinkle_gloo.so, loaded on the first
// call (module_symbol), so that a worker that makes no Gloo communicator starts without mapping
// Gloo and what it links (hiredis, ibverbs, libnl).
std::unique_ptr<Communicator> create_gloo_communicator(KvStore& store, const CommConfig& config);

}  // namespace twinkle::transport
