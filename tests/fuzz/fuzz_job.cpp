// libFuzzer target: the job-file reader (TOML parse, overrides excluded, validation).
// Any input must end in a Job or a ConfigError: no crash, no other exception, bounded memory.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/job/job.hpp"
#include "twinkle/errors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > twinkle::core::kMaxJobFileBytes) return -1;  // load_job never reads more
  try {
    twinkle::core::parse_job(std::string_view(reinterpret_cast<const char*>(data), size),
                             "/fuzz/job.toml");
  } catch (const twinkle::ConfigError&) {
  }
  return 0;
}
