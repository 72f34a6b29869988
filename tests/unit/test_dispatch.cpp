#include <catch2/catch.hpp>

#include <algorithm>
#include <tuple>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/exit_codes.hpp"
#include "core/job/dispatch.hpp"
#include "core/job/mesh.hpp"
#include "twinkle/errors.hpp"

using twinkle::DType;
using twinkle::Tensor;
using twinkle::Value;
using twinkle::core::balanced_range;
using twinkle::core::Collect;
using twinkle::core::collect_results;
using twinkle::core::DeviceMesh;
using twinkle::core::Dispatch;
using twinkle::core::dispatch_args;
using twinkle::core::Execute;
using twinkle::core::executing_workers;
using twinkle::core::PeerCaller;
using V = std::vector<int>;
using Values = std::vector<Value>;
using I64 = std::vector<std::int64_t>;

namespace {

DeviceMesh dp2_tp2() { return DeviceMesh({{"dp", 2}, {"tp", 2}}); }
DeviceMesh pp2_dp2() { return DeviceMesh({{"pp", 2}, {"dp", 2}}); }
DeviceMesh dp4() { return DeviceMesh::data_parallel(4); }

Value ints(std::initializer_list<int> items) {
  Value::List l;
  for (int i : items) l.push_back(i);
  return Value(l);
}

// True when `part` points into the bytes of `whole`.
bool inside(const Tensor& part, const Tensor& whole) {
  return part.data() >= whole.data() &&
         part.data() + part.nbytes() <= whole.data() + whole.nbytes();
}

std::string error_text(const std::function<void()>& f) {
  try {
    f();
  } catch (const twinkle::Error& e) {
    CHECK(twinkle::cli::exit_code_for(e) == twinkle::cli::kExitJobFailed);
    return e.what();
  }
  FAIL("no twinkle::Error was thrown");
  return "";
}

}  // namespace

TEST_CASE("names match the job file and plugin table spelling", "[dispatch]") {
  using twinkle::to_string;
  CHECK(to_string(Dispatch::slice_dp) == "slice_dp");
  CHECK(to_string(Dispatch::custom) == "custom");
  CHECK(to_string(Execute::peer) == "peer");
  CHECK(to_string(Collect::last_pp) == "last_pp");
  CHECK(to_string(Collect::flatten) == "flatten");
  CHECK(static_cast<int>(Dispatch::slice_dp) == TWK_DISPATCH_SLICE_DP);
  CHECK(static_cast<int>(Execute::peer) == TWK_EXECUTE_PEER);
  CHECK(static_cast<int>(Collect::custom) == TWK_COLLECT_CUSTOM);
}

TEST_CASE("balanced_range gives the first len % n parts one more", "[dispatch]") {
  using R = std::pair<std::int64_t, std::int64_t>;
  CHECK(balanced_range(10, 4, 0) == R{0, 3});
  CHECK(balanced_range(10, 4, 1) == R{3, 6});
  CHECK(balanced_range(10, 4, 2) == R{6, 8});
  CHECK(balanced_range(10, 4, 3) == R{8, 10});
  CHECK(balanced_range(8, 4, 2) == R{4, 6});
  CHECK(balanced_range(2, 4, 3) == R{2, 2});
  CHECK_THROWS_AS(balanced_range(8, 0, 0), std::invalid_argument);
  CHECK_THROWS_AS(balanced_range(8, 4, 4), std::invalid_argument);
}

TEST_CASE("execute all and first", "[dispatch]") {
  CHECK(executing_workers(Execute::all, dp2_tp2()) == V{0, 1, 2, 3});
  CHECK(executing_workers(Execute::first, dp2_tp2()) == V{0});
  CHECK(executing_workers(Execute::first, dp2_tp2(), PeerCaller{1, 2}) == V{0});
}

