// The pipeline example: an RL-style loop over three groups (processor -> sampler -> model) run
// twice, first one call after another and then pipelined, so that step i trains while step i+1
// samples and step i+2 prepares its prompts. Every call returns a LazyCollect at once, so the
// driver keeps all three groups busy by sending their calls before it awaits any of them.
//
// The work is small but real CPU arithmetic (hash chains, a tiny RNN, a tiny language model with
// its backward pass) and fully deterministic, so both runs must produce the very same losses.
#include <twinkle/plugin.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using twinkle::Context;
using twinkle::Tensor;
using twinkle::Value;

namespace {

constexpr int kVocab = 256;
constexpr int kPromptLen = 16;
constexpr int kCompletionLen = 64;
constexpr int kHashRounds = 80000;  // per prompt token: the processor's cost
constexpr int kSamplerHidden = 192;
constexpr int kModelEmbed = 64;
constexpr int kModelHidden = 160;
constexpr double kLearningRate = 2.0;

// splitmix64: the one source of pseudo-randomness, so every number depends only on its key.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1).
double uniform(std::uint64_t key) { return static_cast<double>(mix(key) >> 11) * 0x1.0p-52 - 1.0; }

std::vector<double> init_weights(std::uint64_t seed, std::size_t n, double scale) {
  std::vector<double> w(n);
  for (std::size_t i = 0; i < n; ++i) w[i] = scale * uniform(seed * 0x100000001b3ULL + i);
  return w;
}

std::int64_t int_arg(const Value& args, std::string_view key, std::int64_t fallback) {
  return args.contains(key) ? args[key].as<std::int64_t>() : fallback;
}

std::uint64_t seed_of(const Value& args) {
  return static_cast<std::uint64_t>(int_arg(args, "seed", 7));
}

}  // namespace

// Lives on the "processor" group (2 workers, default mesh dp=2): turns prompt ids into tokens.
// Each token costs a chain of kHashRounds hashes, a stand-in for templating, tokenizing, filtering.
struct Processor {
  explicit Processor(Context& ctx) : seed_(seed_of(ctx.args())) {}

  // dispatch slice: each worker gets its part of the ids; collect flatten joins the [n, P] parts.
  // slice cuts by worker and flatten keeps one result per data rank: the two agree here because
  // the default mesh (dp = number of workers) makes every worker its own data rank.
  Tensor prepare(Context&, const std::vector<std::int64_t>& ids) {
    std::vector<std::int32_t> tokens;
    tokens.reserve(ids.size() * kPromptLen);
    for (std::int64_t id : ids) {
      std::uint64_t state = mix(seed_ ^ mix(static_cast<std::uint64_t>(id)));
      for (int t = 0; t < kPromptLen; ++t) {
        for (int r = 0; r < kHashRounds; ++r) state = mix(state);
        tokens.push_back(static_cast<std::int32_t>(state % kVocab));
      }
    }
    return Tensor::from(tokens, {static_cast<std::int64_t>(ids.size()), kPromptLen});
  }

  std::uint64_t seed_;
};

// Lives on the "sampler" group (2 workers): a fixed tiny RNN policy that reads each prompt and
// writes a completion, plus a rule-based reward for it.
struct Sampler {
  explicit Sampler(Context& ctx)
      : seed_(seed_of(ctx.args())),
        embed_(init_weights(seed_ + 11, kVocab * kSamplerHidden, 1.0)),
        recur_(init_weights(seed_ + 12, kSamplerHidden * kSamplerHidden, 1.5 / kSamplerHidden)),
        out_(init_weights(seed_ + 13, kVocab * kSamplerHidden, 1.0)) {}

