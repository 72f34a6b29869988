#pragma once
// What the benchmarks share: percentiles, the raw ZeroMQ and memcpy references, and running a
// bench job through `twinkle run`.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <zmq.hpp>

namespace twinkle::bench {

using Clock = std::chrono::steady_clock;

inline double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(p * static_cast<double>(v.size() - 1))];
}

// A DEALER process connected to a ROUTER of this process: it answers every message (with the
// message itself, with "ack" when `ack_only`, or with `reply_size` bytes when that is not 0) until
// it gets "stop". No high-water marks on either side, as on Twinkle's channels.
class EchoPeer {
 public:
  EchoPeer(bool tcp, bool ack_only, std::size_t reply_size = 0)
      : router_(ctx_, zmq::socket_type::router) {
    path_ = fmt::format("/tmp/twinkle-bench-{}.ipc", getpid());
    router_.set(zmq::sockopt::sndhwm, 0);
    router_.set(zmq::sockopt::rcvhwm, 0);
    router_.bind(tcp ? std::string("tcp://127.0.0.1:*") : "ipc://" + path_);
    if (tcp) path_.clear();
    const std::string endpoint = router_.get(zmq::sockopt::last_endpoint);
    child_ = fork();
    if (child_ == 0) {
      zmq::context_t cctx;
      zmq::socket_t dealer(cctx, zmq::socket_type::dealer);
      dealer.set(zmq::sockopt::sndhwm, 0);
      dealer.set(zmq::sockopt::rcvhwm, 0);
      dealer.connect(endpoint);
      dealer.send(zmq::str_buffer("hello"));
      const std::string reply(reply_size, 'r');
      for (;;) {
        zmq::message_t m;
        if (!dealer.recv(m)) continue;
        if (m.size() == 4 && std::memcmp(m.data(), "stop", 4) == 0) break;
        if (reply_size > 0) {
          dealer.send(zmq::buffer(reply), zmq::send_flags::none);
        } else if (ack_only) {
          dealer.send(zmq::str_buffer("ack"));
        } else {
          dealer.send(m, zmq::send_flags::none);
        }
      }
      _exit(0);
    }
    zmq::message_t hello;
    (void)router_.recv(id_);
    (void)router_.recv(hello);
  }
  ~EchoPeer() {
    router_.send(zmq::buffer(id_.to_string()), zmq::send_flags::sndmore);
    router_.send(zmq::str_buffer("stop"), zmq::send_flags::none);
    waitpid(child_, nullptr, 0);
    if (!path_.empty()) std::filesystem::remove(path_);
  }
  // Sends `size` bytes at `data` and waits for the answer.
  void round_trip(const void* data, std::size_t size) {
    router_.send(zmq::buffer(id_.to_string()), zmq::send_flags::sndmore);
    router_.send(zmq::const_buffer(data, size), zmq::send_flags::none);
    zmq::message_t rid, reply;
    (void)router_.recv(rid);
    (void)router_.recv(reply);
  }
  // Sends `n` messages of `size` bytes without waiting, then takes the `n` answers (as pipelined
  // calls do): round trips per second.
  double pipelined(std::size_t size, int n) {
    const std::string request(size, 'q');
    const auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) {
      router_.send(zmq::buffer(id_.to_string()), zmq::send_flags::sndmore);
      router_.send(zmq::buffer(request), zmq::send_flags::none);
    }
    for (int i = 0; i < n; ++i) {
      zmq::message_t rid, reply;
      (void)router_.recv(rid);
      (void)router_.recv(reply);
    }
    return n / std::chrono::duration<double>(Clock::now() - t0).count();
  }

 private:
  zmq::context_t ctx_;
  zmq::socket_t router_;
  zmq::message_t id_;
  std::string path_;
  pid_t child_ = 0;
};

// Round trips of a small message to an echo process over ipc (or TCP on loopback with `tcp`):
// p50 and p99 in microseconds.
inline std::pair<double, double> zmq_rtt(int n, bool tcp = false) {
  EchoPeer peer(tcp, false);
  std::vector<double> rtt;
  const std::string ping = "ping-ping-ping-ping";
  for (int i = 0; i < n + 500; ++i) {
    const auto t0 = Clock::now();
    peer.round_trip(ping.data(), ping.size());
    if (i >= 500)
      rtt.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return {percentile(rtt, 0.5), percentile(rtt, 0.99)};
}

// A forked echo process's loop: every `kSize` bytes read from `in` written back to `out`; exits
// when `in` closes.
template <std::size_t kSize>
[[noreturn]] void echo_until_closed(int in, int out) {
  char buf[kSize];
  for (;;) {
    std::size_t got = 0;
    while (got < kSize) {
      const ssize_t r = ::read(in, buf + got, kSize - got);
      if (r <= 0) _exit(0);
      got += static_cast<std::size_t>(r);
    }
    if (::write(out, buf, kSize) != static_cast<ssize_t>(kSize)) _exit(1);
  }
}

// The floor under any local round trip: a small message to a process over a Unix stream socket
// pair and back, both sides blocking in read (no ZeroMQ, no framing): p50 and p99 in
// microseconds.
inline std::pair<double, double> socketpair_rtt(int n) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) throw std::runtime_error("socketpair");
  constexpr std::size_t kSize = 19;
  const pid_t child = fork();
  if (child == 0) {
    ::close(sv[0]);
    echo_until_closed<kSize>(sv[1], sv[1]);
  }
  ::close(sv[1]);
  std::vector<double> rtt;
  char buf[kSize] = "ping-ping-ping-pin";
  for (int i = 0; i < n + 500; ++i) {
    const auto t0 = Clock::now();
    if (::write(sv[0], buf, kSize) != static_cast<ssize_t>(kSize)) break;
    std::size_t got = 0;
    while (got < kSize) {
      const ssize_t r = ::read(sv[0], buf + got, kSize - got);
      if (r <= 0) break;
      got += static_cast<std::size_t>(r);
    }
    if (i >= 500)
      rtt.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  ::close(sv[0]);
  waitpid(child, nullptr, 0);
  return {percentile(rtt, 0.5), percentile(rtt, 0.99)};
}

