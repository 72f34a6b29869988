#include "core/runtime/heap_pages.hpp"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace twinkle::core::heap_pages {
namespace {

constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;  // x86-64's huge page
constexpr int kStep = 32 << 20;                            // the heap's growth step

std::atomic<bool> on{false};
std::atomic<std::uintptr_t> advised{0};  // the heap's end when last advised

}  // namespace

void grow_in_large_steps() noexcept {
  if (on.exchange(true)) return;
  ::mallopt(M_TOP_PAD, kStep);
  advised = reinterpret_cast<std::uintptr_t>(::sbrk(0));
}

void advise_growth() noexcept {
  if (!on.load(std::memory_order_relaxed)) return;
  const auto end = reinterpret_cast<std::uintptr_t>(::sbrk(0));  // no system call: glibc's cache
  std::uintptr_t from = advised.load(std::memory_order_relaxed);
  if (end <= from + kHuge || !advised.compare_exchange_strong(from, end)) return;
  // Whole huge pages only: what lies before them is in use already.
  const std::uintptr_t first = (from + kHuge - 1) & ~(kHuge - 1);
  const std::uintptr_t last = end & ~(kHuge - 1);
  if (last > first)
    ::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // a hint: no check
}

}  // namespace twinkle::core::heap_pages
