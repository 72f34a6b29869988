// libFuzzer target: the loader's checks of a plugin file before dlopen (plugins/loader.cpp
// check_elf_image). Input: 8 bytes little-endian file size, then the file's first bytes.
// Any input must pass or raise PluginError.
#include <cstddef>
#include <cstdint>

#include "plugins/loader.hpp"
#include "twinkle/errors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 8) return -1;
  std::uint64_t file_size = 0;
  for (int i = 0; i < 8; ++i) file_size |= std::uint64_t(data[i]) << (8 * i);
  try {
    twinkle::plugins::check_elf_image(data + 8, size - 8, file_size, "/fuzz/plugin.so");
  } catch (const twinkle::PluginError&) {
  }
  return 0;
}
