#pragma once

#include <array>
#include <cstddef>

// SHA-256 of checkpoint parts (docs/ARCHITECTURE.md, Checkpoints): OpenSSL's, whose SHA-NI and
// AVX2 code hashes several times as fast as a portable one, loaded from the module
// libtwinkle_sha256.so at the first hash, so that a worker that writes or reads no checkpoint
// starts without mapping and relocating libcrypto (about 4 ms of CPU per process on the
// development VM).
namespace twinkle::core {

// What the module gives (twinkle_sha256_ops_v1); null or non-zero returns are failures.
struct Sha256Ops {
  void* (*create)();  // a context, started
  int (*update)(void* ctx, const void* data, std::size_t n);
  int (*finish)(void* ctx, unsigned char* out32);
  void (*destroy)(void* ctx);
};

class Sha256 {
 public:
  using Digest = std::array<unsigned char, 32>;
  // Throws Error when the module cannot be loaded or OpenSSL cannot start a hash.
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  // Safe from one thread at a time (a writer may hand it to another thread while it waits).
  void update(const void* data, std::size_t n);
  // The hash of everything given; once.
  Digest finish();
  // The hash of `n` bytes at `data`.
  static Digest of(const void* data, std::size_t n);

 private:
  const Sha256Ops* ops_;
  void* ctx_;
};

}  // namespace twinkle::core
