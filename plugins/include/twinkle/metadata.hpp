// The metadata on every remote method (twinkle-plugin(7), DISPATCH, EXECUTE, COLLECT) as C++ enums,
// shared by the loader, the transports and the runtime. Their values are the C constants of
// <twinkle/plugin.h>, checked at compile time, so a value read from a plugin table converts with a
// static_cast after a range check.
#pragma once

#include <string_view>

#include "twinkle/plugin.h"

namespace twinkle {

enum class Dispatch { all = 0, slice = 1, slice_dp = 2, custom = 3 };
enum class Execute { all = 0, first = 1, peer = 2 };
enum class Collect { none = 0, mean = 1, sum = 2, first = 3, last_pp = 4, flatten = 5, custom = 6 };

static_assert(static_cast<int>(Dispatch::all) == TWK_DISPATCH_ALL);
static_assert(static_cast<int>(Dispatch::slice) == TWK_DISPATCH_SLICE);
static_assert(static_cast<int>(Dispatch::slice_dp) == TWK_DISPATCH_SLICE_DP);
static_assert(static_cast<int>(Dispatch::custom) == TWK_DISPATCH_CUSTOM);
static_assert(static_cast<int>(Execute::all) == TWK_EXECUTE_ALL);
static_assert(static_cast<int>(Execute::first) == TWK_EXECUTE_FIRST);
static_assert(static_cast<int>(Execute::peer) == TWK_EXECUTE_PEER);
static_assert(static_cast<int>(Collect::none) == TWK_COLLECT_NONE);
static_assert(static_cast<int>(Collect::mean) == TWK_COLLECT_MEAN);
static_assert(static_cast<int>(Collect::sum) == TWK_COLLECT_SUM);
static_assert(static_cast<int>(Collect::first) == TWK_COLLECT_FIRST);
static_assert(static_cast<int>(Collect::last_pp) == TWK_COLLECT_LAST_PP);
static_assert(static_cast<int>(Collect::flatten) == TWK_COLLECT_FLATTEN);
static_assert(static_cast<int>(Collect::custom) == TWK_COLLECT_CUSTOM);

// The names used in job files, plugin tables, messages and `twinkle inspect`.
constexpr std::string_view to_string(Dispatch d) {
  switch (d) {
    case Dispatch::all: return "all";
    case Dispatch::slice: return "slice";
    case Dispatch::slice_dp: return "slice_dp";
    case Dispatch::custom: return "custom";
  }
  return "?";
}

constexpr std::string_view to_string(Execute e) {
  switch (e) {
    case Execute::all: return "all";
    case Execute::first: return "first";
    case Execute::peer: return "peer";
  }
  return "?";
}

constexpr std::string_view to_string(Collect c) {
  switch (c) {
    case Collect::none: return "none";
    case Collect::mean: return "mean";
    case Collect::sum: return "sum";
    case Collect::first: return "first";
    case Collect::last_pp: return "last_pp";
    case Collect::flatten: return "flatten";
    case Collect::custom: return "custom";
  }
  return "?";
}

}  // namespace twinkle