  // dispatch slice_dp: rows of the prompt tensor; collect flatten joins the maps key by key.
  Value generate(Context&, const Tensor& prompts) {
    const auto n = prompts.shape()[0];
    const auto p = prompts.span<std::int32_t>();
    std::vector<std::int32_t> completions;
    std::vector<double> rewards;
    std::vector<double> h(kSamplerHidden), next(kSamplerHidden), logits(kVocab);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int32_t* prompt = p.data() + i * kPromptLen;
      std::fill(h.begin(), h.end(), 0.0);
      std::uint64_t key = seed_;
      for (int t = 0; t < kPromptLen; ++t) {
        step(h, next, prompt[t]);
        key = mix(key ^ static_cast<std::uint64_t>(prompt[t]));
      }
      int matches = 0;
      for (int t = 0; t < kCompletionLen; ++t) {
        for (int v = 0; v < kVocab; ++v) {
          double z = 0;
          for (int j = 0; j < kSamplerHidden; ++j) z += out_[v * kSamplerHidden + j] * h[j];
          logits[v] = z + 2.0 * uniform(key + static_cast<std::uint64_t>(t * kVocab + v));
        }
        const auto token = static_cast<std::int32_t>(
            std::max_element(logits.begin(), logits.end()) - logits.begin());
        completions.push_back(token);
        matches += (token % 2) == (prompt[kPromptLen - 1] % 2);
        step(h, next, token);
      }
      // The reward: how many completion tokens share the parity of the prompt's last token.
      rewards.push_back(static_cast<double>(matches) / kCompletionLen);
    }
    return Value::map({{"prompts", prompts},
                       {"completions", Tensor::from(completions, {n, kCompletionLen})},
                       {"rewards", Tensor::from(rewards)}});
  }

  // h = tanh(recur h + embed[token])
  void step(std::vector<double>& h, std::vector<double>& next, std::int32_t token) const {
    for (int k = 0; k < kSamplerHidden; ++k) {
      double a = embed_[token * kSamplerHidden + k];
      for (int j = 0; j < kSamplerHidden; ++j) a += recur_[k * kSamplerHidden + j] * h[j];
      next[k] = std::tanh(a);
    }
    h.swap(next);
  }

  std::uint64_t seed_;
  std::vector<double> embed_, recur_, out_;
};

// Lives on the "model" group (4 workers, mesh dp=2 x tp=2): a tiny next-token model trained on the
// completions, each token's loss weighted by its sample's reward. The two tp peers of a data rank
// get the same rows (dispatch slice_dp) and, with no collectives here, compute the same thing.
struct Model {
  explicit Model(Context& ctx) : seed_(seed_of(ctx.args())) { init(); }

  // dispatch all: back to the initial weights, so that both runs start from the same model.
  void reset(Context&) { init(); }

