// The SHA-256 module (libtwinkle_sha256.so): OpenSSL's libcrypto, loaded at a process's first
// checkpoint hash (core/runtime/sha256.hpp).
#include <openssl/evp.h>

#include "core/runtime/sha256.hpp"

namespace {

void* create() {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  if (ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) != 1) {
    EVP_MD_CTX_free(ctx);
    return nullptr;
  }
  return ctx;
}

int update(void* ctx, const void* data, std::size_t n) {
  return EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx), data, n) == 1 ? 0 : -1;
}

int finish(void* ctx, unsigned char* out32) {
  unsigned int len = 0;
  return EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx), out32, &len) == 1 && len == 32 ? 0 : -1;
}

void destroy(void* ctx) { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx)); }

constexpr twinkle::core::Sha256Ops kOps{create, update, finish, destroy};

}  // namespace

extern "C" __attribute__((visibility("default"))) const twinkle::core::Sha256Ops*
twinkle_sha256_ops_v1() {
  return &kOps;
}
