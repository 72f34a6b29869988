// The rl example: on-policy reinforcement learning with three groups that call each other
// (docs/ARCHITECTURE.md, Calls between groups). A sampler generates rollouts with the current
// policy, a processor scores them and calls its peer trainer worker directly, the trainer (dp = 2)
// takes a policy-gradient step, and after every step the trainer's rank 0 broadcasts the weights to
// every sampler worker over a communicator across groups; the driver checks that all copies are
// bit-identical.
//
// The task is a contextual bandit: a context c in 0..15 is drawn, the policy picks one of 4
// actions, and the reward is 1 for the context's hidden best action, 0 otherwise. The policy is
// softmax(W[c]) (a linear policy on one-hot contexts), trained with REINFORCE and a batch-mean
// baseline. A uniform policy earns 0.25 on average; a trained one close to 1.
#include <twinkle/plugin.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

using twinkle::Context;
using twinkle::Value;

namespace {

constexpr int kContexts = 16;
constexpr int kActions = 4;

// The bandit's hidden answer for each context.
int best_action(int context) { return (context * 7 + 3) % kActions; }

// The policy's weights: logits W[context][action], row-major.
using Weights = std::vector<float>;

Weights zero_weights() { return Weights(kContexts * kActions, 0.0f); }

std::array<double, kActions> probabilities(const Weights& w, int context) {
  std::array<double, kActions> p{};
  double top = w[context * kActions];
  for (int a = 1; a < kActions; ++a) top = std::max(top, double(w[context * kActions + a]));
  double sum = 0;
  for (int a = 0; a < kActions; ++a) sum += p[a] = std::exp(w[context * kActions + a] - top);
  for (double& x : p) x /= sum;
  return p;
}

// FNV-1a over the weights' bytes, as 16 hex digits: equal only for bit-identical weights.
std::string fingerprint(const Weights& w) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* bytes = reinterpret_cast<const unsigned char*>(w.data());
  for (std::size_t i = 0; i < w.size() * sizeof(float); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  return text;
}

std::string fixed(double x, int digits) {
  char text[32];
  std::snprintf(text, sizeof text, "%.*f", digits, x);
  return text;
}

}  // namespace

// The trainer (dp = 2): each rank keeps a replica of the policy; every step averages the
// gradients over dp, so the replicas stay identical.
struct Trainer {
  explicit Trainer(Context& ctx) : lr_(ctx.args()["lr"].as<double>()) {}

  // One policy-gradient step on this rank's part of the batch: [context, action, advantage]
  // triples. Called by the processor's peer worker, not by the driver.
  Value train(Context& ctx, const Value& batch) {
    Weights grad = zero_weights();
    double loss = 0;
    for (const auto& item : batch) {
      const int c = item[0].as<int>(), a = item[1].as<int>();
      const double advantage = item[2].as<double>();
      const auto p = probabilities(w_, c);
      loss -= advantage * std::log(p[a]);
      for (int j = 0; j < kActions; ++j)
        grad[c * kActions + j] -= float(advantage * ((j == a ? 1.0 : 0.0) - p[j]));
    }
    const auto n = static_cast<float>(batch.size());
    for (float& g : grad) g /= n;
    ctx.comm("dp").all_reduce(std::span<float>(grad));
    const auto replicas = static_cast<float>(ctx.size_of("dp"));
    for (std::size_t i = 0; i < w_.size(); ++i) w_[i] -= float(lr_) * grad[i] / replicas;
    return Value::map({{"loss", loss / n}});
  }

  // Rank 0 sends its weights to every sampler worker (the communicator "weights").
  std::string push(Context& ctx) {
    ctx.comm("weights").broadcast(std::span<float>(w_), 0);
    return fingerprint(w_);
  }

  std::string weights(Context&) { return fingerprint(w_); }

  double lr_;
  Weights w_ = zero_weights();
};
TWINKLE_CLASS(Trainer, twinkle::execute::all);
TWINKLE_METHOD(Trainer, train, twinkle::dispatch::all, twinkle::collect::mean,
               twinkle::execute::peer);
TWINKLE_METHOD(Trainer, push, twinkle::dispatch::all, twinkle::collect::first,
               twinkle::execute::first);
TWINKLE_METHOD(Trainer, weights, twinkle::dispatch::all, twinkle::collect::none);

// The sampler: plays the bandit with its copy of the policy.
struct Sampler {
  explicit Sampler(Context& ctx) : seed_(ctx.args()["seed"].as<std::int64_t>()) {}

