// The gpt example: a character-level transformer written with libtorch, trained and sampled
// across two groups (examples/gpt/README.md).
//
// The driver reads Tiny Shakespeare, turns it into token ids (the 65 characters it uses, in byte
// order) and gives them to both groups. The first 90% is for training, the last 10% for
// validation. Every step the driver draws one global batch of sequence offsets (from the job's
// seed and the step, so a resumed run draws what an uninterrupted one would) and sends it with
// dispatch slice_dp: each trainer rank takes its rows, computes the loss and gradients with torch,
// averages the gradients over ctx.comm("dp") on torch tensors (twinkle/torch.hpp) and takes the
// same AdamW step, so every replica stays identical and the result does not depend on the number
// of trainers (up to float rounding).
//
// Every sync_every steps trainer rank 0 broadcasts its weights to the sampler over the
// communicator "weights" (across groups), the driver checks the fingerprints of every copy, and
// the sampler generates text from them while the trainer goes on training (the driver collects
// the sample later: LazyCollect overlap).
//
// Checkpoints: with a [job] checkpoint_dir the trainer's model and AdamW state are saved at every
// evaluation (TWINKLE_STATE); `twinkle run --resume` continues to the same losses.
#include <twinkle/torch.hpp>

#include <zlib.h>

#include <torch/nn/utils/convert_parameters.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.hpp"

using twinkle::Context;
using twinkle::Tensor;
using twinkle::Value;
namespace tt = twinkle::torch;

namespace {

std::string read_gzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open " + path + " (args.data)");
  std::string text;
  char buf[1 << 16];
  int n = 0;
  while ((n = gzread(f, buf, sizeof buf)) > 0) text.append(buf, static_cast<std::size_t>(n));
  const bool bad = n < 0;
  gzclose(f);
  if (bad || text.empty()) throw std::runtime_error(path + " is not a readable gzip'd text");
  return text;
}

gpt::Config config_of(const Value& a) {
  gpt::Config c;
  c.vocab = a["vocab"].as<std::int64_t>();
  c.context = a["context"].as<std::int64_t>();
  c.width = a["width"].as<std::int64_t>();
  c.heads = a["heads"].as<std::int64_t>();
  c.layers = a["layers"].as<std::int64_t>();
  return c;
}

// FNV-1a over the parameters' bytes, as 16 hex digits: equal only for bit-identical weights.
std::string fingerprint(const at::Tensor& flat) {
  const at::Tensor c = flat.contiguous();
  const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
  std::uint64_t h = 1469598103934665603ull;
  for (std::int64_t i = 0; i < c.numel() * c.element_size(); ++i)
    h = (h ^ bytes[i]) * 1099511628211ull;
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  return text;
}