  // dispatch slice_dp: rows of every tensor in the map; collect mean averages the loss and the
  // gradient over the workers (tp peers hold equal values, so this is the mean over data ranks).
  Value train_step(Context&, const Value& batch) {
    const Tensor& prompts = batch["prompts"].tensor();
    const auto p = prompts.span<std::int32_t>();
    const auto c = batch["completions"].tensor().span<std::int32_t>();
    const auto rewards = batch["rewards"].tensor().span<double>();
    const auto n = prompts.shape()[0];
    const double scale = 1.0 / static_cast<double>(n * kCompletionLen);

    std::vector<double> grad(weights_.size(), 0.0);
    double* g_embed = grad.data();
    double* g_w1 = g_embed + kVocab * kModelEmbed;
    double* g_w2 = g_w1 + kModelHidden * kModelEmbed;
    const double* embed = weights_.data();
    const double* w1 = embed + kVocab * kModelEmbed;
    const double* w2 = w1 + kModelHidden * kModelEmbed;

    std::vector<double> h(kModelHidden), dh(kModelHidden), z(kVocab);
    double loss = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const double weight = rewards[static_cast<std::size_t>(i)] * scale;
      for (int t = 0; t < kCompletionLen; ++t) {
        const int x = t == 0 ? p[static_cast<std::size_t>((i + 1) * kPromptLen - 1)]
                             : c[static_cast<std::size_t>(i * kCompletionLen + t - 1)];
        const int y = c[static_cast<std::size_t>(i * kCompletionLen + t)];
        const double* e = embed + x * kModelEmbed;
        // Forward: h = tanh(w1 e), z = w2 h, loss = -log softmax(z)[y].
        for (int k = 0; k < kModelHidden; ++k) {
          double a = 0;
          for (int j = 0; j < kModelEmbed; ++j) a += w1[k * kModelEmbed + j] * e[j];
          h[k] = std::tanh(a);
        }
        double zmax = -1e300;
        for (int v = 0; v < kVocab; ++v) {
          double s = 0;
          for (int k = 0; k < kModelHidden; ++k) s += w2[v * kModelHidden + k] * h[k];
          z[v] = s;
          zmax = std::max(zmax, s);
        }
        double total = 0;
        for (int v = 0; v < kVocab; ++v) total += std::exp(z[v] - zmax);
        loss += weight * (std::log(total) + zmax - z[y]);
        // Backward: dz = weight * (softmax(z) - onehot(y)).
        std::fill(dh.begin(), dh.end(), 0.0);
        for (int v = 0; v < kVocab; ++v) {
          const double dz = weight * (std::exp(z[v] - zmax) / total - (v == y ? 1.0 : 0.0));
          for (int k = 0; k < kModelHidden; ++k) {
            g_w2[v * kModelHidden + k] += dz * h[k];
            dh[k] += dz * w2[v * kModelHidden + k];
          }
        }
        for (int k = 0; k < kModelHidden; ++k) {
          const double da = dh[k] * (1.0 - h[k] * h[k]);
          for (int j = 0; j < kModelEmbed; ++j) {
            g_w1[k * kModelEmbed + j] += da * e[j];
            g_embed[x * kModelEmbed + j] += da * w1[k * kModelEmbed + j];
          }
        }
      }
    }
    return Value::map({{"loss", loss}, {"grad", Tensor::from(grad)}});
  }

  // dispatch all: every worker applies the same averaged gradient, so the replicas stay equal
  // (the driver stands in for an all-reduce).
  void apply(Context&, const Tensor& grad) {
    const auto g = grad.span<double>();
    if (g.size() != weights_.size()) throw std::invalid_argument("gradient of the wrong size");
    for (std::size_t i = 0; i < weights_.size(); ++i) weights_[i] -= kLearningRate * g[i];
  }

  void init() {
    weights_ = init_weights(seed_ + 21, kVocab * kModelEmbed, 1.0);
    auto w1 = init_weights(seed_ + 22, kModelHidden * kModelEmbed, 1.0 / std::sqrt(kModelEmbed));
    auto w2 = init_weights(seed_ + 23, kVocab * kModelHidden, 1.0 / std::sqrt(kModelHidden));
    weights_.insert(weights_.end(), w1.begin(), w1.end());
    weights_.insert(weights_.end(), w2.begin(), w2.end());
  }

  std::uint64_t seed_;
  std::vector<double> weights_;  // embed [V, D] | w1 [H, D] | w2 [V, H]
};

TWINKLE_CLASS(Processor, twinkle::execute::all);
TWINKLE_METHOD(Processor, prepare, twinkle::dispatch::slice, twinkle::collect::flatten);

TWINKLE_CLASS(Sampler, twinkle::execute::all);
TWINKLE_METHOD(Sampler, generate, twinkle::dispatch::slice_dp, twinkle::collect::flatten);

TWINKLE_CLASS(Model, twinkle::execute::all);
TWINKLE_METHOD(Model, reset, twinkle::dispatch::all, twinkle::collect::none);
TWINKLE_METHOD(Model, train_step, twinkle::dispatch::slice_dp, twinkle::collect::mean);
TWINKLE_METHOD(Model, apply, twinkle::dispatch::all, twinkle::collect::none);

