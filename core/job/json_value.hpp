#pragma once

#include <nlohmann/json.hpp>

#include "twinkle/value.hpp"

namespace twinkle::core {

// A Value as JSON: the --json output of commands that show what the head sent, and the
// dashboard's API.
inline nlohmann::json to_json(const Value& v) {
  if (v.is_map()) {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [k, x] : v.map_items()) j[k] = to_json(x);
    return j;
  }
  if (v.is_list()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& x : v.list_items()) j.push_back(to_json(x));
    return j;
  }
  if (v.is_string()) return v.as<std::string>();
  if (v.is_bool()) return v.as<bool>();
  if (v.is_int()) return v.as<std::int64_t>();
  if (v.is_double()) return v.as<double>();
  return nullptr;
}

}  // namespace twinkle::core