TEST_CASE("execute peer: all from the driver, a balanced block from another group", "[dispatch]") {
  const auto m8 = DeviceMesh::data_parallel(8);
  CHECK(executing_workers(Execute::peer, m8) == V{0, 1, 2, 3, 4, 5, 6, 7});
  // n >= w: 8 workers in 2 blocks, and 10 workers in 4 blocks of 3, 3, 2, 2.
  CHECK(executing_workers(Execute::peer, m8, PeerCaller{0, 2}) == V{0, 1, 2, 3});
  CHECK(executing_workers(Execute::peer, m8, PeerCaller{1, 2}) == V{4, 5, 6, 7});
  const auto m10 = DeviceMesh::data_parallel(10);
  CHECK(executing_workers(Execute::peer, m10, PeerCaller{0, 4}) == V{0, 1, 2});
  CHECK(executing_workers(Execute::peer, m10, PeerCaller{1, 4}) == V{3, 4, 5});
  CHECK(executing_workers(Execute::peer, m10, PeerCaller{2, 4}) == V{6, 7});
  CHECK(executing_workers(Execute::peer, m10, PeerCaller{3, 4}) == V{8, 9});
  CHECK(executing_workers(Execute::peer, m8, PeerCaller{5, 8}) == V{5});
  // n < w: caller rank r of w maps to worker r mod n (callers take turns).
  const auto m2 = DeviceMesh::data_parallel(2);
  CHECK(executing_workers(Execute::peer, m2, PeerCaller{0, 4}) == V{0});
  CHECK(executing_workers(Execute::peer, m2, PeerCaller{1, 4}) == V{1});
  CHECK(executing_workers(Execute::peer, m2, PeerCaller{2, 4}) == V{0});
  CHECK(executing_workers(Execute::peer, m2, PeerCaller{3, 4}) == V{1});
  const auto m3 = DeviceMesh::data_parallel(3);
  CHECK(executing_workers(Execute::peer, m3, PeerCaller{4, 5}) == V{1});
  CHECK(executing_workers(Execute::peer, m3, PeerCaller{2, 5}) == V{2});
  CHECK_THROWS_AS(executing_workers(Execute::peer, m2, PeerCaller{4, 4}), std::invalid_argument);
  CHECK_THROWS_AS(executing_workers(Execute::peer, m2, PeerCaller{0, 0}), std::invalid_argument);
}

