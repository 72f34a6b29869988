#include "transports/fd.hpp"

#include <fcntl.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::transport {

FdPair FdPair::pipe(const char* what) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0)
    throw Error(fmt::format("cannot create a pipe for {}: {}", what, std::strerror(errno)));
  return {Fd(p[0]), Fd(p[1])};
}

namespace {

FdPair socket_pair(int type, const char* what) {
  int p[2];
  if (::socketpair(AF_UNIX, type | SOCK_CLOEXEC, 0, p) != 0)
    throw Error(fmt::format("cannot create a socket pair for {}: {}", what, std::strerror(errno)));
  return {Fd(p[0]), Fd(p[1])};
}

}  // namespace

FdPair FdPair::seqpacket(const char* what) { return socket_pair(SOCK_SEQPACKET, what); }

FdPair FdPair::stream(const char* what) { return socket_pair(SOCK_STREAM, what); }

}  // namespace twinkle::transport
