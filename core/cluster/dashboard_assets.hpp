#pragma once

#include <string_view>
#include <vector>

// The dashboard's page files (core/cluster/dashboard/), embedded at build time by
// core/cluster/dashboard/embed.py.
namespace twinkle::core::cluster {

struct DashboardAsset {
  std::string_view path;  // "/index.html"
  std::string_view type;  // its Content-Type
  std::string_view body;
};

const std::vector<DashboardAsset>& dashboard_assets();

}  // namespace twinkle::core::cluster