TEST_CASE("execute peer: the blocks of Twinkle's get_peer_index, and what they receive",
          "[dispatch]") {
  // (callers m, targets n) -> the target workers of each caller rank.
  const std::vector<std::tuple<int, int, std::vector<V>>> table = {
      {1, 4, {{0, 1, 2, 3}}},
      {2, 4, {{0, 1}, {2, 3}}},
      {4, 4, {{0}, {1}, {2}, {3}}},
      {4, 2, {{0}, {1}, {0}, {1}}},
      {3, 4, {{0, 1}, {2}, {3}}},
      {4, 3, {{0}, {1}, {2}, {0}}},
      {3, 8, {{0, 1, 2}, {3, 4, 5}, {6, 7}}},
      {8, 3, {{0}, {1}, {2}, {0}, {1}, {2}, {0}, {1}}},
  };
  std::vector<Value> items;
  for (int i = 0; i < 12; ++i) items.push_back(i);
  const Value args = Value::list({Value(items)});
  for (const auto& [m, n, blocks] : table) {
    const auto mesh = DeviceMesh::data_parallel(n);
    for (int r = 0; r < m; ++r) {
      INFO("callers " << m << ", targets " << n << ", caller rank " << r);
      const V block = executing_workers(Execute::peer, mesh, PeerCaller{r, m});
      CHECK(block == blocks[static_cast<std::size_t>(r)]);
      // all: every worker of the block gets the whole arguments.
      for (const auto& a : dispatch_args(Dispatch::all, args, mesh, block, "T.f")) CHECK(a == args);
      // slice and slice_dp (one data rank per worker here): the block's workers share the list
      // in order, in parts that differ by at most one item.
      for (Dispatch d : {Dispatch::slice, Dispatch::slice_dp}) {
        const auto parts = dispatch_args(d, args, mesh, block, "T.f");
        REQUIRE(parts.size() == block.size());
        std::vector<int> joined;
        std::size_t smallest = 12, largest = 0;
        for (const auto& p : parts) {
          const auto got = p[0].as<std::vector<int>>();
          joined.insert(joined.end(), got.begin(), got.end());
          smallest = std::min(smallest, got.size());
          largest = std::max(largest, got.size());
        }
        CHECK(joined == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
        CHECK(largest - smallest <= 1);
      }
    }
  }
}

TEST_CASE("dispatch all gives every worker the same arguments", "[dispatch]") {
  const Value args = Value::list({ints({1, 2, 3}), "lr", Value::map({{"x", ints({1, 2})}})});
  const auto out = dispatch_args(Dispatch::all, args, dp2_tp2(), {0, 1, 2, 3}, "Model.f");
  REQUIRE(out.size() == 4);
  for (const auto& a : out) CHECK(a == args);
  // No arguments at all is an empty list for each worker.
  CHECK(dispatch_args(Dispatch::all, Value(), dp4(), {0, 1}, "f") ==
        Values{Value::list(), Value::list()});
}

TEST_CASE("dispatch slice cuts lists by worker position, others whole", "[dispatch]") {
  const Value batch = ints({0, 1, 2, 3, 4, 5, 6, 7});
  const Value cfg = Value::map({{"x", ints({1, 2, 3, 4})}});
  const Value args = Value::list({batch, 0.5, cfg, "name"});
  const auto out = dispatch_args(Dispatch::slice, args, dp4(), {0, 1, 2, 3}, "Model.f");
  REQUIRE(out.size() == 4);
  CHECK(out[0] == Value::list({ints({0, 1}), 0.5, cfg, "name"}));
  CHECK(out[1] == Value::list({ints({2, 3}), 0.5, cfg, "name"}));
  CHECK(out[2] == Value::list({ints({4, 5}), 0.5, cfg, "name"}));
  CHECK(out[3] == Value::list({ints({6, 7}), 0.5, cfg, "name"}));
}

TEST_CASE("dispatch slice balances uneven lists: the first len % n get one more", "[dispatch]") {
  const Value args = Value::list({ints({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}), ints({7, 8, 9, 10, 11})});
  const auto out = dispatch_args(Dispatch::slice, args, dp4(), {0, 1, 2, 3}, "Model.f");
  REQUIRE(out.size() == 4);
  CHECK(out[0] == Value::list({ints({0, 1, 2}), ints({7, 8})}));
  CHECK(out[1] == Value::list({ints({3, 4, 5}), ints({9})}));
  CHECK(out[2] == Value::list({ints({6, 7}), ints({10})}));
  CHECK(out[3] == Value::list({ints({8, 9}), ints({11})}));
}

TEST_CASE("dispatch slice cuts tensors along dim 0 sharing storage", "[dispatch]") {
  // 5 rows of 2: rows 0-1, 2-3 and 4 for three workers.
  const Tensor t = Tensor::from<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {5, 2});
  const auto out = dispatch_args(Dispatch::slice, Value::list({t}), dp4(), {1, 2, 3}, "Model.f");
  REQUIRE(out.size() == 3);
  const Tensor& a = out[0][0].tensor();
  const Tensor& b = out[1][0].tensor();
  const Tensor& c = out[2][0].tensor();
  CHECK(a.shape() == I64{2, 2});
  CHECK(b.shape() == I64{2, 2});
  CHECK(c.shape() == I64{1, 2});
  CHECK(a.to_vector<float>() == std::vector<float>{0, 1, 2, 3});
  CHECK(b.to_vector<float>() == std::vector<float>{4, 5, 6, 7});
  CHECK(c.to_vector<float>() == std::vector<float>{8, 9});
  CHECK(a.data() == t.data());
  CHECK(b.data() == t.data() + 4 * sizeof(float));
  CHECK(inside(a, t));
  CHECK(inside(b, t));
  CHECK(inside(c, t));
}

TEST_CASE("dispatch slice_dp: tp peers get identical slices", "[dispatch]") {
  // dp=2 x tp=2: workers 0,1 are data rank 0 and workers 2,3 data rank 1.
  const Tensor t = Tensor::from<std::int64_t>({10, 11, 12, 13, 14});
  const Value args = Value::list({ints({0, 1, 2, 3, 4}), t, 3});
  const auto out = dispatch_args(Dispatch::slice_dp, args, dp2_tp2(), {0, 1, 2, 3}, "Model.f");
  REQUIRE(out.size() == 4);
  CHECK(out[0] == out[1]);
  CHECK(out[2] == out[3]);
  CHECK(out[0] == Value::list({ints({0, 1, 2}), Tensor::from<std::int64_t>({10, 11, 12}), 3}));
  CHECK(out[2] == Value::list({ints({3, 4}), Tensor::from<std::int64_t>({13, 14}), 3}));
  CHECK(out[0][1].tensor().data() == t.data());
  CHECK(out[1][1].tensor().data() == t.data());
  CHECK(out[2][1].tensor().data() == t.data() + 3 * sizeof(std::int64_t));
  CHECK(inside(out[3][1].tensor(), t));
}

