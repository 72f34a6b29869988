#include "transports/fd.hpp"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/uio.h>

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

ssize_t send_with_fds(int sock, const void* data, std::size_t size, std::span<const int> fds,
                      int flags) {
  iovec iov{const_cast<void*>(data), size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  while ((n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | flags)) < 0 && errno == EINTR) {
  }
  return n;
}

ssize_t receive_with_fds(int sock, std::span<char> buf, std::vector<Fd>& fds, std::size_t max_fds,
                         int flags) {
  fds.clear();
  iovec iov{buf.data(), buf.size()};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * max_fds));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  while ((n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | flags)) < 0 && errno == EINTR) {
  }
  if (n < 0) return -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      fds.emplace_back(fd);
    }
  }
  if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
    errno = EMSGSIZE;
    return -1;
  }
  return n;
}

}  // namespace twinkle::transport
