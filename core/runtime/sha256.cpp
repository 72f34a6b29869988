#include "core/runtime/sha256.hpp"

#include "transports/module.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core {

namespace {

const Sha256Ops& ops() {
  static const Sha256Ops* const loaded = [] {
    using Fn = const Sha256Ops* (*)();
    auto fn = reinterpret_cast<Fn>(
        transport::module_symbol("libtwinkle_sha256.so", "twinkle_sha256_ops_v1"));
    return fn();
  }();
  return *loaded;
}

}  // namespace

Sha256::Sha256() : ops_(&ops()), ctx_(ops_->create()) {
  if (!ctx_) throw Error("cannot start a sha256 (OpenSSL)");
}

Sha256::~Sha256() { ops_->destroy(ctx_); }

void Sha256::update(const void* data, std::size_t n) {
  if (ops_->update(ctx_, data, n) != 0) throw Error("sha256 (OpenSSL) failed");
}

Sha256::Digest Sha256::finish() {
  Digest out{};
  if (ops_->finish(ctx_, out.data()) != 0) throw Error("sha256 (OpenSSL) failed");
  return out;
}

Sha256::Digest Sha256::of(const void* data, std::size_t n) {
  Sha256 h;
  h.update(data, n);
  return h.finish();
}

}  // namespace twinkle::core
