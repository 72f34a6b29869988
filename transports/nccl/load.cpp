#include "transports/module.hpp"
#include "transports/nccl/communicator.hpp"
#include "twinkle/errors.hpp"
#include "twinkle_config.h"

namespace twinkle::transport {

std::unique_ptr<Communicator> create_nccl_communicator(KvStore& store, const CommConfig& config) {
#if TWINKLE_HAVE_NCCL
  using Create = Communicator* (*)(KvStore*, const CommConfig*);
  auto create =
      reinterpret_cast<Create>(module_symbol("libtwinkle_nccl.so", "twinkle_nccl_create_v1"));
  return std::unique_ptr<Communicator>(create(&store, &config));
#else
  (void)store;
  (void)config;
  throw TransportError(
      "this twinkle was built without CUDA/NCCL, so cuda groups have no collectives; rebuild "
      "where the CUDA toolkit and NCCL are installed");
#endif
}

}  // namespace twinkle::transport