// The sequences at `offsets` of `ids` as model input x and next-character targets y.
std::pair<at::Tensor, at::Tensor> batch_at(const at::Tensor& ids, const Tensor& offsets,
                                           std::int64_t context) {
  const at::Tensor rows = tt::view(offsets).unsqueeze(1) + at::arange(context, at::kLong);
  return {ids.index({rows}), ids.index({rows + 1})};
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The per-worker results of a collect::none call (one worker's result comes unwrapped).
std::vector<Value> per_worker(const Value& v) {
  if (!v.is_list()) return {v};
  return {v.begin(), v.end()};
}

std::string fixed(double x, int digits) {
  char text[32];
  std::snprintf(text, sizeof text, "%.*f", digits, x);
  return text;
}

}  // namespace

// The trainer (mesh dp): one replica of the model and its optimizer per rank.
struct Trainer {
  // args: the model's shape, the token ids (uint8), the learning rate, the seed, and the global
  // batch sizes of a step and of the validation.
  Trainer(Context& ctx, const Value& args)
      : config_(config_of(args[0])),
        ids_(tt::view(args[1].as<Tensor>()).to(at::kLong)),
        model_(nullptr) {
    // Equal slices: the mean of the ranks' losses is then the loss of the whole batch, the same
    // for any number of trainers.
    const int dp = ctx.size_of("dp");
    for (const auto& [name, n] : {std::pair{"batch", args[4].as<std::int64_t>()},
                                  std::pair{"eval_batch", args[5].as<std::int64_t>()}}) {
      if (n % dp != 0) {
        throw std::runtime_error(
            "args." + std::string(name) + " = " + std::to_string(n) +
            " does not split evenly over the trainer's dp = " + std::to_string(dp) +
            "; make it a multiple of " + std::to_string(dp));
      }
    }
    // The same seed on every rank: the replicas start equal.
    torch::manual_seed(static_cast<std::uint64_t>(args[3].as<std::int64_t>()));
    model_ = gpt::Gpt(config_);
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        model_->parameters(), torch::optim::AdamWOptions(args[2].as<double>()).weight_decay(0.01));
  }

  // One AdamW step on this rank's rows of the global batch; the gradients are averaged over dp.
  // {loss of these rows, seconds in torch, seconds in the all_reduce}.
  Value step(Context& ctx, const Tensor& offsets) {
    auto start = std::chrono::steady_clock::now();
    auto [x, y] = batch_at(ids_, offsets, config_.context);
    at::Tensor loss = model_->loss(x, y);
    optimizer_->zero_grad();
    loss.backward();
    double compute = seconds_since(start);

    start = std::chrono::steady_clock::now();
    std::vector<at::Tensor> grads;
    for (auto& p : model_->parameters()) grads.push_back(p.grad().view(-1));
    at::Tensor flat = at::cat(grads);
    tt::all_reduce(ctx.comm("dp"), flat, twinkle::ReduceOp::mean);
    std::int64_t offset = 0;
    for (auto& p : model_->parameters()) {
      p.grad().copy_(flat.slice(0, offset, offset + p.numel()).view_as(p));
      offset += p.numel();
    }
    const double comm = seconds_since(start);

    start = std::chrono::steady_clock::now();
    optimizer_->step();
    compute += seconds_since(start);
    return Value::map({{"loss", loss.item<double>()}, {"compute_s", compute}, {"comm_s", comm}});
  }

  // The mean loss on this rank's rows of the validation batch.
  double evaluate(Context&, const Tensor& offsets) {
    torch::NoGradGuard no_grad;
    auto [x, y] = batch_at(ids_, offsets, config_.context);
    return model_->loss(x, y).item<double>();
  }

  // Rank 0 sends its weights to every sampler worker (the communicator "weights"):
  // {fingerprint, bytes, seconds in the broadcast, seconds a memcpy of the same bytes takes}.
  Value push(Context& ctx) {
    torch::NoGradGuard no_grad;
    at::Tensor flat = torch::nn::utils::parameters_to_vector(model_->parameters());
    auto start = std::chrono::steady_clock::now();
    tt::broadcast(ctx.comm("weights"), flat, 0);
    const double broadcast = seconds_since(start);
    at::Tensor copy = at::empty_like(flat);
    start = std::chrono::steady_clock::now();
    std::memcpy(copy.data_ptr(), flat.data_ptr(), flat.nbytes());
    const double memcpy = seconds_since(start);
    return Value::map({{"fingerprint", fingerprint(flat)},
                       {"bytes", static_cast<std::int64_t>(flat.nbytes())},
                       {"broadcast_s", broadcast},
                       {"memcpy_s", memcpy}});
  }

  std::string weights(Context&) {
    torch::NoGradGuard no_grad;
    return fingerprint(torch::nn::utils::parameters_to_vector(model_->parameters()));
  }

  // The model's and the optimizer's state, as torch serialises them.
  Value save(Context&) {
    std::ostringstream model, optimizer;
    torch::save(model_, model);
    torch::save(*optimizer_, optimizer);
    auto bytes = [](const std::string& s) { return twinkle::Bytes{{s.begin(), s.end()}}; };
    return Value::map({{"model", bytes(model.str())}, {"optimizer", bytes(optimizer.str())}});
  }
  void load(Context&, const Value& state) {
    auto stream = [](const Value& v) {
      const auto& b = v.as<twinkle::Bytes>().data;
      return std::istringstream(std::string(b.begin(), b.end()));
    };
    auto model = stream(state["model"]);
    torch::load(model_, model);
    auto optimizer = stream(state["optimizer"]);
    torch::load(*optimizer_, optimizer);
  }

  gpt::Config config_;
  at::Tensor ids_;
  gpt::Gpt model_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
};
TWINKLE_CLASS(Trainer, twinkle::execute::all);
TWINKLE_STATE(Trainer, save, load);
TWINKLE_METHOD(Trainer, step, twinkle::dispatch::slice_dp, twinkle::collect::mean);
TWINKLE_METHOD(Trainer, evaluate, twinkle::dispatch::slice_dp, twinkle::collect::mean);
TWINKLE_METHOD(Trainer, push, twinkle::dispatch::all, twinkle::collect::first,
               twinkle::execute::first);
