// `meson test --benchmark`: writing and reading a checkpoint part next to the same bytes written
// by `dd ... conv=fsync` into the same folder and read back with `cat`, measured in the same run,
// as ratios. Usage: twinkle_bench_checkpoint FOLDER [MiB]
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/runtime/checkpoint.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace ck = twinkle::core::checkpoint;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double shell(const std::string& cmd) {
  const auto t0 = Clock::now();
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("failed: " + cmd);
  return seconds_since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FOLDER [MiB]\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir = std::filesystem::path(argv[1]) / "bench-checkpoint";
  const std::size_t mib = argc > 2 ? std::stoul(argv[2]) : 1024;
  try {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    // One state of `mib` MiB of float32, as a plugin's save would give it.
    twinkle::Tensor t(twinkle::DType::f32, {static_cast<std::int64_t>(mib << 18)});
    auto span = t.mutable_span<float>();
    for (std::size_t i = 0; i < span.size(); i += 1024) span[i] = static_cast<float>(i);
    twinkle::EncodedValue state = twinkle::encode(twinkle::Value::map({{"w", t}}));

    double write_s = 1e9, read_s = 1e9, dd_s = 1e9, cat_s = 1e9;
    for (int rep = 0; rep < 2; ++rep) {
      const auto part = dir / fmt::format("p{}.part", rep);
      const auto ref = dir / fmt::format("dd{}", rep);
      dd_s = std::min(dd_s, shell(fmt::format("dd if=/dev/zero of='{}' bs=1M count={} conv=fsync "
                                              "status=none",
                                              ref.string(), mib)));
      auto t0 = Clock::now();
      ck::PartWriter w(part, 1, 0);
      w.add("driver/Model/0", "Model", *state.view());
      const auto written = w.finish();
      write_s = std::min(write_s, seconds_since(t0));
      // Reading: the reference reads the file from the page cache as the part reader does.
      cat_s = std::min(cat_s, shell(fmt::format("cat '{}' >/dev/null", ref.string())));
      t0 = Clock::now();
      ck::Part p = ck::Part::read(part, written.sha256);
      read_s = std::min(read_s, seconds_since(t0));
      if (p.size() != 1) throw std::runtime_error("the part did not read back");
      std::filesystem::remove(part);
      std::filesystem::remove(ref);
    }
    std::filesystem::remove_all(dir);
    const double gib = static_cast<double>(mib) / 1024;
    std::printf("checkpoint part of %zu MiB, best of 2, in %s\n", mib, argv[1]);
    std::printf("  write + fsync: %.3f s (%.2f GiB/s); dd conv=fsync %.3f s: %.2fx dd's time\n",
                write_s, gib / write_s, dd_s, write_s / dd_s);
    std::printf("  read + sha256: %.3f s (%.2f GiB/s); cat %.3f s: %.2fx cat's time\n", read_s,
                gib / read_s, cat_s, read_s / cat_s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_checkpoint: %s\n", e.what());
    std::filesystem::remove_all(dir);
    return 1;
  }
  return 0;
}
