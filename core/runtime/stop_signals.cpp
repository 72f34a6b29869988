#include "core/runtime/stop_signals.hpp"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core {

namespace {

sigset_t stop_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGUSR1}) sigaddset(&set, s);
  return set;
}

}  // namespace

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    case SIGUSR1: return "SIGUSR1";
  }
  return "a signal";
}

void StopSignals::block() {
  const sigset_t set = stop_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int StopSignals::wait(std::chrono::milliseconds d) {
  const sigset_t set = stop_set();
  timespec t{static_cast<time_t>(d.count() / 1000), static_cast<long>(d.count() % 1000) * 1000000};
  const int sig = sigtimedwait(&set, nullptr, &t);
  return sig > 0 ? sig : 0;
}

void StopSignals::start(Options options) {
  options_ = std::move(options);
  const sigset_t set = stop_set();
  Fd signals(::signalfd(-1, &set, SFD_CLOEXEC));
  wake_.reset(::eventfd(0, EFD_CLOEXEC));
  if (!signals || !wake_)
    throw Error(fmt::format("cannot watch for stop signals: {}", std::strerror(errno)));
  thread_ =
      std::thread([this, signals = std::move(signals)]() mutable { serve(std::move(signals)); });
}

void StopSignals::serve(Fd signals) {
  std::optional<std::chrono::steady_clock::time_point> grace_end;
  for (;;) {
    int timeout = -1;
    if (grace_end) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(
          *grace_end - std::chrono::steady_clock::now());
      timeout = static_cast<int>(std::max<std::int64_t>(0, left.count()));
    }
    pollfd fds[2] = {{signals.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, timeout) < 0 && errno != EINTR) return;
    if (fds[1].revents) return;  // stop()
    int sig = 0;
    signalfd_siginfo info{};
    if ((fds[0].revents & POLLIN) &&
        ::read(signals.get(), &info, sizeof info) == static_cast<ssize_t>(sizeof info))
      sig = static_cast<int>(info.ssi_signo);
    if (sig == 0) {
      if (grace_end && std::chrono::steady_clock::now() >= *grace_end && !has_returned()) {
        grace_end.reset();
        std::fprintf(stderr,
                     "\ntwinkle: the driver entry did not return within stop_grace_s = %g s of "
                     "the stop request; stopping the run\n",
                     std::chrono::duration<double>(options_.grace).count());
        std::fflush(stderr);
        interrupted_ = true;
        options_.interrupt(stop_signal_);
      }
      continue;
    }
    if (interrupted_) continue;  // the first interrupt decides
    if ((sig == SIGTERM || sig == SIGUSR1) && options_.graceful && !stop_requested_ &&
        !has_returned()) {
      stop_signal_ = sig;
      stop_requested_ = true;
      grace_end = std::chrono::steady_clock::now() + options_.grace;
      std::fflush(stdout);
      std::fprintf(stderr,
                   "\ntwinkle: %s: stop requested; the driver entry has %g s to checkpoint and "
                   "return (another signal stops the run at once)\n",
                   signal_name(sig), std::chrono::duration<double>(options_.grace).count());
      std::fflush(stderr);
      continue;
    }
    grace_end.reset();
    interrupted_ = true;
    options_.interrupt(sig);
  }
}

bool StopSignals::has_returned() {
  std::lock_guard lock(returned_mu_);
  return returned_;
}

void StopSignals::entry_returned() {
  std::lock_guard lock(returned_mu_);
  returned_ = true;
  returned_cv_.notify_all();
}

bool StopSignals::wait_entry_returned(std::chrono::milliseconds d) {
  std::unique_lock lock(returned_mu_);
  return returned_cv_.wait_for(lock, d, [this] { return returned_; });
}

void StopSignals::stop() {
  if (!thread_.joinable()) return;
  entry_returned();
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  thread_.join();
}

}  // namespace twinkle::core
