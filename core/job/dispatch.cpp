#include "core/job/dispatch.hpp"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::core {

using twinkle::DType;
using twinkle::Tensor;
using twinkle::Value;

std::pair<std::int64_t, std::int64_t> balanced_range(std::int64_t len, int n, int i) {
  if (len < 0 || n < 1 || i < 0 || i >= n) {
    throw std::invalid_argument(
        fmt::format("balanced_range: part {} of {} parts of {} items does not exist", i, n, len));
  }
  const std::int64_t base = len / n;
  const std::int64_t extra = len % n;
  const std::int64_t begin = i * base + std::min<std::int64_t>(i, extra);
  return {begin, begin + base + (i < extra ? 1 : 0)};
}

std::vector<int> executing_workers(Execute e, const DeviceMesh& mesh,
                                   std::optional<PeerCaller> caller) {
  const int n = mesh.world_size();
  auto range = [](int begin, int end) {
    std::vector<int> out(static_cast<size_t>(end - begin));
    std::iota(out.begin(), out.end(), begin);
    return out;
  };
  switch (e) {
    case Execute::all: return range(0, n);
    case Execute::first: return {0};
    case Execute::peer: {
      if (!caller) return range(0, n);
      const int w = caller->world_size;
      const int r = caller->rank;
      if (w < 1 || r < 0 || r >= w) {
        throw std::invalid_argument(
            fmt::format("execute peer: caller rank {} is outside a group of {}", r, w));
      }
      // Fewer targets than callers: they take turns (Twinkle's get_peer_index, DESIGN 10b).
      if (n < w) return {r % n};
      const auto [begin, end] = balanced_range(n, w, r);
      return range(static_cast<int>(begin), static_cast<int>(end));
    }
  }
  throw std::invalid_argument(fmt::format("unknown execute mode {}", static_cast<int>(e)));
}

namespace {

// Lists and tensors with a first dimension are cut by slice and slice_dp.
bool cuttable(const Value& v) { return v.is_list() || (v.is_tensor() && v.tensor().ndim() > 0); }

Value cut(const Value& v, int parts, int part) {
  const auto [begin, end] = balanced_range(static_cast<std::int64_t>(v.size()), parts, part);
  if (v.is_tensor()) return Value(v.tensor().slice(begin, end));
  const Value::List& items = v.list_items();
  return Value(Value::List(items.begin() + begin, items.begin() + end));
}

}  // namespace

std::vector<Value> dispatch_args(Dispatch d, const Value& args, const DeviceMesh& mesh,
                                 const std::vector<int>& workers, std::string_view what) {
  if (d == Dispatch::custom) {
    throw std::invalid_argument(
        fmt::format("{}: dispatch custom runs the plugin's dispatcher, not dispatch_args", what));
  }
  if (d != Dispatch::all && d != Dispatch::slice && d != Dispatch::slice_dp) {
    throw std::invalid_argument(fmt::format("unknown dispatch mode {}", static_cast<int>(d)));
  }
  if (!args.is_list() && !args.is_null()) {
    throw std::invalid_argument(
        fmt::format("{}: positional arguments must be a list, not {}", what, args.kind_name()));
  }
  const Value::List no_args;
  const Value::List& list = args.is_null() ? no_args : args.list_items();
  if (d == Dispatch::all) return std::vector<Value>(workers.size(), Value(list));

  // part_of[i] is the part that workers[i] receives.
  std::vector<int> part_of(workers.size());
  int parts = static_cast<int>(workers.size());
  if (d == Dispatch::slice) {
    std::iota(part_of.begin(), part_of.end(), 0);
  } else {
    std::vector<int> data_ranks;
    for (int w : workers) data_ranks.push_back(mesh.data_rank(w));
    std::vector<int> distinct = data_ranks;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    for (size_t i = 0; i < workers.size(); ++i) {
      part_of[i] = static_cast<int>(
          std::lower_bound(distinct.begin(), distinct.end(), data_ranks[i]) - distinct.begin());
    }
    parts = static_cast<int>(distinct.size());
  }
  if (parts == 0) return {};

  auto check_batch = [&](const Value& v, size_t arg, std::string_view key) {
    if (v.size() >= static_cast<size_t>(parts)) return;
    throw twinkle::Error(fmt::format(
        "{}: argument {}{} has {} items but dispatch {} splits it into {} slice{} (one per {}); "
        "pass at least {}",
        what, arg, key.empty() ? "" : fmt::format(" key \"{}\"", key), v.size(), to_string(d),
        parts, parts == 1 ? "" : "s", d == Dispatch::slice ? "worker" : "data rank", parts));
  };

  std::vector<Value::List> sliced(static_cast<size_t>(parts));
  for (size_t a = 0; a < list.size(); ++a) {
    const Value& arg = list[a];
    if (cuttable(arg)) {
      check_batch(arg, a, "");
      for (int p = 0; p < parts; ++p) sliced[p].push_back(cut(arg, parts, p));
    } else if (d == Dispatch::slice_dp && arg.is_map()) {
      std::vector<Value::Map> maps(static_cast<size_t>(parts));
      for (const auto& [key, v] : arg.map_items()) {
        if (cuttable(v)) check_batch(v, a, key);
        for (int p = 0; p < parts; ++p) maps[p].emplace(key, cuttable(v) ? cut(v, parts, p) : v);
      }
      for (int p = 0; p < parts; ++p) sliced[p].push_back(Value(std::move(maps[p])));
    } else {
      for (int p = 0; p < parts; ++p) sliced[p].push_back(arg);
    }
  }

  std::vector<Value> out;
  out.reserve(workers.size());
  for (int p : part_of) out.emplace_back(sliced[p]);
  return out;
}

