#include "transports/gloo/communicator.hpp"
#include "transports/module.hpp"

namespace twinkle::transport {

std::unique_ptr<Communicator> create_gloo_communicator(KvStore& store, const CommConfig& config) {
  using Create = Communicator* (*)(KvStore*, const CommConfig*);
  auto create =
      reinterpret_cast<Create>(module_symbol("libtwinkle_gloo.so", "twinkle_gloo_create_v1"));
  return std::unique_ptr<Communicator>(create(&store, &config));
}

}  // namespace twinkle::transport