// The floor under a fan-out: a small message written to each of `workers` echo processes over a
// pair of pipes each (as the driver's control channels are), then every answer read as it comes
// (poll on all of them, as the driver waits); with one worker, the pipe round trip. p50 in
// microseconds.
inline double pipe_fanout(int workers, int n) {
  constexpr std::size_t kSize = 19;
  struct Child {
    int to = -1, from = -1;
    pid_t pid = -1;
  };
  std::vector<Child> kids(static_cast<std::size_t>(workers));
  for (auto& k : kids) {
    int down[2], up[2];
    if (::pipe2(down, O_CLOEXEC) != 0 || ::pipe2(up, O_CLOEXEC) != 0)
      throw std::runtime_error("pipe2");
    k.pid = fork();
    if (k.pid == 0) {
      ::close(down[1]);
      ::close(up[0]);
      for (const auto& older : kids) {
        if (older.to >= 0) ::close(older.to);
        if (older.from >= 0) ::close(older.from);
      }
      echo_until_closed<kSize>(down[0], up[1]);
    }
    ::close(down[0]);
    ::close(up[1]);
    k.to = down[1];
    k.from = up[0];
  }
  std::vector<double> rtt;
  std::vector<pollfd> fds(kids.size());
  std::vector<std::size_t> got(kids.size());
  char buf[kSize] = "ping-ping-ping-pin";
  bool broken = false;
  for (int i = 0; i < n + 500 && !broken; ++i) {
    const auto t0 = Clock::now();
    for (auto& k : kids) broken |= ::write(k.to, buf, kSize) != static_cast<ssize_t>(kSize);
    std::fill(got.begin(), got.end(), 0);
    std::size_t done = 0;
    while (done < kids.size() && !broken) {
      for (std::size_t j = 0; j < kids.size(); ++j)
        fds[j] = pollfd{got[j] < kSize ? kids[j].from : -1, POLLIN, 0};
      if (::poll(fds.data(), fds.size(), 10000) <= 0) broken = true;
      for (std::size_t j = 0; j < kids.size() && !broken; ++j) {
        if (!(fds[j].revents & (POLLIN | POLLHUP))) continue;
        char in[kSize];
        const ssize_t r = ::read(kids[j].from, in, kSize - got[j]);
        if (r <= 0) {
          broken = true;
          break;
        }
        got[j] += static_cast<std::size_t>(r);
        if (got[j] == kSize) ++done;
      }
    }
    if (i >= 500)
      rtt.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  for (auto& k : kids) {
    ::close(k.to);
    ::close(k.from);
  }
  for (auto& k : kids) waitpid(k.pid, nullptr, 0);
  if (broken || rtt.empty()) throw std::runtime_error("the raw pipe fan-out lost an echo process");
  return percentile(rtt, 0.5);
}

// The raw reference of pipelined calls: `n` messages of `request` bytes sent at once to an echo
// process over ipc, each answered with `reply` bytes; round trips per second, best of 3.
inline double zmq_pipelined(std::size_t request, std::size_t reply, int n) {
  EchoPeer peer(false, false, reply);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) best = std::max(best, peer.pipelined(request, n));
  return best;
}

// One way: `bytes` in one message to a process over TCP on loopback, which acknowledges it;
// GB/s, best of 3.
inline double zmq_tcp_bandwidth(std::size_t bytes) {
  EchoPeer peer(true, true);
  std::vector<char> data(bytes, 1);
  double best = 1e300;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    peer.round_trip(data.data(), data.size());
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return static_cast<double>(bytes) / best / 1e9;
}

inline double memcpy_gbs(std::size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  double best = 1e300;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (b[bytes / 2] != 1) std::abort();
  return static_cast<double>(bytes) / best / 1e9;
}

// Runs `twinkle run --quiet --set job.driver=DRIVER JOB`, returns its FIGURE lines and the time to
// the line `mark` (if given) and to the end.
struct RunResult {
  std::map<std::string, double> figures;
  double mark_s = -1;
  double total_s = 0;
};

// `args` are more command-line arguments (e.g. "--address tcp://...").
inline RunResult run_twinkle(const std::string& twinkle, const std::string& job,
                             const std::string& driver, const std::vector<std::string>& extra,
                             const std::string& mark = "", const std::string& args = "") {
  std::string cmd = fmt::format("'{}' run --quiet --set job.driver={}", twinkle, driver);
  for (const auto& e : extra) cmd += " --set " + e;
  if (!args.empty()) cmd += " " + args;
  cmd += fmt::format(" '{}' 2>&1", job);
  RunResult r;
  const auto t0 = Clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("cannot start " + twinkle);
  char line[4096];
  std::string log;
  while (fgets(line, sizeof line, p)) {
    log += line;
    if (!mark.empty() && r.mark_s < 0 && std::strstr(line, mark.c_str())) {
      r.mark_s = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    char name[128], unit[32];
    double v;
    if (std::sscanf(line, "FIGURE %127s %lf %31s", name, &v, unit) == 3) r.figures[name] = v;
  }
  const int rc = pclose(p);
  r.total_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (rc != 0) throw std::runtime_error("twinkle run (" + driver + ") failed:\n" + log);
  return r;
}

}  // namespace twinkle::bench
