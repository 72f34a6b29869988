#include "core/job/digest.hpp"

#include <sodium.h>

#include <fstream>
#include <vector>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core {

std::string hex(const unsigned char* data, std::size_t n) {
  std::string out;
  out.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) out += fmt::format("{:02x}", data[i]);
  return out;
}

std::string sha256_hex(const void* data, std::size_t size) {
  unsigned char out[crypto_hash_sha256_BYTES];
  crypto_hash_sha256(out, static_cast<const unsigned char*>(data), size);
  return hex(out, sizeof out);
}

std::string sha256_file(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot read {}", file.string()));
  crypto_hash_sha256_state st;
  crypto_hash_sha256_init(&st);
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    crypto_hash_sha256_update(&st, reinterpret_cast<const unsigned char*>(buf.data()),
                              static_cast<unsigned long long>(in.gcount()));
  }
  unsigned char out[crypto_hash_sha256_BYTES];
  crypto_hash_sha256_final(&st, out);
  return hex(out, sizeof out);
}

}  // namespace twinkle::core
