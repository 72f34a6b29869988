#pragma once

// The driver's heap in transparent huge pages (docs/ARCHITECTURE.md, Memory of the driver). A
// driver that keeps many calls in flight grows its heap by hundreds of megabytes (about 600 bytes
// a call: its record, the answers kept until they are collected); in 4 KiB pages each first
// touch is a page fault, and on virtual machines where a fault costs several microseconds that
// cost a third of the driver's CPU in a pipelined run. Where the kernel gives huge pages to the
// memory that asks for them (transparent_hugepage = madvise, the usual default), the heap grows
// in large steps and each step asks for them; elsewhere nothing changes.
namespace twinkle::core::heap_pages {

// Once, in the driver, before its calls: the heap grows at least 32 MiB at a time.
void grow_in_large_steps() noexcept;

// Asks for huge pages for the part of the heap that grew since the last time (cheap when it
// did not grow: no system call). Called now and then by what grows the heap.
void advise_growth() noexcept;

}  // namespace twinkle::core::heap_pages
