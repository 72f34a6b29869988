// The owner of a file descriptor, shared by every part of Twinkle on the host side (the loader, the
// transports, the job model, the runtime, the command line). Header-only and free of any Twinkle
// library, like errors.hpp. Host-side only: it is not installed with the SDK, because plugins do
// not need it.
#pragma once

#include <signal.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>

#include <utility>

namespace twinkle {

// A file descriptor with one owner: closed in the destructor, moved not copied. Every descriptor
// Twinkle opens lives in one of these from the moment it exists, so no failure path leaks one and
// none is closed by hand. Not thread-safe: one thread owns it at a time, like the descriptor.
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

  // The descriptor, still owned here; -1 when empty.
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  // Gives up ownership: the caller closes it.
  int release() noexcept { return std::exchange(fd_, -1); }
  // Closes the descriptor held, if any, and takes ownership of `fd` (-1: none).
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// A descriptor that becomes readable when process `pid` (a child, or one whose pid is known to be
// alive) exits: poll it beside others instead of waking now and then for waitpid. Empty where
// the kernel has no pidfds (before Linux 5.3), with errno set; callers fall back to polling.
inline Fd open_pidfd(pid_t pid) noexcept {
#ifdef SYS_pidfd_open
  return Fd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
#else
  (void)pid;
  errno = ENOSYS;
  return Fd();
#endif
}

// `sig` to the process of `pidfd` (which names it even once its pid is reused), or to `pid` where
// there is no pidfd. 0, or -1 with errno, like kill().
inline int send_signal(const Fd& pidfd, pid_t pid, int sig) noexcept {
#ifdef SYS_pidfd_send_signal
  if (pidfd)
    return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd.get(), sig, nullptr, 0));
#endif
  return ::kill(pid, sig);
}

}  // namespace twinkle