TEST_CASE("dispatch slice_dp follows the data rank, not the worker index", "[dispatch]") {
  // pp=2 x dp=2: data ranks 0,1,0,1, so pp peers 0 and 2 share a slice.
  const auto out = dispatch_args(Dispatch::slice_dp, Value::list({ints({1, 2, 3, 4})}), pp2_dp2(),
                                 {0, 1, 2, 3}, "Model.f");
  REQUIRE(out.size() == 4);
  CHECK(out[0] == Value::list({ints({1, 2})}));
  CHECK(out[1] == Value::list({ints({3, 4})}));
  CHECK(out[2] == Value::list({ints({1, 2})}));
  CHECK(out[3] == Value::list({ints({3, 4})}));
  // A subset of workers with a single data rank gets the whole batch.
  const auto one = dispatch_args(Dispatch::slice_dp, Value::list({ints({1, 2, 3, 4})}), dp2_tp2(),
                                 {2, 3}, "Model.f");
  CHECK(one == Values{Value::list({ints({1, 2, 3, 4})}), Value::list({ints({1, 2, 3, 4})})});
}

TEST_CASE("maps are sliced per key under slice_dp and passed whole under slice", "[dispatch]") {
  const Tensor ids = Tensor::from<std::int32_t>({1, 2, 3, 4, 5, 6}, {3, 2});
  const Value batch = Value::map({{"input_ids", ids}, {"labels", ints({7, 8, 9})}, {"lr", 0.1}});
  const Value args = Value::list({batch});

  const auto dp = dispatch_args(Dispatch::slice_dp, args, dp2_tp2(), {0, 1, 2, 3}, "Model.f");
  REQUIRE(dp.size() == 4);
  const Value first = Value::map({{"input_ids", Tensor::from<std::int32_t>({1, 2, 3, 4}, {2, 2})},
                                  {"labels", ints({7, 8})},
                                  {"lr", 0.1}});
  const Value second = Value::map({{"input_ids", Tensor::from<std::int32_t>({5, 6}, {1, 2})},
                                   {"labels", ints({9})},
                                   {"lr", 0.1}});
  CHECK(dp[0] == Value::list({first}));
  CHECK(dp[1] == Value::list({first}));
  CHECK(dp[2] == Value::list({second}));
  CHECK(dp[3] == Value::list({second}));
  CHECK(inside(dp[2][0]["input_ids"].tensor(), ids));

  const auto whole = dispatch_args(Dispatch::slice, args, dp2_tp2(), {0, 1, 2, 3}, "Model.f");
  for (const auto& a : whole) CHECK(a == args);
}

TEST_CASE("a batch smaller than the number of slices names the minimum", "[dispatch]") {
  CHECK(error_text([] {
          dispatch_args(Dispatch::slice_dp, Value::list({ints({1, 2, 3})}), dp4(), {0, 1, 2, 3},
                        "Model.train_step");
        }) ==
        "Model.train_step: argument 0 has 3 items but dispatch slice_dp splits it into 4 slices "
        "(one per data rank); pass at least 4");
  CHECK(error_text([] {
          dispatch_args(Dispatch::slice, Value::list({1, Tensor::from<float>({1, 2, 3})}), dp4(),
                        {0, 1, 2, 3}, "Model.train_step");
        }) ==
        "Model.train_step: argument 1 has 3 items but dispatch slice splits it into 4 slices "
        "(one per worker); pass at least 4");
  // tp peers share a data rank, so dp=2 x tp=2 needs only 2.
  CHECK(error_text([] {
          dispatch_args(Dispatch::slice_dp, Value::list({Value::map({{"x", ints({1})}})}),
                        dp2_tp2(), {0, 1, 2, 3}, "Model.train_step");
        }) ==
        "Model.train_step: argument 0 key \"x\" has 1 items but dispatch slice_dp splits it into "
        "2 slices (one per data rank); pass at least 2");
  CHECK(dispatch_args(Dispatch::slice_dp, Value::list({ints({1, 2})}), dp2_tp2(), {0, 1, 2, 3}, "f")
            .size() == 4);
}

