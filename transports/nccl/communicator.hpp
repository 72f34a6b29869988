#pragma once

#include <memory>

#include "transports/communicator.hpp"

namespace twinkle::transport {

// An NCCL communicator for cuda groups, on the worker's current CUDA device (device 0 of its
// CUDA_VISIBLE_DEVICES). The unique id travels through `store`. Buffers are device memory.
// Every operation runs on the communicator's own stream and waits for it, polling NCCL's async
// error so that a dead or hung peer fails the call (the communicator is then aborted) within
// config.timeout instead of hanging. The implementation is the module libtwinkle_nccl.so, built
// only when CUDA and NCCL are found and loaded on the first call (module_symbol), so that nothing
// else maps NCCL and the CUDA runtime; without it this throws TransportError saying so.
std::unique_ptr<Communicator> create_nccl_communicator(KvStore& store, const CommConfig& config);

}  // namespace twinkle::transport
