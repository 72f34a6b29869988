#include "core/runtime/notify.hpp"

#include <cstdio>

#include "transports/module.hpp"

namespace twinkle::core {

namespace {
constexpr const char* kModule = "libtwinkle_notify.so";
}  // namespace

void notify_failure(const NotifySpec& notify, const std::string& job, const std::string& run_id,
                    const std::string& error) {
  try {
    using Fn = void (*)(const NotifySpec*, const char*, const char*, const char*);
    auto fn = reinterpret_cast<Fn>(transport::module_symbol(kModule, "twinkle_notify_failure_v1"));
    fn(&notify, job.c_str(), run_id.c_str(), error.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "twinkle: warning: failure notification to %s not sent: %s\n",
                 notify.webhook.c_str(), e.what());
  }
}

std::string dingtalk_sign(const std::string& secret, long long timestamp_ms) {
  using Fn = void (*)(const std::string*, long long, std::string*);
  auto fn = reinterpret_cast<Fn>(transport::module_symbol(kModule, "twinkle_dingtalk_sign_v1"));
  std::string out;
  fn(&secret, timestamp_ms, &out);
  return out;
}

}  // namespace twinkle::core
