// `meson test --benchmark`, remote mode: a head and two node agents on loopback, and Twinkle's
// costs through them next to references measured in the same run (raw ZeroMQ TCP round trip and
// bandwidth on the same loopback link, local mode for the launch), as ratios; then the head under
// 1,000 simulated nodes (heartbeat CPU, placements per second for 8-worker jobs).
// Usage: twinkle_bench_cluster TWINKLE_BINARY BENCH_JOB [--quick]
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "bench/common.hpp"
#include "core/cluster/head_link.hpp"
#include "transports/zmq/message.hpp"

extern char** environ;

namespace {

using namespace twinkle::bench;
using twinkle::Value;
using Message = twinkle::transport::ClusterMessage;
using twinkle::transport::MsgType;

// A child process with its output in `log`, killed when this object goes.
struct Child {
  pid_t pid = 0;
  std::string log;
  Child(const std::vector<std::string>& argv, std::string log_file) : log(std::move(log_file)) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 2, 1);
    std::vector<char*> a;
    for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    if (posix_spawn(&pid, a[0], &fa, nullptr, a.data(), environ) != 0)
      throw std::runtime_error("cannot start " + argv[0]);
    posix_spawn_file_actions_destroy(&fa);
  }
  ~Child() {
    kill(pid, SIGTERM);
    waitpid(pid, nullptr, 0);
  }
  // Waits (bounded) for `text` in the log; returns the log.
  std::string wait_for(const std::string& text) const {
    for (int i = 0; i < 400; ++i) {
      std::ifstream in(log);
      std::stringstream ss;
      ss << in.rdbuf();
      if (ss.str().find(text) != std::string::npos) return ss.str();
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    throw std::runtime_error("no \"" + text + "\" in " + log);
  }
};

