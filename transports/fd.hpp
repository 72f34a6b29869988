#pragma once

#include <sys/types.h>

#include <cstddef>
#include <span>
#include <vector>

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

// Sends `size` bytes of `data` and the descriptors `fds` (SCM_RIGHTS, still the caller's) in one
// sendmsg on the Unix socket `sock`, with MSG_NOSIGNAL and `flags`; what sendmsg returns (retried
// on EINTR).
ssize_t send_with_fds(int sock, const void* data, std::size_t size, std::span<const int> fds,
                      int flags = 0);
// Receives one message of up to `buf.size()` bytes on `sock` (with `flags`, e.g. MSG_DONTWAIT) and
// up to `max_fds` descriptors, which `fds` then owns (close-on-exec). Its size; 0 at the end of
// the stream; -1 on an error (errno) or a message or descriptor list cut short (errno EMSGSIZE).
ssize_t receive_with_fds(int sock, std::span<char> buf, std::vector<Fd>& fds, std::size_t max_fds,
                         int flags = 0);

}  // namespace twinkle::transport