TEST_CASE("dispatch custom is the plugin's job", "[dispatch]") {
  CHECK_THROWS_AS(dispatch_args(Dispatch::custom, Value::list(), dp4(), {0}, "f"),
                  std::invalid_argument);
  CHECK_THROWS_AS(dispatch_args(Dispatch::all, Value(3), dp4(), {0}, "f"), std::invalid_argument);
}

TEST_CASE("collect none: the list of results, a single one unwrapped", "[collect]") {
  CHECK(collect_results(Collect::none, {1, "a", 3.5}, dp4(), {0, 1, 2}, "f") ==
        Value::list({1, "a", 3.5}));
  CHECK(collect_results(Collect::none, {ints({1, 2})}, dp4(), {3}, "f") == ints({1, 2}));
}

TEST_CASE("collect first: worker 0's result", "[collect]") {
  CHECK(collect_results(Collect::first, {"zero", "one"}, dp4(), {0, 1}, "f") == Value("zero"));
}

TEST_CASE("collect mean and sum over numbers", "[collect]") {
  const V w = {0, 1, 2, 3};
  const Value s = collect_results(Collect::sum, {1, 2, 3, 4}, dp4(), w, "f");
  CHECK(s.is_int());
  CHECK(s == Value(10));
  const Value m = collect_results(Collect::mean, {1, 2, 3, 4}, dp4(), w, "f");
  CHECK(m.is_double());
  CHECK(m == Value(2.5));
  CHECK(collect_results(Collect::sum, {0.5, 1.25, 2.0, 0.25}, dp4(), w, "f") == Value(4.0));
  CHECK(collect_results(Collect::mean, {0.5, 1.5, 2.0, 4.0}, dp4(), w, "f") == Value(2.0));
  // An int and a double sum to a double.
  CHECK(collect_results(Collect::sum, {1, 0.5}, dp4(), {0, 1}, "f") == Value(1.5));
}

TEST_CASE("collect mean and sum over tensors, elementwise", "[collect]") {
  const V w = {0, 1};
  const Values f32 = {Tensor::from<float>({1, 2, 3, 4}, {2, 2}),
                      Tensor::from<float>({3, 6, 5, 0}, {2, 2})};
  CHECK(collect_results(Collect::sum, f32, dp4(), w, "f") ==
        Value(Tensor::from<float>({4, 8, 8, 4}, {2, 2})));
  CHECK(collect_results(Collect::mean, f32, dp4(), w, "f") ==
        Value(Tensor::from<float>({2, 4, 4, 2}, {2, 2})));

  const Values i64 = {Tensor::from<std::int64_t>({1, 2, 3}), Tensor::from<std::int64_t>({2, 2, 4})};
  CHECK(collect_results(Collect::sum, i64, dp4(), w, "f") ==
        Value(Tensor::from<std::int64_t>({3, 4, 7})));
  const Value m = collect_results(Collect::mean, i64, dp4(), w, "f");
  CHECK(m.tensor().dtype() == DType::f64);
  CHECK(m == Value(Tensor::from<double>({1.5, 2.0, 3.5})));
}

TEST_CASE("collect mean over maps per key, lists per position, nested", "[collect]") {
  const V w = {0, 1};
  const Values maps = {Value::map({{"loss", 1.0}, {"n", 4}}),
                       Value::map({{"loss", 3.0}, {"n", 6}})};
  CHECK(collect_results(Collect::mean, maps, dp4(), w, "f") ==
        Value::map({{"loss", 2.0}, {"n", 5.0}}));
  CHECK(collect_results(Collect::sum, maps, dp4(), w, "f") ==
        Value::map({{"loss", 4.0}, {"n", 10}}));
  CHECK(collect_results(Collect::sum, {ints({1, 2}), ints({10, 20})}, dp4(), w, "f") ==
        ints({11, 22}));
  const Values nested = {Value::map({{"m", Value::list({1, Tensor::from<double>({1.0, 2.0})})}}),
                         Value::map({{"m", Value::list({3, Tensor::from<double>({3.0, 6.0})})}})};
  CHECK(collect_results(Collect::mean, nested, dp4(), w, "f") ==
        Value::map({{"m", Value::list({2.0, Tensor::from<double>({2.0, 4.0})})}}));
}

