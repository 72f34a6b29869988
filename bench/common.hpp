#pragma once
// What the benchmarks share: percentiles, the raw ZeroMQ and memcpy references, and running a
// bench job through `twinkle run`.
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

// Round trips of a 1-frame message between a ROUTER here and a DEALER echo process, over ipc
// (or TCP on loopback with `tcp`).
inline std::pair<double, double> zmq_rtt(int n, bool tcp = false) {
  const std::string path = fmt::format("/tmp/twinkle-bench-{}.ipc", getpid());
  zmq::context_t ctx;
  zmq::socket_t router(ctx, zmq::socket_type::router);
  router.bind(tcp ? std::string("tcp://127.0.0.1:*") : "ipc://" + path);
  const std::string endpoint = router.get(zmq::sockopt::last_endpoint);
  pid_t child = fork();
  if (child == 0) {
    zmq::context_t cctx;
    zmq::socket_t dealer(cctx, zmq::socket_type::dealer);
    dealer.connect(endpoint);
    dealer.send(zmq::str_buffer("hello"));
    for (;;) {
      zmq::message_t m;
      if (!dealer.recv(m)) continue;
      if (m.size() == 4 && std::memcmp(m.data(), "stop", 4) == 0) break;
      dealer.send(m, zmq::send_flags::none);
    }
    _exit(0);
  }
  zmq::message_t id, hello;
  (void)router.recv(id);
  (void)router.recv(hello);
  std::vector<double> rtt;
  for (int i = 0; i < n + 500; ++i) {
    const auto t0 = Clock::now();
    router.send(zmq::buffer(id.to_string()), zmq::send_flags::sndmore);
    router.send(zmq::str_buffer("ping-ping-ping-ping"), zmq::send_flags::none);
    zmq::message_t rid, reply;
    (void)router.recv(rid);
    (void)router.recv(reply);
    if (i >= 500)
      rtt.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  router.send(zmq::buffer(id.to_string()), zmq::send_flags::sndmore);
  router.send(zmq::str_buffer("stop"), zmq::send_flags::none);
  waitpid(child, nullptr, 0);
  if (!tcp) std::filesystem::remove(path);
  return {percentile(rtt, 0.5), percentile(rtt, 0.99)};
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
