// Test data and helpers shared by the unit tests: one copy, so that a change to what a "machine",
// "the three-group job" or a scratch folder is reaches every test that uses it.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

#include <catch2/catch.hpp>

#include "core/job/resources.hpp"

namespace twinkle::test {

// One node named "node-a" with 16 CPUs and `gpus` H200s (indices 0..gpus-1, found by nvml).
inline core::NodeResources machine(int gpus) {
  core::NodeResources r;
  r.hostname = "node-a";
  r.cpus = 16;
  for (int i = 0; i < gpus; ++i)
    r.gpus.push_back(core::GpuInfo{i, "NVIDIA H200", 141ull << 30, ""});
  r.gpu_source = gpus ? core::GpuSource::nvml : core::GpuSource::none;
  return r;
}

// An RLHF-like job: model (4 cuda workers, dp=2 x tp=2), sampler (2 cuda), processor (2 cpu).
// The [[group]] tables start on lines 4, 9 and 13.
inline constexpr const char* kThreeGroups = R"([job]
name = "rlhf"
plugin = "librlhf.so"
[[group]]
name = "model"
ranks = 4
device = "cuda"
mesh = { dp = 2, tp = 2 }
[[group]]
name = "sampler"
ranks = 2
device = "cuda"
[[group]]
name = "processor"
ranks = 2
device = "cpu"
)";

// A fresh folder under /tmp (short enough for socket paths), removed with everything in it at the
// end of the scope, whether the test passed or not.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string templ = "/tmp/twk-test.XXXXXX";
    REQUIRE(::mkdtemp(templ.data()));
    path = templ;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

}  // namespace twinkle::test
