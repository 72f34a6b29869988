#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

// SHA-256 in hex: what names a plugin shipped to agents, a working directory's archive, a
// checkpoint part.
namespace twinkle::core {

// Lowercase hex of `n` bytes.
std::string hex(const unsigned char* data, std::size_t n);
// The sha256 of bytes, and of a file's bytes (throws Error naming the file when it cannot be read).
std::string sha256_hex(const void* data, std::size_t size);
std::string sha256_file(const std::filesystem::path& file);

}  // namespace twinkle::core