namespace {

// One worker's result, or a part of it, while results are combined.
struct Item {
  int worker;
  const Value* value;
};

// "a string", "an int", "a float32[2, 3] tensor": what a value is, for error messages.
std::string describe(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::null: return "null";
    case Value::Kind::boolean: return "a bool";
    case Value::Kind::integer: return "an int";
    case Value::Kind::floating: return "a double";
    case Value::Kind::string: return "a string";
    case Value::Kind::bytes: return "bytes";
    case Value::Kind::list: return "a list";
    case Value::Kind::map: return "a map";
    case Value::Kind::tensor: {
      const std::string t = v.tensor().describe();
      return fmt::format("{} {} tensor", t[0] == 'i' ? "an" : "a", t);
    }
  }
  return "an unknown value";
}

// Paths name where in a result a value sits: `key "m"[1]["x"]`, `item [0]`, or "" for the whole
// result.
std::string key_path(const std::string& path, std::string_view key) {
  return path.empty() ? fmt::format("key \"{}\"", key) : fmt::format("{}[\"{}\"]", path, key);
}

std::string index_path(const std::string& path, size_t i) {
  return path.empty() ? fmt::format("item [{}]", i) : fmt::format("{}[{}]", path, i);
}

// `key "x" is a string in the result of worker 1`, or `the result of worker 1 is a string`.
std::string at(const std::string& path, int worker, std::string_view predicate) {
  if (path.empty()) return fmt::format("the result of worker {} {}", worker, predicate);
  return fmt::format("{} {} in the result of worker {}", path, predicate, worker);
}

// `key "x" is a list in the result of worker 1 but a tensor in the result of worker 0`. Both
// predicates start with their verb ("is a list", "has 3 items"), which the second one drops when a
// path leads the sentence.
std::string contrast(const std::string& path, Item a, std::string_view pred_a, Item b,
                     std::string_view pred_b) {
  if (path.empty()) return at(path, a.worker, pred_a) + " but " + at(path, b.worker, pred_b);
  return fmt::format("{} but {} in the result of worker {}", at(path, a.worker, pred_a),
                     pred_b.substr(pred_b.find(' ') + 1), b.worker);
}

// Combines per-worker results for collect mean, sum and flatten; every error names the call, the
// collect mode, the path and the worker.
class Combiner {
 public:
  Combiner(Collect mode, std::string_view what) : mode_(mode), what_(what) {}

  Value reduce(const std::vector<Item>& items, const std::string& path) const {
    for (const Item& it : items) {
      if (category(*it.value) < 0) {
        fail(at(path, it.worker, "is " + describe(*it.value)) + "; " +
             std::string(to_string(mode_)) + " needs numbers or tensors");
      }
    }
    check_same_category(items, path);
    const Value& first = *items[0].value;
    if (first.is_number()) return reduce_numbers(items, path);
    if (first.is_tensor()) return reduce_tensors(items, path);
    if (first.is_map()) {
      Value::Map out;
      for (const std::string& key : keys(items, path)) {
        out.emplace(key, reduce(children(items, key), key_path(path, key)));
      }
      return Value(std::move(out));
    }
    check_same_length(items, path);
    Value::List out;
    for (size_t i = 0; i < first.size(); ++i) {
      std::vector<Item> parts;
      for (const Item& it : items) parts.push_back({it.worker, &it.value->list_items()[i]});
      out.push_back(reduce(parts, index_path(path, i)));
    }
    return Value(std::move(out));
  }

