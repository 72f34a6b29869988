#pragma once

#include <unistd.h>

#include <utility>

namespace twinkle::transport {

// A file descriptor with one owner: closed in the destructor, moved not copied. Every descriptor
// the runtime opens lives in one of these from the moment it exists, so no failure path between
// pipe(), socketpair() and spawn leaks one.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  // Gives up ownership: the caller closes it.
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// Both ends of a pipe or socket pair, close-on-exec. make_* throw twinkle::Error naming `what`.
struct FdPair {
  Fd first;   // a pipe's read end
  Fd second;  // a pipe's write end
  static FdPair pipe(const char* what);
  static FdPair seqpacket(const char* what);
};

}  // namespace twinkle::transport