TWINKLE_METHOD(Trainer, weights, twinkle::dispatch::all, twinkle::collect::none);

// The sampler: the same model, with the weights it last received.
struct Sampler {
  // args: the model's shape, the characters of the token ids in order.
  Sampler(Context&, const Value& args)
      : config_(config_of(args[0])), alphabet_(args[1].as<std::string>()), model_(config_) {
    model_->eval();
  }

  // Receives the trainer's weights (the communicator "weights", root: trainer rank 0).
  std::string pull(Context& ctx) {
    torch::NoGradGuard no_grad;
    at::Tensor flat = torch::nn::utils::parameters_to_vector(model_->parameters());
    tt::broadcast(ctx.comm("weights"), flat, 0);
    torch::nn::utils::vector_to_parameters(flat, model_->parameters());
    return fingerprint(torch::nn::utils::parameters_to_vector(model_->parameters()));
  }

  // `chars` characters after `prompt`, drawn at temperature 0.8 (seeded by seed and rank).
  std::string generate(Context& ctx, const std::string& prompt, std::int64_t chars,
                       std::int64_t seed) {
    torch::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(seed) * 1009u +
                                                        static_cast<std::uint64_t>(ctx.rank()));
    std::vector<std::int64_t> ids;
    for (char c : prompt) {
      const auto index = alphabet_.find(c);
      if (index == std::string::npos)
        throw std::runtime_error(std::string("the prompt's '") + c + "' is not in the text");
      ids.push_back(static_cast<std::int64_t>(index));
    }
    std::string out;
    for (std::int64_t i = 0; i < chars; ++i) {
      const auto from =
          ids.size() > std::size_t(config_.context) ? ids.size() - config_.context : 0;
      at::Tensor x =
          at::tensor(std::vector<std::int64_t>(ids.begin() + from, ids.end())).unsqueeze(0);
      at::Tensor logits = model_->forward(x).select(1, x.size(1) - 1).squeeze(0) / 0.8;
      const auto next =
          at::multinomial(at::softmax(logits, -1), 1, false, gen).item<std::int64_t>();
      ids.push_back(next);
      out += alphabet_[static_cast<std::size_t>(next)];
    }
    return out;
  }

  gpt::Config config_;
  std::string alphabet_;
  gpt::Gpt model_;
};
TWINKLE_CLASS(Sampler, twinkle::execute::all);
TWINKLE_METHOD(Sampler, pull, twinkle::dispatch::all, twinkle::collect::none);
TWINKLE_METHOD(Sampler, generate, twinkle::dispatch::all, twinkle::collect::none);