namespace {

using Clock = std::chrono::steady_clock;

struct Groups {
  twinkle::Handle processor, sampler, model;
};

struct Run {
  std::vector<double> losses;
  double seconds = 0;
  double busy[3] = {0, 0, 0};  // sequential only: time spent in each stage
};

std::vector<std::int64_t> prompt_ids(int step, int batch) {
  std::vector<std::int64_t> ids(static_cast<std::size_t>(batch));
  for (int i = 0; i < batch; ++i) ids[static_cast<std::size_t>(i)] = std::int64_t{step} * batch + i;
  return ids;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Train on a step's samples, then send the averaged gradient back to every model worker.
double train(const twinkle::Handle& model, const Value& samples) {
  auto result = model.call("train_step", samples);
  const double loss = result["loss"].as<double>();
  model.call("apply", result["grad"]).get();
  return loss;
}

// One call after another: each group waits while the other two work.
Run sequential(const Groups& g, int steps, int batch) {
  Run run;
  g.model.call("reset").get();
  const auto start = Clock::now();
  for (int step = 0; step < steps; ++step) {
    auto t0 = Clock::now();
    Value prompts = g.processor.call("prepare", prompt_ids(step, batch)).get();
    run.busy[0] += seconds_since(t0);
    t0 = Clock::now();
    Value samples = g.sampler.call("generate", prompts).get();
    run.busy[1] += seconds_since(t0);
    t0 = Clock::now();
    run.losses.push_back(train(g.model, samples));
    run.busy[2] += seconds_since(t0);
  }
  run.seconds = seconds_since(start);
  return run;
}

// Pipelined: in tick k the model trains step k-2, the sampler samples step k-1 and the processor
// prepares step k. All three calls are sent before any is awaited, so the groups run at once.
Run pipelined(const Groups& g, int steps, int batch) {
  Run run;
  run.losses.resize(static_cast<std::size_t>(steps));
  std::vector<Value> prompts(static_cast<std::size_t>(steps));
  std::vector<Value> samples(static_cast<std::size_t>(steps));
  g.model.call("reset").get();
  const auto start = Clock::now();
  for (int tick = 0; tick < steps + 2; ++tick) {
    const int train_step = tick - 2, sample_step = tick - 1, prepare_step = tick;
    std::optional<twinkle::LazyCollect> trained, sampled, prepared;
    if (train_step >= 0) {
      trained = g.model.call("train_step", samples[static_cast<std::size_t>(train_step)]);
    }
    if (sample_step >= 0 && sample_step < steps) {
      sampled = g.sampler.call("generate", prompts[static_cast<std::size_t>(sample_step)]);
    }
    if (prepare_step < steps) {
      prepared = g.processor.call("prepare", prompt_ids(prepare_step, batch));
    }
    // Only now does the driver block, on whichever group is still working.
    if (prepared) prompts[static_cast<std::size_t>(prepare_step)] = prepared->get();
    if (sampled) samples[static_cast<std::size_t>(sample_step)] = sampled->get();
    if (trained) {
      run.losses[static_cast<std::size_t>(train_step)] = (*trained)["loss"].as<double>();
      g.model.call("apply", (*trained)["grad"]).get();
    }
  }
  run.seconds = seconds_since(start);
  return run;
}

std::string fixed(double x, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

}  // namespace

TWINKLE_DRIVER(main, twinkle::Driver& d) {
  const int steps = static_cast<int>(int_arg(d.args(), "steps", 4));
  const int batch = static_cast<int>(int_arg(d.args(), "batch", 16));
  if (steps < 1) throw std::invalid_argument("args.steps must be at least 1");

  const Groups g{d.create<Processor>("processor"), d.create<Sampler>("sampler"),
                 d.create<Model>("model")};
  d.log("{} steps of batch {} on a machine of {} cores", steps, batch,
        std::thread::hardware_concurrency());

  // One untimed call per group, so that neither run pays for first-call costs (page faults,
  // buffers); train_step alone leaves the weights as they are.
  {
    Value prompts = g.processor.call("prepare", prompt_ids(0, batch)).get();
    Value samples = g.sampler.call("generate", prompts).get();
    g.model.call("train_step", samples).get();
  }

  const Run seq = sequential(g, steps, batch);
  d.log("sequential, per step: processor {} s, sampler {} s, model {} s",
        fixed(seq.busy[0] / steps, 3), fixed(seq.busy[1] / steps, 3),
        fixed(seq.busy[2] / steps, 3));
  const Run pipe = pipelined(g, steps, batch);

  for (int step = 0; step < steps; ++step) {
    const auto i = static_cast<std::size_t>(step);
    d.log("step {}: loss {} (sequential) {} (pipelined)", step, fixed(seq.losses[i], 6),
          fixed(pipe.losses[i], 6));
  }
  // The work is deterministic and both runs do it in the same order per group, so the losses
  // must be equal to the last bit: overlapping the groups must not change what they compute.
  for (int step = 0; step < steps; ++step) {
    const auto i = static_cast<std::size_t>(step);
    if (seq.losses[i] != pipe.losses[i]) {
      throw std::runtime_error("step " + std::to_string(step) + ": the pipelined run's loss " +
                               fixed(pipe.losses[i], 17) + " differs from the sequential run's " +
                               fixed(seq.losses[i], 17));
    }
  }
  d.log("overlap: sequential {} s, pipelined {} s, saved {}%", fixed(seq.seconds, 3),
        fixed(pipe.seconds, 3), fixed(100.0 * (1.0 - pipe.seconds / seq.seconds), 1));
}

TWINKLE_PLUGIN("pipeline", "1.0.0");