TEST_CASE("collect mean and sum errors name the key and the worker", "[collect]") {
  const V w = {0, 1, 2};
  CHECK(error_text([&] {
          collect_results(Collect::mean,
                          {Value::map({{"loss", 1.0}}), Value::map({{"loss", "nan"}}),
                           Value::map({{"loss", 2.0}})},
                          dp4(), w, "Model.step");
        }) ==
        "Model.step: collect mean: key \"loss\" is a string in the result of worker 1; mean "
        "needs numbers or tensors");
  CHECK(error_text([&] {
          collect_results(Collect::mean,
                          {Value::map({{"acc", 1.0}, {"loss", 1.0}}),
                           Value::map({{"acc", 1.0}, {"loss", 1.0}}), Value::map({{"loss", 1.0}})},
                          dp4(), w, "Model.step");
        }) == "Model.step: collect mean: key \"acc\" is missing from the result of worker 2");
  CHECK(error_text([&] {
          collect_results(Collect::sum,
                          {Value::map({{"m", Value::list({1, 2})}}),
                           Value::map({{"m", Value::list({1, true})}}),
                           Value::map({{"m", Value::list({1, 2})}})},
                          dp4(), w, "Model.step");
        }) ==
        "Model.step: collect sum: key \"m\"[1] is a bool in the result of worker 1; sum needs "
        "numbers or tensors");
  CHECK(error_text([] {
          collect_results(Collect::sum, {1, Value()}, dp4(), {0, 3}, "Model.step");
        }) ==
        "Model.step: collect sum: the result of worker 3 is null; sum needs numbers or tensors");
  CHECK(error_text([] {
          collect_results(Collect::mean,
                          {Value::map({{"g", 1}}), Value::map({{"g", Tensor::from<float>({1})}})},
                          dp4(), {0, 1}, "Model.step");
        }) ==
        "Model.step: collect mean: key \"g\" is a tensor in the result of worker 1 but a number in "
        "the result of worker 0");
  CHECK(error_text([] {
          collect_results(Collect::mean, {ints({1, 2}), ints({1, 2, 3})}, dp4(), {0, 1},
                          "Model.step");
        }) ==
        "Model.step: collect mean: the result of worker 1 has 3 items but the result of worker 0 "
        "has 2 items");
  CHECK(error_text([] {
          collect_results(Collect::sum,
                          {Tensor::from<float>({1, 2}), Tensor::from<float>({1, 2, 3})}, dp4(),
                          {0, 1}, "Model.step");
        }) ==
        "Model.step: collect sum: the result of worker 1 is a float32[3] tensor but the result of "
        "worker 0 is a float32[2] tensor; sum needs tensors of one dtype and shape");
  CHECK(error_text([] {
          collect_results(Collect::mean,
                          {Value::map({{"x", Tensor::from<bool>({true})}}),
                           Value::map({{"x", Tensor::from<bool>({false})}})},
                          dp4(), {0, 1}, "Model.step");
        }) ==
        "Model.step: collect mean: key \"x\" is a bool[1] tensor in the result of worker 0; mean "
        "needs float32, float64 or integer tensors");
}

TEST_CASE("collect last_pp: the results of the last pipeline stage", "[collect]") {
  // pp=2 x dp=2: workers 2 and 3 are the last stage.
  CHECK(collect_results(Collect::last_pp, {"a", "b", "c", "d"}, pp2_dp2(), {0, 1, 2, 3}, "f") ==
        Value::list({"c", "d"}));
  CHECK(collect_results(Collect::last_pp, {"a", "c"}, pp2_dp2(), {0, 2}, "f") == Value("c"));
  // Without pp every worker is in the last stage.
  CHECK(collect_results(Collect::last_pp, {1, 2}, dp2_tp2(), {0, 1}, "f") == Value::list({1, 2}));
  CHECK(error_text([] { collect_results(Collect::last_pp, {1}, pp2_dp2(), {0}, "Model.eval"); }) ==
        "Model.eval: collect last_pp: no executing worker is in the last pipeline stage (pp "
        "coordinate 1); use execute all with collect last_pp");
}