TWINKLE_DRIVER(main, twinkle::Driver& d) {
  const Value& args = d.args();
  const std::int64_t seed = args["seed"].as<std::int64_t>();
  const int steps = args["steps"].as<int>();
  const std::int64_t batch = args["batch"].as<std::int64_t>();
  const std::int64_t context = args["context"].as<std::int64_t>();
  const int eval_every = args["eval_every"].as<int>();
  const int sync_every = args["sync_every"].as<int>();
  const std::int64_t eval_batch = args["eval_batch"].as<std::int64_t>();
  const std::int64_t sample_chars = args["sample_chars"].as<std::int64_t>();
  const double target = args["target_val_loss"].as<double>();
  if (eval_every <= 0 || sync_every <= 0 || sync_every % eval_every != 0) {
    throw std::runtime_error("args.sync_every (" + std::to_string(sync_every) +
                             ") must be a positive multiple of args.eval_every (" +
                             std::to_string(eval_every) + "): the sampler syncs at evaluations");
  }

  // The text as token ids: its characters, numbered in byte order.
  const std::string text = read_gzip(d.job_path(args["data"].as<std::string>()));
  std::string alphabet;
  {
    std::vector<bool> seen(256);
    for (unsigned char c : text) seen[c] = true;
    for (int c = 0; c < 256; ++c)
      if (seen[static_cast<std::size_t>(c)]) alphabet += static_cast<char>(c);
  }
  Tensor ids(twinkle::DType::u8, {static_cast<std::int64_t>(text.size())});
  {
    std::vector<std::uint8_t> index(256);
    for (std::size_t i = 0; i < alphabet.size(); ++i)
      index[static_cast<unsigned char>(alphabet[i])] = static_cast<std::uint8_t>(i);
    auto out = ids.mutable_span<std::uint8_t>();
    for (std::size_t i = 0; i < text.size(); ++i)
      out[i] = index[static_cast<unsigned char>(text[i])];
  }
  const auto n_train = static_cast<std::int64_t>(text.size()) * 9 / 10;
  const auto n_all = static_cast<std::int64_t>(text.size());

  // Sequence offsets: `n` starts in [lo, hi - context - 1], drawn from (seed, step).
  auto offsets = [&](std::uint64_t stream, std::int64_t n, std::int64_t lo, std::int64_t hi) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(seed) * 0x9e3779b97f4a7c15ull + stream);
    std::uniform_int_distribution<std::int64_t> pick(lo, hi - context - 1);
    Tensor t(twinkle::DType::i64, {n});
    for (auto& x : t.mutable_span<std::int64_t>()) x = pick(rng);
    return t;
  };
  const Tensor validation = offsets(0, eval_batch, n_train, n_all);

  Value model = Value::map({{"vocab", static_cast<std::int64_t>(alphabet.size())},
                            {"context", context},
                            {"width", args["width"]},
                            {"heads", args["heads"]},
                            {"layers", args["layers"]}});
  auto trainer =
      d.create<Trainer>("trainer", model, ids, args["lr"].as<double>(), seed, batch, eval_batch);
  auto sampler = d.create<Sampler>("sampler", model, alphabet);
  d.communicator("weights", {{"trainer", {0}}, {"sampler"}});
  d.log("gpt: {} characters ({} distinct), {} for training, {} for validation", n_all,
        alphabet.size(), n_train, n_all - n_train);
  d.log("model: {} layers, width {}, {} heads, context {}; batch {} sequences per step",
        args["layers"].as<int>(), args["width"].as<int>(), args["heads"].as<int>(), context, batch);

  // The trainer's weights to every sampler worker; every copy must be bit-identical.
  double broadcast_s = 0, memcpy_s = 0, first_sync_s = -1;
  std::int64_t weight_bytes = 0;
  int syncs = 0;
  auto sync = [&] {
    auto pushed = trainer.call("push");
    auto pulled = sampler.call("pull");
    const Value push = pushed.get();
    const std::string want = push["fingerprint"].as<std::string>();
    // The first sync also forms the communicator: timed apart.
    if (first_sync_s < 0) {
      first_sync_s = push["broadcast_s"].as<double>();
    } else {
      broadcast_s += push["broadcast_s"].as<double>();
      memcpy_s += push["memcpy_s"].as<double>();
      ++syncs;
    }
    weight_bytes = push["bytes"].as<std::int64_t>();
    for (const auto& f : per_worker(pulled.get()))
      if (f.as<std::string>() != want) throw std::runtime_error("a sampler's weights differ");
    for (const auto& f : per_worker(trainer.call("weights").get()))
      if (f.as<std::string>() != want) throw std::runtime_error("the trainer replicas differ");
    return want;
  };
  const std::string prompt = "ROMEO:\n";
  auto show = [&](twinkle::LazyCollect& sample, int after) {
    const std::string s = per_worker(sample.get())[0].as<std::string>();
    d.log("sample after step {}:\n{}{}", after, prompt, s);
  };

  int step = 0;
  double val = 0;  // the newest validation loss
  if (auto r = d.resumed()) {
    step = static_cast<int>(r->step);
    val = r->meta["val"].as<double>();
    d.log("resumed after step {} (validation loss {})", step, fixed(val, 4));
  }
  std::string weights = sync();
  std::optional<twinkle::LazyCollect> sample;
  int sample_step = step;
  double compute = 0, comm = 0, wall = 0;  // seconds, over the steps of this run
  const auto start = std::chrono::steady_clock::now();
  const int first = step;
  while (step < steps) {
    // The steps to the next evaluation go out at once; the trainer runs them in order.
    const int until = std::min(steps, (step / eval_every + 1) * eval_every);
    const auto sent = std::chrono::steady_clock::now();
    std::vector<twinkle::LazyCollect> pending;
    for (int s = step + 1; s <= until; ++s)
      pending.push_back(
          trainer.call("step", offsets(static_cast<std::uint64_t>(s), batch, 0, n_train)));
    double train = 0;
    for (auto& p : pending) {
      train += p.get()["loss"].as<double>();
      compute += p.get()["compute_s"].as<double>();
      comm += p.get()["comm_s"].as<double>();
    }
    wall += seconds_since(sent);
    train /= static_cast<double>(pending.size());
    step = until;
    val = trainer.call("evaluate", validation).get().as<double>();
    d.log("step {}  train {}  val {}", step, fixed(train, 4), fixed(val, 4));
    d.checkpoint(step, Value::map({{"val", val}}));  // no-op without a checkpoint_dir
    if (step % sync_every == 0 || step == steps) {
      if (sample) show(*sample, sample_step);
      weights = sync();
      d.log("weights synced after step {}: {} (trainer = every sampler)", step, weights);
      sample = sampler.call("generate", prompt, sample_chars, std::int64_t(step));
      sample_step = step;
    }
    if (d.stop_requested()) {
      d.log("stopping after step {} as asked", step);
      return;
    }
  }
  if (sample) show(*sample, sample_step);
  const double elapsed = seconds_since(start);
  const double tokens = double(step - first) * double(batch) * double(context);
  const double per_step = 1e3 / std::max(1, step - first);  // ms per step, from seconds
  d.log("throughput: {} tokens/s ({} steps in {} s, evaluations and samples included)",
        fixed(tokens / elapsed, 0), step - first, fixed(elapsed, 1));
  d.log(
      "per step: {} ms, of which torch {} ms, all_reduce {} ms, twinkle's dispatch and collect "
      "{} ms",
      fixed(wall * per_step, 2), fixed(compute * per_step, 2), fixed(comm * per_step, 2),
      fixed((wall - compute - comm) * per_step, 2));
  if (syncs > 0) {
    d.log(
        "weight broadcast: {} KiB in {} ms (a memcpy of them: {} ms; the first, which forms "
        "the communicator: {} ms)",
        weight_bytes / 1024, fixed(1e3 * broadcast_s / syncs, 3), fixed(1e3 * memcpy_s / syncs, 3),
        fixed(1e3 * first_sync_s, 3));
  }
  d.log("validation loss: {} (target {})", fixed(val, 4), fixed(target, 2));
  if (val > target)
    throw std::runtime_error("validation loss " + fixed(val, 4) + " is above the target " +
                             fixed(target, 2));
}

TWINKLE_PLUGIN("gpt", "1.0.0");