  // Maps are joined per key at the top level only; their values must be lists or tensors.
  Value join(const std::vector<Item>& items, const std::string& path) const {
    for (const Item& it : items) {
      const Value& v = *it.value;
      if (!v.is_list() && !v.is_tensor() && !(path.empty() && v.is_map())) {
        fail(at(path, it.worker, "is " + describe(v)) +
             (path.empty() ? "; flatten needs lists, tensors or maps of them"
                           : "; flatten needs lists or tensors"));
      }
    }
    check_same_category(items, path);
    const Value& first = *items[0].value;
    if (first.is_map()) {
      Value::Map out;
      for (const std::string& key : keys(items, path)) {
        out.emplace(key, join(children(items, key), key_path(path, key)));
      }
      return Value(std::move(out));
    }
    if (first.is_list()) {
      Value::List out;
      for (const Item& it : items) {
        const auto& l = it.value->list_items();
        out.insert(out.end(), l.begin(), l.end());
      }
      return Value(std::move(out));
    }
    std::vector<Tensor> parts;
    for (const Item& it : items) {
      const Tensor& t = it.value->tensor();
      if (t.ndim() == 0) {
        fail(at(path, it.worker, "is " + describe(*it.value)) +
             "; flatten joins tensors along dim 0, so they need at least one dimension");
      }
      const Tensor& t0 = items[0].value->tensor();
      if (t.dtype() != t0.dtype() || t.ndim() != t0.ndim() ||
          !std::equal(t.shape().begin() + 1, t.shape().end(), t0.shape().begin() + 1)) {
        fail(contrast(path, it, "is " + describe(*it.value), items[0],
                      "is " + describe(*items[0].value)) +
             "; flatten needs tensors of one dtype and the same trailing dimensions");
      }
      parts.push_back(t);
    }
    return Value(Tensor::concat(parts));
  }

 private:
  [[noreturn]] void fail(const std::string& message) const {
    throw twinkle::Error(fmt::format("{}: collect {}: {}", what_, to_string(mode_), message));
  }

  // What mean and sum can combine: 0 numbers, 1 tensors, 2 maps, 3 lists; -1 anything else.
  static int category(const Value& v) {
    if (v.is_number()) return 0;
    if (v.is_tensor()) return 1;
    if (v.is_map()) return 2;
    if (v.is_list()) return 3;
    return -1;
  }

  static std::string kind_text(const Value& v) {
    return v.is_number() ? "a number" : v.is_tensor() ? "a tensor" : describe(v);
  }

  void check_same_category(const std::vector<Item>& items, const std::string& path) const {
    for (const Item& it : items) {
      if (category(*it.value) != category(*items[0].value)) {
        fail(contrast(path, it, "is " + kind_text(*it.value), items[0],
                      "is " + kind_text(*items[0].value)));
      }
    }
  }

  void check_same_length(const std::vector<Item>& items, const std::string& path) const {
    for (const Item& it : items) {
      if (it.value->size() != items[0].value->size()) {
        fail(contrast(path, it, fmt::format("has {} items", it.value->size()), items[0],
                      fmt::format("has {} items", items[0].value->size())));
      }
    }
  }

  // The keys of maps that must all have the same keys, sorted.
  std::set<std::string> keys(const std::vector<Item>& items, const std::string& path) const {
    std::set<std::string> all;
    for (const Item& it : items) {
      for (const auto& kv : it.value->map_items()) all.insert(kv.first);
    }
    for (const std::string& key : all) {
      for (const Item& it : items) {
        if (!it.value->contains(key)) {
          fail(fmt::format("{} is missing from the result of worker {}", key_path(path, key),
                           it.worker));
        }
      }
    }
    return all;
  }

  static std::vector<Item> children(const std::vector<Item>& items, const std::string& key) {
    std::vector<Item> out;
    for (const Item& it : items) out.push_back({it.worker, &(*it.value)[key]});
    return out;
  }

  Value reduce_numbers(const std::vector<Item>& items, const std::string& path) const {
    const bool all_ints =
        std::all_of(items.begin(), items.end(), [](const Item& it) { return it.value->is_int(); });
    if (mode_ == Collect::sum && all_ints) {
      std::int64_t total = 0;
      for (const Item& it : items) {
        if (__builtin_add_overflow(total, it.value->as<std::int64_t>(), &total)) {
          fail(fmt::format("the sum of {} overflows int64", path.empty() ? "the results" : path));
        }
      }
      return Value(total);
    }
    double total = 0;
    for (const Item& it : items) total += it.value->as<double>();
    return Value(mode_ == Collect::mean ? total / static_cast<double>(items.size()) : total);
  }

