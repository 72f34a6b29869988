#pragma once

#include <string>

// Twinkle's own optional parts that need large libraries (NCCL and the CUDA runtime, Gloo, libcurl
// with its TLS stack) are shared modules loaded when a run first needs them, so that `twinkle` and
// every worker start without mapping and relocating them.
namespace twinkle::transport {

// The address of `symbol` in the module `name` ("libtwinkle_nccl.so"), loaded once and kept for
// the life of the process. The module is looked for in $TWINKLE_MODULE_DIR when it is set (tests
// whose binaries are elsewhere), next to the running binary (the build tree), then in the install
// folder. Throws TransportError naming the module, where it was looked for and
// dlopen's reason.
void* module_symbol(const std::string& name, const char* symbol);

}  // namespace twinkle::transport
