// The driver's heap in huge pages (core/runtime/heap_pages.hpp): once the heap grows in large
// steps, the part that grew is marked for transparent huge pages (VmFlags "hg" in smaps), and
// what was allocated there reads back as written. Exits 77 (skipped) where the kernel has no
// transparent huge pages or gives them to no memory.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/runtime/heap_pages.hpp"

namespace {

bool huge_pages_on_request() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(in, line)) return false;
  return line.find("[never]") == std::string::npos;
}

// Bytes of the heap's mappings whose flags ask for huge pages, and of all its mappings.
std::pair<std::size_t, std::size_t> heap_bytes() {
  std::ifstream in("/proc/self/smaps");
  std::size_t advised = 0, all = 0, size = 0;
  bool heap = false;
  for (std::string line; std::getline(in, line);) {
    unsigned long from = 0, to = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &from, &to) == 2 && line.find(' ') < 30) {
      heap = line.find("[heap]") != std::string::npos;
      size = to - from;
      if (heap) all += size;
    } else if (heap && line.rfind("VmFlags:", 0) == 0) {
      std::istringstream flags(line.substr(8));
      for (std::string f; flags >> f;)
        if (f == "hg") advised += size;
    }
  }
  return {advised, all};
}

}  // namespace

int main() {
  if (!huge_pages_on_request()) {
    std::puts("SKIP: no transparent huge pages on this kernel");
    return 77;
  }
  twinkle::core::heap_pages::grow_in_large_steps();
  // 96 MiB in blocks of the size of a call's record, as a driver with many calls in flight.
  constexpr std::size_t kBlock = 512, kBlocks = (96u << 20) / kBlock;
  std::vector<std::unique_ptr<char[]>> blocks;
  blocks.reserve(kBlocks);
  for (std::size_t i = 0; i < kBlocks; ++i) {
    blocks.emplace_back(new char[kBlock]);
    std::memset(blocks.back().get(), static_cast<int>(i & 0xff), kBlock);
    if (i % 1024 == 0) twinkle::core::heap_pages::advise_growth();
  }
  twinkle::core::heap_pages::advise_growth();
  for (std::size_t i = 0; i < kBlocks; i += 997) {
    for (std::size_t b = 0; b < kBlock; ++b) {
      if (blocks[i][b] != static_cast<char>(i & 0xff)) {
        std::printf("FAIL: block %zu changed at byte %zu\n", i, b);
        return 1;
      }
    }
  }
  const auto [advised, all] = heap_bytes();
  std::printf("heap %zu MiB, %zu MiB of it marked for huge pages\n", all >> 20, advised >> 20);
  // Each 32 MiB step is marked but for its first, partial huge page.
  if (advised < (64u << 20)) {
    std::puts("FAIL: less than 64 of the 96 MiB that grew is marked for huge pages");
    return 1;
  }
  return 0;
}
