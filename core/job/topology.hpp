#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/job/placement.hpp"

namespace twinkle::core {

struct TopologyStyle {
  bool ascii = false;  // plain ASCII instead of box-drawing characters
};

// The device placement diagram (docs/ARCHITECTURE.md, Topology): a title box, a one-line summary,
// then one box per group with its device type, ranks, placement (host and physical GPU of each
// worker) and mesh (dimensions, parallelism, shape for more than 2 dims, layout grid capped at 6
// rows x 10 columns). Every line is at most 80 columns wide.
std::string render_topology(const Job& job, const Placement& placement, TopologyStyle style = {});

// The same facts for scripts (`twinkle topology --json`).
nlohmann::json topology_json(const Job& job, const Placement& placement);

// "[0, 1, 2, 3]", or "[0, 1, 2, 3, 4, 5] ... [61, 62, 63] (64 total)" past 16 ranks.
std::string format_rank_list(const std::vector<int>& ranks);

// Display width of UTF-8 text whose characters are all one column wide (box drawing included).
size_t display_width(std::string_view utf8);

}  // namespace twinkle::core
