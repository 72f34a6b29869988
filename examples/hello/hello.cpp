// The hello example: every dispatch, execute and collect mode on two groups, with each rank
// saying what it received and the driver printing what it collected.
#include <twinkle/plugin.hpp>

#include <numeric>
#include <string>
#include <vector>

using twinkle::Context;
using twinkle::Value;

// Lives on the "model" group: 4 workers, mesh dp=2 x tp=2.
struct Model {
  explicit Model(Context& ctx) {
    ctx.log("Model up: rank {} of {}, dp rank {}, tp rank {}", ctx.rank(), ctx.world_size(),
            ctx.rank_in("dp"), ctx.rank_in("tp"));
  }

  // dispatch all: every rank gets the same greeting.
  std::string greet(Context& ctx, const std::string& greeting) {
    ctx.log("greet received \"{}\"", greeting);
    return greeting + " from rank " + std::to_string(ctx.rank());
  }

  // dispatch slice: the list is cut by worker index; collect none returns each worker's part.
  std::vector<int> by_worker(Context& ctx, const std::vector<int>& items) {
    ctx.log("slice received {}", Value(items));
    return items;
  }

  // dispatch slice_dp: tp peers (same data rank) get the same part.
  Value by_data_rank(Context& ctx, const Value& batch) {
    ctx.log("slice_dp received {} (data rank {})", batch, ctx.data_rank());
    return batch;
  }

  // collect sum / mean over maps, key by key.
  Value stats(Context&, const std::vector<double>& xs) {
    double total = std::accumulate(xs.begin(), xs.end(), 0.0);
    return Value::map({{"count", static_cast<int>(xs.size())}, {"total", total}});
  }
  Value rank_sum(Context& ctx) { return Value::map({{"rank", ctx.rank()}, {"one", 1}}); }

  // execute first: only worker 0 runs it.
  std::string leader(Context& ctx) { return "worker " + std::to_string(ctx.rank()) + " leads"; }

  // custom dispatch and collect.
  std::string words(Context& ctx, const std::vector<std::string>& ws) {
    std::string s;
    for (const auto& w : ws) s += (s.empty() ? "" : " ") + w;
    ctx.log("custom dispatch gave me \"{}\"", s);
    return s;
  }
};

// Lives on the "processor" group: 2 workers, mesh pp=2.
struct Processor {
  explicit Processor(Context&) {}

  // collect last_pp: only the last pipeline stage's result comes back.
  std::string stage(Context& ctx) { return "pp stage " + std::to_string(ctx.rank_in("pp")); }
};

TWINKLE_CLASS(Model, twinkle::execute::all);
TWINKLE_METHOD(Model, greet, twinkle::dispatch::all, twinkle::collect::none);
TWINKLE_METHOD(Model, by_worker, twinkle::dispatch::slice, twinkle::collect::none);
TWINKLE_METHOD(Model, by_data_rank, twinkle::dispatch::slice_dp, twinkle::collect::flatten);
TWINKLE_METHOD(Model, stats, twinkle::dispatch::slice_dp, twinkle::collect::mean);
TWINKLE_METHOD(Model, rank_sum, twinkle::dispatch::all, twinkle::collect::sum);
TWINKLE_METHOD(Model, leader, twinkle::dispatch::all, twinkle::collect::first,
               twinkle::execute::first);
TWINKLE_METHOD(Model, words, twinkle::dispatch::custom("every_other"),
               twinkle::collect::custom("join_lines"));

TWINKLE_CLASS(Processor, twinkle::execute::all);
TWINKLE_METHOD(Processor, stage, twinkle::dispatch::all, twinkle::collect::last_pp);

// Worker i of n takes words i, i+n, i+2n, ...
TWINKLE_DISPATCHER(every_other, int n, int index, const twinkle::Mesh&, const Value& args) {
  Value mine = Value::list();
  const Value& ws = args[0];
  for (size_t i = static_cast<size_t>(index); i < ws.size(); i += static_cast<size_t>(n))
    mine.push_back(ws[i]);
  return Value::list({mine});
}

TWINKLE_COLLECTOR(join_lines, const std::vector<Value>& results, const twinkle::Mesh&) {
  std::string s;
  for (size_t i = 0; i < results.size(); ++i)
    s += "\n    worker " + std::to_string(i) + ": " + results[i].as<std::string>();
  return s;
}

TWINKLE_DRIVER(main, twinkle::Driver& d) {
  auto model = d.create<Model>("model");
  auto processor = d.create<Processor>("processor");
  const std::string greeting = d.args()["greeting"].as<std::string>();

  // All calls are sent before any result is awaited: the groups work at the same time.
  auto greet = model.call("greet", greeting);
  auto slices = model.call("by_worker", std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  auto dp = model.call("by_data_rank", Value::list({"a", "b", "c", "d", "e"}));
  auto stats = model.call("stats", std::vector<double>{1, 2, 3, 4, 5, 6});
  auto ranks = model.call("rank_sum");
  auto leader = model.call("leader");
  auto words =
      model.call("words", std::vector<std::string>{"one", "two", "three", "four", "five", "six"});
  auto stage = processor.call("stage");

  d.log("collect none    (greet, dispatch all):        {}", greet.get());
  d.log("collect none    (by_worker, dispatch slice):  {}", slices.get());
  d.log("collect flatten (by_data_rank, slice_dp):     {}", dp.get());
  d.log("collect mean    (stats, slice_dp):            {}", stats.get());
  d.log("collect sum     (rank_sum, dispatch all):     {}", ranks.get());
  d.log("collect first   (leader, execute first):      {}", leader.get());
  d.log("collect last_pp (processor stage):            {}", stage.get());
  d.log("custom dispatch + collect (words):{}", words.get());
}

TWINKLE_PLUGIN("hello", "1.0.0");
