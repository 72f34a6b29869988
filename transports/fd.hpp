#pragma once

#include "twinkle/fd.hpp"

namespace twinkle::transport {

// Both ends of a pipe or Unix socket pair, close-on-exec. pipe(), seqpacket() and stream() throw
// twinkle::Error naming `what`.
struct FdPair {
  Fd first;   // a pipe's read end
  Fd second;  // a pipe's write end
  static FdPair pipe(const char* what);
  static FdPair seqpacket(const char* what);
  static FdPair stream(const char* what);
};

}  // namespace twinkle::transport