  Value reduce_tensors(const std::vector<Item>& items, const std::string& path) const {
    const Tensor& t0 = items[0].value->tensor();
    for (const Item& it : items) {
      const DType d = it.value->tensor().dtype();
      if (d == DType::boolean || d == DType::f16 || d == DType::bf16) {
        fail(at(path, it.worker, "is " + describe(*it.value)) + "; " +
             std::string(to_string(mode_)) + " needs float32, float64 or integer tensors");
      }
    }
    for (const Item& it : items) {
      const Tensor& t = it.value->tensor();
      if (t.dtype() != t0.dtype() || t.shape() != t0.shape()) {
        fail(contrast(path, it, "is " + describe(*it.value), items[0],
                      "is " + describe(*items[0].value)) +
             "; " + std::string(to_string(mode_)) + " needs tensors of one dtype and shape");
      }
    }
    switch (t0.dtype()) {
      case DType::f32: return Value(reduce_typed<float>(items));
      case DType::f64: return Value(reduce_typed<double>(items));
      case DType::i32: return Value(reduce_typed<std::int32_t>(items));
      case DType::i64: return Value(reduce_typed<std::int64_t>(items));
      case DType::u8: return Value(reduce_typed<std::uint8_t>(items));
      case DType::i8: return Value(reduce_typed<std::int8_t>(items));
      default: break;
    }
    fail(at(path, items[0].worker, "is " + describe(*items[0].value)) + "; unsupported dtype");
  }

  // Floats are accumulated in double and keep their dtype. Integer sums wrap like the integer
  // type does (accumulated modulo 2^64, then narrowed); integer means become float64.
  template <class T>
  Tensor reduce_typed(const std::vector<Item>& items) const {
    const Tensor& t0 = items[0].value->tensor();
    const auto n = static_cast<size_t>(t0.numel());
    const double count = static_cast<double>(items.size());
    if constexpr (std::is_integral_v<T>) {
      if (mode_ == Collect::sum) {
        std::vector<std::uint64_t> acc(n, 0);
        for (const Item& it : items) {
          auto s = it.value->tensor().span<T>();
          for (size_t j = 0; j < n; ++j) {
            acc[j] += static_cast<std::uint64_t>(static_cast<std::int64_t>(s[j]));
          }
        }
        Tensor out(t0.dtype(), t0.shape());
        auto o = out.mutable_span<T>();
        for (size_t j = 0; j < n; ++j) o[j] = static_cast<T>(static_cast<std::int64_t>(acc[j]));
        return out;
      }
    }
    std::vector<double> acc(n, 0.0);
    for (const Item& it : items) {
      auto s = it.value->tensor().span<T>();
      for (size_t j = 0; j < n; ++j) acc[j] += static_cast<double>(s[j]);
    }
    if (mode_ == Collect::mean) {
      for (double& x : acc) x /= count;
    }
    using Out = std::conditional_t<std::is_floating_point_v<T>, T, double>;
    Tensor out(twinkle::dtype_of<Out>(), t0.shape());
    auto o = out.mutable_span<Out>();
    for (size_t j = 0; j < n; ++j) o[j] = static_cast<Out>(acc[j]);
    return out;
  }

  Collect mode_;
  std::string_view what_;
};

}  // namespace

Value collect_results(Collect c, std::vector<Value> results, const DeviceMesh& mesh,
                      const std::vector<int>& workers, std::string_view what) {
  if (c == Collect::custom) {
    throw std::invalid_argument(
        fmt::format("{}: collect custom runs the plugin's collector, not collect_results", what));
  }
  if (results.size() != workers.size()) {
    throw std::invalid_argument(
        fmt::format("{}: {} results from {} workers", what, results.size(), workers.size()));
  }
  if (c == Collect::none) {
    if (results.size() == 1) return std::move(results[0]);
    return Value(std::move(results));
  }
  if (results.empty()) {
    throw twinkle::Error(
        fmt::format("{}: collect {}: no worker returned a result", what, to_string(c)));
  }
  switch (c) {
    case Collect::first: return std::move(results[0]);
    case Collect::mean:
    case Collect::sum: {
      std::vector<Item> items;
      for (size_t i = 0; i < results.size(); ++i) items.push_back({workers[i], &results[i]});
      return Combiner(c, what).reduce(items, "");
    }
    case Collect::last_pp: {
      const int last = mesh.size("pp") - 1;
      Value::List kept;
      for (size_t i = 0; i < results.size(); ++i) {
        if (mesh.coord(workers[i], "pp") == last) kept.push_back(std::move(results[i]));
      }
      if (kept.empty()) {
        throw twinkle::Error(fmt::format(
            "{}: collect last_pp: no executing worker is in the last pipeline stage (pp coordinate "
            "{}); use execute all with collect last_pp",
            what, last));
      }
      if (kept.size() == 1) return std::move(kept[0]);
      return Value(std::move(kept));
    }
    case Collect::flatten: {
      std::map<int, size_t> first_of_rank;  // data rank -> index of its first result
      for (size_t i = 0; i < results.size(); ++i) {
        first_of_rank.emplace(mesh.data_rank(workers[i]), i);
      }
      std::vector<Item> items;
      for (const auto& [rank, i] : first_of_rank) items.push_back({workers[i], &results[i]});
      return Combiner(c, what).join(items, "");
    }
    default: break;
  }
  throw std::invalid_argument(fmt::format("unknown collect mode {}", static_cast<int>(c)));
}

}  // namespace twinkle::core
