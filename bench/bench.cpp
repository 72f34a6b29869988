// `meson test --benchmark`: Twinkle's own costs next to references measured in the same run on the
// same machine (raw ZeroMQ round trip over the same ipc transport, memcpy bandwidth, the Gloo
// collectives backend next to the shared-memory one), as ratios.
// Usage: twinkle_bench TWINKLE_BINARY BENCH_JOB [--quick | --pipelined]
// --pipelined: only the pipelined row, three runs next to the raw reference (for profiling).
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <zmq.hpp>

#include "bench/common.hpp"
#include "transports/zmq/message.hpp"

extern char** environ;

namespace {

using namespace twinkle::bench;

// The floor of any launcher: spawn `n` minimal processes (/bin/true) and reap them, in seconds.
double spawn_and_reap(int n) {
  std::vector<pid_t> pids(static_cast<std::size_t>(n));
  char* argv[] = {const_cast<char*>("/bin/true"), nullptr};
  const auto t0 = Clock::now();
  for (auto& p : pids) {
    if (posix_spawn(&p, argv[0], nullptr, nullptr, argv, environ) != 0)
      throw std::runtime_error("cannot spawn /bin/true");
  }
  for (pid_t p : pids) waitpid(p, nullptr, 0);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The same job under OpenMPI, when mpicc and mpirun are installed: `mpirun -np n` of a program
// that does one 1-float MPI_Allreduce, in seconds (built once into `dir`); negative otherwise.
double mpirun_allreduce(int n, const std::filesystem::path& dir) {
  if (std::system("command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1") != 0)
    return -1;
  const auto exe = dir / "mpi_allreduce_one";
  if (!std::filesystem::exists(exe)) {
    const auto src = dir / "mpi_allreduce_one.c";
    std::FILE* f = std::fopen(src.c_str(), "w");
    if (!f) return -1;
    std::fputs(
        "#include <mpi.h>\n"
        "int main(int argc, char** argv) {\n"
        "  MPI_Init(&argc, &argv);\n"
        "  float x = 1, y = 0;\n"
        "  MPI_Allreduce(&x, &y, 1, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);\n"
        "  MPI_Finalize();\n"
        "  return 0;\n"
        "}\n",
        f);
    std::fclose(f);
    const std::string cc =
        fmt::format("mpicc -O2 '{}' -o '{}' >/dev/null 2>&1", src.string(), exe.string());
    if (std::system(cc.c_str()) != 0) return -1;
  }
  const std::string cmd = fmt::format(
      "mpirun --allow-run-as-root --oversubscribe -np {} '{}' >/dev/null 2>&1", n, exe.string());
  const auto t0 = Clock::now();
  if (std::system(cmd.c_str()) != 0) return -1;
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The sizes on the wire of a no-op call (the bench plugin's, from its driver) and of its reply:
// what the raw pipelined reference sends.
std::pair<std::size_t, std::size_t> call_sizes() {
  using namespace twinkle::transport;
  const Message call{
      1,
      proto::Call{1, "noop", "bench_plugin.cpp:112", twinkle::encode(twinkle::Value::list()), {}}};
  const Message reply{1, proto::Reply{std::nullopt, twinkle::encode(twinkle::Value(0))}};
  return {encode_message(call)[0].size(), encode_message(reply)[0].size()};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s TWINKLE_BINARY BENCH_JOB [--quick | --pipelined]\n", argv[0]);
    return 2;
  }
  const std::string twinkle = argv[1], job = argv[2];
  const bool quick = argc > 3 && std::string(argv[3]) == "--quick";
  const int calls = quick ? 1000 : 5000;
  try {
    if (argc > 3 && std::string(argv[3]) == "--pipelined") {
      const auto [call_bytes, reply_bytes] = call_sizes();
      for (int rep = 0; rep < 3; ++rep) {
        const double ref = zmq_pipelined(call_bytes, reply_bytes, 5 * calls);
        auto f =
            run_twinkle(twinkle, job, "pipelined", {fmt::format("args.calls={}", calls)}).figures;
        fmt::print(
            "pipelined 1 worker {:.4g} calls/s, zmq pipe {:.4g}/s: {:.3f}x; 8 workers "
            "{:.4g} calls/s\n",
            f["pipelined_1_worker"], ref, f["pipelined_1_worker"] / ref, f["pipelined_8_workers"]);
      }
      return 0;
    }
    // Round trips on a shared VM are bimodal (same core or not), so both sides are measured three
    // times, alternating, and the medians are compared.
    std::vector<double> zp50, zp99, sp50, tp50, tp99, pp50, pp99, psend, fan1, fan8;
    std::map<std::string, double> c;
    for (int rep = 0; rep < 3; ++rep) {
      const auto [p50, p99] = zmq_rtt(calls);
      zp50.push_back(p50);
      zp99.push_back(p99);
      sp50.push_back(socketpair_rtt(calls).first);
      fan1.push_back(pipe_fanout(1, calls));
      fan8.push_back(pipe_fanout(8, calls / 2));
      auto f = run_twinkle(twinkle, job, "calls", {fmt::format("args.calls={}", calls)}).figures;
      tp50.push_back(f["call_rtt_p50"]);
      tp99.push_back(f["call_rtt_p99"]);
      if (rep == 0) c = f;
      auto p =
          run_twinkle(twinkle, job, "peer_calls", {fmt::format("args.calls={}", calls)}).figures;
      pp50.push_back(p["peer_rtt_p50"]);
      pp99.push_back(p["peer_rtt_p99"]);
      psend.push_back(p["peer_send"]);
    }
    const double zmq_p50 = percentile(zp50, 0.5), zmq_p99 = percentile(zp99, 0.5);
    const auto [call_bytes, reply_bytes] = call_sizes();
    const double zmq_pipe = zmq_pipelined(call_bytes, reply_bytes, 5 * calls);
    c["call_rtt_p50"] = percentile(tp50, 0.5);
    c["call_rtt_p99"] = percentile(tp99, 0.5);
    const std::size_t dispatch_mib = quick ? 256 : 1024;
    const double mem = memcpy_gbs(dispatch_mib << 20);

    auto d =
        run_twinkle(twinkle, job, "dispatch", {fmt::format("args.dispatch_mib={}", dispatch_mib)})
            .figures;
    auto first = run_twinkle(twinkle, job, "first_call", {}, "FIRST CALL DONE");
    auto noop = run_twinkle(twinkle, job, "noop", {});
    // The launch figure: 8 workers start, do one 1-float all_reduce and exit; the median of 5,
    // each next to the median of 5 spawn-and-reap rounds of 8 minimal processes.
    const std::string launch_job =
        (std::filesystem::path(job).parent_path() / "bench_launch.toml").string();
    std::vector<double> launch, floor, mpi;
    for (int rep = 0; rep < 5; ++rep) {
      launch.push_back(run_twinkle(twinkle, launch_job, "launch", {}).total_s);
      floor.push_back(spawn_and_reap(8));
      if (const double m = mpirun_allreduce(8, std::filesystem::path(job).parent_path()); m > 0)
        mpi.push_back(m);
    }
    // Both cpu collectives backends, alternating, the median of each.
    const std::string reps = quick ? "args.all_reduce_reps=2" : "args.all_reduce_reps=5";
    std::map<std::string, std::vector<double>> runs;
    for (int rep = 0; rep < 3; ++rep) {
      for (const char* backend : {"gloo", "shm"}) {
        const std::string set = fmt::format("job.collectives={}", backend);
        for (const auto& [k, v] : run_twinkle(twinkle, job, "all_reduce", {reps, set}).figures)
          runs[fmt::format("{}_{}", k, backend)].push_back(v);
        if (rep == 0) {
          for (const auto& [k, v] :
               run_twinkle(twinkle, job, "broadcast", {"args.all_reduce_reps=2", set}).figures)
            runs[fmt::format("{}_{}", k, backend)].push_back(v);
        }
      }
    }
    std::vector<double> sync;
    for (int rep = 0; rep < 3; ++rep) {
      sync.push_back(run_twinkle(twinkle, job, "weight_sync", {"args.all_reduce_reps=2"})
                         .figures["weight_sync_2"]);
    }
    std::map<std::string, double> ar;
    for (const auto& [k, v] : runs) ar[k] = percentile(v, 0.5);

    char host[256] = {};
    gethostname(host, sizeof host - 1);
    fmt::print("twinkle benchmarks on {} ({} CPUs){}\n\n", host, sysconf(_SC_NPROCESSORS_ONLN),
               quick ? ", quick" : "");
    fmt::print("{:<46} {:>14} {:>22} {:>8}\n", "figure", "twinkle", "reference", "ratio");
    auto row = [](const std::string& name, double v, const std::string& unit,
                  const std::string& ref_name, double ref) {
      fmt::print("{:<46} {:>10.4g} {:<3} {:>14} {:>7.4g} {:>7.2f}x\n", name, v, unit, ref_name, ref,
                 ref > 0 ? v / ref : 0.0);
    };
    row("1. call round trip p50, 1 worker (us)*", c["call_rtt_p50"], "", "zmq rtt p50", zmq_p50);
    row("   call round trip p99, 1 worker (us)*", c["call_rtt_p99"], "", "zmq rtt p99", zmq_p99);
    row("   same p50, next to a raw Unix socket pair", c["call_rtt_p50"], "", "unix rtt p50",
        percentile(sp50, 0.5));
    row("2. pipelined calls/s, 1 worker", c["pipelined_1_worker"], "",
        fmt::format("zmq pipe {}/{}B", call_bytes, reply_bytes), zmq_pipe);
    row("   pipelined calls/s, 8 workers", c["pipelined_8_workers"], "", "zmq pipe", zmq_pipe);
    row("3. fan-out to 8 workers, all+sum, p50 (us)", c["fanout_8_p50"], "", "zmq rtt p50",
        zmq_p50);
    row("   same, next to the call round trip", c["fanout_8_p50"], "", "call rtt p50",
        c["call_rtt_p50"]);
    // The floor of that ratio on this machine: 8 echo processes over pipes, next to one.
    row("   raw pipes: fan-out to 8 echo processes (us)", percentile(fan8, 0.5), "", "pipe rtt p50",
        percentile(fan1, 0.5));
    row("   same fan-out, next to the raw pipe fan-out", c["fanout_8_p50"], "", "pipe fan-out",
        percentile(fan8, 0.5));
    row(fmt::format("4. dispatch {} MiB slice_dp to 8 (GB/s)", dispatch_mib),
        d["dispatch_bandwidth"], "", "memcpy GB/s", mem);
    row("5. launch to first call done, 8 workers (s)", first.mark_s, "", "-", 0);
    row("   whole run, no-op driver, 11 workers (s)", noop.total_s, "", "-", 0);
    row("   8 workers start, 1 all_reduce, exit (s)", percentile(launch, 0.5), "", "spawn+reap 8",
        percentile(floor, 0.5));
    if (!mpi.empty()) {
      row("   same, next to OpenMPI mpirun -np 8 (s)", percentile(launch, 0.5), "", "mpirun",
          percentile(mpi, 0.5));
    } else {
      fmt::print("   (mpicc/mpirun not installed: no MPI reference for the launch figure)\n");
    }
    row("6. all_reduce 64 MiB f32, 2 workers, busbw GB/s", ar["all_reduce_busbw_2_shm"], "",
        "Gloo GB/s", ar["all_reduce_busbw_2_gloo"]);
    row("   same, 8 workers", ar["all_reduce_busbw_8_shm"], "", "Gloo GB/s",
        ar["all_reduce_busbw_8_gloo"]);
    row("   same, 2 workers, against memcpy", ar["all_reduce_busbw_2_shm"], "", "memcpy GB/s", mem);
    row("   same, 8 workers, against memcpy", ar["all_reduce_busbw_8_shm"], "", "memcpy GB/s", mem);
    row("7. broadcast 256 MiB f32 to 8 workers, GB/s", ar["broadcast_8_shm"], "", "Gloo GB/s",
        ar["broadcast_8_gloo"]);
    row("   same, against memcpy", ar["broadcast_8_shm"], "", "memcpy GB/s", mem);
    row("8. weight sync 256 MiB, trainer:0 -> 2 samplers, GB/s", percentile(sync, 0.5), "",
        "memcpy GB/s", mem);
    row("9. worker -> peer worker round trip p50 (us)*", percentile(pp50, 0.5), "", "zmq rtt p50",
        zmq_p50);
    row("   worker -> peer worker round trip p99 (us)*", percentile(pp99, 0.5), "", "zmq rtt p99",
        zmq_p99);
    row("   256 MiB f32 worker -> peer worker, GB/s", percentile(psend, 0.5), "", "memcpy GB/s",
        mem);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "twinkle_bench: %s\n", e.what());
    return 1;
  }
}