TEST_CASE("collect flatten: one result per data rank, in data-rank order", "[collect]") {
  // dp=2 x tp=2: workers 0,1 hold data rank 0, workers 2,3 data rank 1; tp peers' copies drop.
  const auto m = dp2_tp2();
  CHECK(collect_results(Collect::flatten, {ints({1, 2}), ints({1, 2}), ints({3}), ints({3})}, m,
                        {0, 1, 2, 3}, "f") == ints({1, 2, 3}));
  // Data-rank order, not the order of `workers`.
  CHECK(collect_results(Collect::flatten, {ints({3}), ints({1, 2})}, m, {3, 1}, "f") ==
        ints({1, 2, 3}));

  const Values tensors = {Tensor::from<float>({1, 2}, {1, 2}), Tensor::from<float>({9, 9}, {1, 2}),
                          Tensor::from<float>({3, 4, 5, 6}, {2, 2}),
                          Tensor::from<float>({9, 9, 9, 9}, {2, 2})};
  CHECK(collect_results(Collect::flatten, tensors, m, {0, 1, 2, 3}, "f") ==
        Value(Tensor::from<float>({1, 2, 3, 4, 5, 6}, {3, 2})));

  const Values maps = {Value::map({{"ids", ints({1})}, {"y", Tensor::from<std::int64_t>({5})}}),
                       Value::map({{"ids", ints({1})}, {"y", Tensor::from<std::int64_t>({5})}}),
                       Value::map({{"ids", ints({2})}, {"y", Tensor::from<std::int64_t>({6, 7})}}),
                       Value::map({{"ids", ints({2})}, {"y", Tensor::from<std::int64_t>({6, 7})}})};
  CHECK(collect_results(Collect::flatten, maps, m, {0, 1, 2, 3}, "f") ==
        Value::map({{"ids", ints({1, 2})}, {"y", Tensor::from<std::int64_t>({5, 6, 7})}}));
}

TEST_CASE("collect flatten errors name the worker", "[collect]") {
  const auto m = dp2_tp2();
  CHECK(error_text([&] {
          collect_results(Collect::flatten, {ints({1}), ints({1}), 2, 2}, m, {0, 1, 2, 3},
                          "Model.predict");
        }) ==
        "Model.predict: collect flatten: the result of worker 2 is an int; flatten needs lists, "
        "tensors or maps of them");
  CHECK(error_text([&] {
          collect_results(Collect::flatten, {ints({1}), Tensor::from<float>({2})}, m, {0, 2},
                          "Model.predict");
        }) ==
        "Model.predict: collect flatten: the result of worker 2 is a tensor but the result of "
        "worker 0 is a list");
  CHECK(error_text([&] {
          collect_results(
              Collect::flatten,
              {Tensor::from<float>({1, 2}, {1, 2}), Tensor::from<float>({1, 2, 3}, {1, 3})}, m,
              {0, 2}, "Model.predict");
        }) ==
        "Model.predict: collect flatten: the result of worker 2 is a float32[1, 3] tensor but the "
        "result of worker 0 is a float32[1, 2] tensor; flatten needs tensors of one dtype and the "
        "same trailing dimensions");
  CHECK(error_text([&] {
          collect_results(Collect::flatten,
                          {Value::map({{"x", ints({1})}}), Value::map({{"x", "s"}})}, m, {0, 2},
                          "Model.predict");
        }) ==
        "Model.predict: collect flatten: key \"x\" is a string in the result of worker 2; flatten "
        "needs lists or tensors");
}

TEST_CASE("collect custom is the plugin's job", "[collect]") {
  CHECK_THROWS_AS(collect_results(Collect::custom, {1}, dp4(), {0}, "f"), std::invalid_argument);
  CHECK_THROWS_AS(collect_results(Collect::sum, {1, 2}, dp4(), {0}, "f"), std::invalid_argument);
}