double cpu_seconds(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::istringstream rest(s.substr(s.rfind(')') + 2));
  std::string f;
  long utime = 0, stime = 0;
  for (int i = 3; i <= 15; ++i) {
    rest >> f;
    if (i == 14) utime = std::stol(f);
    if (i == 15) stime = std::stol(f);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

struct HeadScale {
  double cpu_percent = 0;   // of one core, while 1,000 nodes heartbeat every 0.5 s
  double placements_s = 0;  // reserve + release of an 8-worker job, per second
};

// 1,000 simulated agents (DEALER sockets of this process) register and heartbeat; meanwhile a
// driver reserves and releases 8-worker jobs as fast as the head answers.
HeadScale head_scale(const std::string& twinkle, const std::string& dir, bool quick) {
  const int nodes = quick ? 200 : 1000;
  Child head({twinkle, "node", "start", "--head", "--no-agent", "--port", "0"},
             dir + "/scale-head.log");
  const std::string log = head.wait_for("listening on");
  const auto at = log.find("tcp://");
  const std::string address = log.substr(at, log.find(' ', at) - at);
  zmq::context_t ctx;
  ctx.set(zmq::ctxopt::max_sockets, nodes + 64);
  std::vector<zmq::socket_t> agents;
  auto reg = [](int i) {
    twinkle::transport::proto::NodeRegister r;
    r.node = r.host = fmt::format("sim{}", i);
    r.address = "127.0.0.1";
    r.cpus = 64;
    r.memory = static_cast<std::int64_t>(1) << 38;
    return r;
  };
  for (int i = 0; i < nodes; ++i) {
    agents.emplace_back(ctx, zmq::socket_type::dealer);
    agents.back().set(zmq::sockopt::routing_id, fmt::format("agent/sim{}", i));
    agents.back().set(zmq::sockopt::linger, 0);
    agents.back().connect(address);
    twinkle::transport::send_message(agents.back(), Message{0, reg(i)});
  }
  for (auto& a : agents) {
    if (!twinkle::transport::recv_frames(a, 10000)) throw std::runtime_error("no welcome");
  }
  std::atomic<bool> stop{false};
  // Heartbeats of every node every 0.5 s, from one thread (the sockets are only used there).
  std::thread beats([&] {
    while (!stop) {
      const auto t0 = Clock::now();
      for (int i = 0; i < nodes; ++i) {
        twinkle::transport::send_message(
            agents[i], Message{0, twinkle::transport::proto::Heartbeat{fmt::format("sim{}", i),
                                                                       std::nullopt}});
        zmq::message_t drop;
        while (agents[i].recv(drop, zmq::recv_flags::dontwait)) {
        }
      }
      std::this_thread::sleep_until(t0 + std::chrono::milliseconds(500));
    }
  });
  HeadScale out;
  const double window = quick ? 2.0 : 5.0;
  const double c0 = cpu_seconds(head.pid);
  std::this_thread::sleep_for(std::chrono::duration<double>(window));
  out.cpu_percent = (cpu_seconds(head.pid) - c0) / window * 100.0;

  twinkle::core::cluster::HeadLink link(address, {}, "driver/bench");
  const std::vector<twinkle::transport::proto::GroupDemandEntry> groups{{"g", 8, 0, "pack", {}}};
  const int n = quick ? 200 : 1000;
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    const std::string run = fmt::format("r{}", i);
    const auto r = link.request<twinkle::transport::proto::Reservation>(
        Message{static_cast<std::uint64_t>(i + 1),
                twinkle::transport::proto::Reserve{run, "bench", "bench", false, groups, {}}},
        std::chrono::seconds(10));
    if (!r.ok) throw std::runtime_error("reservation refused");
    link.send(Message{0, twinkle::transport::proto::Release{run, {}}});
  }
  out.placements_s = n / std::chrono::duration<double>(Clock::now() - t0).count();
  stop = true;
  beats.join();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s TWINKLE_BINARY BENCH_JOB [--quick]\n", argv[0]);
    return 2;
  }
  const std::string twinkle = argv[1], job = argv[2];
  const bool quick = argc > 3 && std::string(argv[3]) == "--quick";
  rlimit nofile{};
  getrlimit(RLIMIT_NOFILE, &nofile);
  nofile.rlim_cur = nofile.rlim_max;
  setrlimit(RLIMIT_NOFILE, &nofile);
  char tmpl[] = "/tmp/twinkle-bench-cluster.XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  setenv("HOME", dir.c_str(), 1);  // no keys: a loopback cluster in plaintext
  try {
    Child head({twinkle, "node", "start", "--head", "--no-agent", "--port", "0"},
               dir + "/head.log");
    const std::string log = head.wait_for("listening on");
    const auto at = log.find("tcp://");
    const std::string address = log.substr(at, log.find(' ', at) - at);
    Child a1({twinkle, "node", "start", "--address", address, "--node-id", "a1", "--cpus", "8",
              "--cache-dir", dir + "/cache-a1"},
             dir + "/a1.log");
    Child a2({twinkle, "node", "start", "--address", address, "--node-id", "a2", "--cpus", "8",
              "--cache-dir", dir + "/cache-a2"},
             dir + "/a2.log");
    a1.wait_for("joined");
    a2.wait_for("joined");
    const std::string remote = "--address " + address;
    const std::vector<std::string> mode = {"job.mode=remote"};
    auto with = [&](std::vector<std::string> v) {
      v.insert(v.end(), mode.begin(), mode.end());
      return v;
    };
    const int calls = quick ? 500 : 2000;
    std::vector<double> zp50, tp50;
    for (int rep = 0; rep < 3; ++rep) {
      zp50.push_back(zmq_rtt(calls, true).first);
      tp50.push_back(run_twinkle(twinkle, job, "calls", with({fmt::format("args.calls={}", calls)}),
                                 "", remote)
                         .figures["call_rtt_p50"]);
    }
    // Calls between groups in remote mode: every worker serves on its node's address, over TCP.
    std::vector<double> pp50, psend;
    const int send_mib = quick ? 16 : 64;
    for (int rep = 0; rep < 3; ++rep) {
      auto f = run_twinkle(twinkle, job, "peer_calls",
                           with({fmt::format("args.calls={}", calls),
                                 fmt::format("args.broadcast_mib={}", send_mib)}),
                           "", remote)
                   .figures;
      pp50.push_back(f["peer_rtt_p50"]);
      psend.push_back(f["peer_send"]);
    }
    const int mib = quick ? 64 : 256;
    const double raw_bw = zmq_tcp_bandwidth(static_cast<std::size_t>(mib) << 20);
    const double bw = run_twinkle(twinkle, job, "dispatch_two",
                                  with({fmt::format("args.dispatch_mib={}", mib)}), "", remote)
                          .figures["dispatch_two_bandwidth"];
    const std::string launch_job =
        (std::filesystem::path(job).parent_path() / "bench_launch.toml").string();
    std::vector<double> first_remote, first_local;
    for (int rep = 0; rep < 3; ++rep) {
      first_remote.push_back(
          run_twinkle(twinkle, launch_job, "first_call", with({}), "FIRST CALL DONE", remote)
              .mark_s);
      first_local.push_back(
          run_twinkle(twinkle, launch_job, "first_call", {}, "FIRST CALL DONE").mark_s);
    }
    const HeadScale scale = head_scale(twinkle, dir, quick);

    fmt::print("twinkle remote-mode benchmarks: a head and 2 agents on loopback{}\n\n",
               quick ? ", quick" : "");
    fmt::print("{:<48} {:>12} {:>22} {:>8}\n", "figure", "twinkle", "reference", "ratio");
    auto row = [](const std::string& name, double v, const std::string& ref_name, double ref) {
      fmt::print("{:<48} {:>12.4g} {:>14} {:>7.4g} {:>7.2f}x\n", name, v, ref_name, ref,
                 ref > 0 ? v / ref : 0.0);
    };
    row("1. remote call round trip p50 (us)", percentile(tp50, 0.5), "zmq tcp p50",
        percentile(zp50, 0.5));
    row(fmt::format("2. {} MiB slice_dp to 2 remote workers (GB/s)", mib), bw, "zmq tcp GB/s",
        raw_bw);
    row("   remote worker -> worker round trip p50 (us)", percentile(pp50, 0.5), "zmq tcp p50",
        percentile(zp50, 0.5));
    row(fmt::format("   {} MiB worker -> worker, remote mode (GB/s)", send_mib),
        percentile(psend, 0.5), "zmq tcp GB/s", raw_bw);
    row("3. run to first call done, 8 workers, 2 agents (s)", percentile(first_remote, 0.5),
        "local mode", percentile(first_local, 0.5));
    fmt::print("4. head with {} simulated nodes heartbeating every 0.5 s: {:.1f}% of one core\n",
               quick ? 200 : 1000, scale.cpu_percent);
    fmt::print("   placements (reserve + release) of 8-worker jobs: {:.0f} per second\n",
               scale.placements_s);
    fmt::print(
        "   Ray's published scalability envelope (release/benchmarks/README.md): 250+ nodes, 1k+ "
        "simultaneously running placement groups\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "twinkle_bench_cluster: %s\n", e.what());
    std::filesystem::remove_all(dir);
    return 1;
  }
  std::filesystem::remove_all(dir);
  return 0;
}
