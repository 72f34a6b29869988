#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "twinkle/fd.hpp"

// The driver's stop signals (docs/ARCHITECTURE.md, Signals): SIGINT, SIGTERM, SIGHUP and SIGUSR1
// are blocked in every thread and read by one thread of their own, from a signalfd.
namespace twinkle::core {

class StopSignals {
 public:
  struct Options {
    // A run with a checkpoint_dir: SIGTERM and SIGUSR1 first only ask the driver entry to stop
    // (stop_requested()); it has `grace` to checkpoint and return. Another signal, or the end of
    // the grace, interrupts as any other signal does.
    bool graceful = false;
    std::chrono::milliseconds grace{0};
    // Stops the run for a signal (on the signal thread): called once, for the first.
    std::function<void(int sig)> interrupt;
  };

  StopSignals() = default;
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The signals stay blocked: a second Ctrl-C while `twinkle` exits must not turn a clean exit
  // code into a death by signal.
  ~StopSignals() { stop(); }

  // Blocks the stop signals in this thread and the threads it starts from now on: before any
  // thread exists, so that only the signal thread takes them (a signal delivered to another
  // thread would run the default action, or vanish where the shell ignores SIGINT).
  static void block();
  // Before start(): waits up to `d` for a stop signal; the signal, or 0.
  static int wait(std::chrono::milliseconds d);

  // Starts the signal thread. Throws Error when the signals cannot be watched.
  void start(Options options);
  // The driver entry returned (a stop request and its grace no longer apply); wakes a wait in
  // wait_entry_returned().
  void entry_returned();
  // Waits up to `d` for entry_returned(); true when it came.
  bool wait_entry_returned(std::chrono::milliseconds d);
  // entry_returned(), then ends the signal thread at once (an eventfd wakes it) and joins it.
  void stop();

  bool stop_requested() const { return stop_requested_.load(); }
  // The signal that requested the stop (SIGTERM or SIGUSR1), 0 before.
  int stop_signal() const { return stop_signal_.load(); }

 private:
  void serve(Fd signals);
  bool has_returned();

  Options options_;
  std::thread thread_;
  Fd wake_;  // ends the thread
  std::atomic<bool> stop_requested_{false};
  std::atomic<int> stop_signal_{0};
  std::atomic<bool> interrupted_{false};
  std::mutex returned_mu_;
  std::condition_variable returned_cv_;
  bool returned_ = false;
};

// "SIGINT", "SIGTERM", ...: how messages name a stop signal.
const char* signal_name(int sig);

}  // namespace twinkle::core
