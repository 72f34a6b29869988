#include "core/cluster/dashboard.hpp"

#include "transports/module.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::core::cluster {

std::unique_ptr<Dashboard> open_dashboard(DashboardOptions options, HeadAsk ask) {
  static const auto open = reinterpret_cast<DashboardOpen>(
      transport::module_symbol("libtwinkle_dashboard.so", "twinkle_dashboard_open_v1"));
  Dashboard* out = nullptr;
  std::string error;
  switch (open(&options, &ask, &out, &error)) {
    case 0: return std::unique_ptr<Dashboard>(out);
    case 1: throw ConfigError(error);
    case 2: throw TransportError(error);
    default: throw Error(error);
  }
}

}  // namespace twinkle::core::cluster