  // This worker's share of `batch` episodes for `step`: [context, action] pairs, the actions
  // drawn from the current policy. Seeded by (seed, step, rank): a run repeats exactly.
  Value rollout(Context& ctx, int step, int batch) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(seed_) * 1000003u + step * 1009u + ctx.rank());
    std::uniform_int_distribution<int> context(0, kContexts - 1);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    const int share = batch / ctx.world_size() + (ctx.rank() < batch % ctx.world_size() ? 1 : 0);
    Value out = Value::list();
    for (int i = 0; i < share; ++i) {
      const int c = context(rng);
      const auto p = probabilities(w_, c);
      double x = u(rng);
      int a = 0;
      while (a < kActions - 1 && (x -= p[a]) > 0) ++a;
      out.push_back(Value::list({c, a}));
    }
    return out;
  }

  // Receives the trainer's weights (the communicator "weights", root: trainer rank 0).
  std::string pull(Context& ctx) {
    ctx.comm("weights").broadcast(std::span<float>(w_), 0);
    return fingerprint(w_);
  }

  std::int64_t seed_;
  Weights w_ = zero_weights();
};
TWINKLE_CLASS(Sampler, twinkle::execute::all);
TWINKLE_METHOD(Sampler, rollout, twinkle::dispatch::all, twinkle::collect::flatten);
TWINKLE_METHOD(Sampler, pull, twinkle::dispatch::all, twinkle::collect::none);

// The processor: scores rollouts and feeds its peer trainer worker directly.
struct Processor {
  explicit Processor(Context&) {}

  // Keeps the trainer's handle (passed by the driver) for calls from this worker.
  bool connect(Context& ctx, const Value& trainer) {
    trainer_ = ctx.handle(trainer);
    return true;
  }

  // Rewards (1 for the best action), advantages (reward minus the mean of this part), then one
  // training step on the trainer worker that is this rank's peer (execute = peer on train).
  Value process(Context&, const Value& rollouts) {
    std::vector<double> reward;
    for (const auto& r : rollouts)
      reward.push_back(r[1].as<int>() == best_action(r[0].as<int>()) ? 1.0 : 0.0);
    double mean = 0;
    for (double x : reward) mean += x;
    mean /= static_cast<double>(reward.size());
    Value batch = Value::list();
    for (std::size_t i = 0; i < reward.size(); ++i)
      batch.push_back(Value::list({rollouts[i][0], rollouts[i][1], reward[i] - mean}));
    Value trained = trainer_->call("train", batch).get();
    return Value::map({{"reward", mean}, {"loss", trained["loss"]}});
  }

  std::optional<twinkle::Handle> trainer_;
};
TWINKLE_CLASS(Processor, twinkle::execute::all);
TWINKLE_METHOD(Processor, connect, twinkle::dispatch::all, twinkle::collect::first);
TWINKLE_METHOD(Processor, process, twinkle::dispatch::slice, twinkle::collect::mean);

TWINKLE_DRIVER(main, twinkle::Driver& d) {
  const int steps = d.args()["steps"].as<int>();
  const int batch = d.args()["batch"].as<int>();
  const double threshold = d.args()["threshold"].as<double>();

  auto trainer = d.create<Trainer>("trainer");
  auto sampler = d.create<Sampler>("sampler");
  auto processor = d.create<Processor>("processor");
  processor.call("connect", trainer).get();
  d.communicator("weights", {{"trainer", {0}}, {"sampler"}});

  // Trainer rank 0 -> every sampler worker; every copy must be bit-identical (both trainer
  // replicas and both samplers).
  auto sync = [&] {
    auto pushed = trainer.call("push");
    auto pulled = sampler.call("pull");
    const std::string want = pushed.get().as<std::string>();
    for (const auto& f : pulled.get())
      if (f.as<std::string>() != want) throw std::runtime_error("a sampler's weights differ");
    for (const auto& f : trainer.call("weights").get())
      if (f.as<std::string>() != want) throw std::runtime_error("the trainer replicas differ");
    return want;
  };
  sync();

  std::vector<double> rewards;
  for (int step = 1; step <= steps; ++step) {
    Value rollouts = sampler.call("rollout", step, batch).get();
    Value stats = processor.call("process", rollouts).get();
    const std::string weights = sync();
    rewards.push_back(stats["reward"].as<double>());
    d.log("step {}  reward {}  pg-loss {}  weights {} (trainer = sampler:0 = sampler:1)",
          step < 10 ? " " + std::to_string(step) : std::to_string(step), fixed(rewards.back(), 3),
          fixed(stats["loss"].as<double>(), 4), weights);
  }
  const std::size_t last = std::min<std::size_t>(5, rewards.size());
  double mean = 0;
  for (std::size_t i = rewards.size() - last; i < rewards.size(); ++i) mean += rewards[i];
  mean /= static_cast<double>(last);
  d.log("weights in sync after every step: yes");
  d.log("mean reward of the last {} steps: {} (threshold {})", last, fixed(mean, 3),
        fixed(threshold, 2));
  if (mean < threshold)
    throw std::runtime_error("the policy did not learn: mean reward " + fixed(mean, 3) +
                             " below the threshold " + fixed(threshold, 2));
}

TWINKLE_PLUGIN("rl", "1.0.0");
