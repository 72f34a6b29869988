// Data-parallel training of a one-hidden-layer MLP on the handwritten digits data.
//
// The driver reads data/digits.csv.gz, shuffles it with the job's seed, keeps 80% for training
// and 20% for a held-out test, and each step sends one global batch with dispatch slice_dp. Every
// worker of the "model" group computes the loss and gradient sums of its slice, the workers add
// them up with all_reduce over the dp communicator, and all take the same SGD step, so their
// parameters stay identical. The result does not depend on the number of workers (up to float
// rounding): a 1-worker run of the same job reaches the same loss.
//
// Checkpoints: the model's state is its parameters and velocities (TWINKLE_STATE). With a
// [job] checkpoint_dir the driver checkpoints after every epoch, with the epoch as the step;
// `twinkle run --resume` continues from the newest and ends with the same final loss, bit for
// bit, as a run that was never stopped. On SIGTERM or SIGUSR1 the driver finishes the epoch,
// checkpoints and returns (the run exits with 75).
//
// Restarts: with [[group]] max_restarts, a lost worker is replaced (only it: restart = "worker",
// the default) and takes the state of a surviving replica (recover = "peer", the default), or the
// whole group restarts from the newest checkpoint (restart = "group"). A replica's state is the
// one it committed at the end of its last epoch (finish_epoch), as Horovod's state.commit(): the
// driver gets twinkle::WorkerLost, rolls every replica back to its committed state, which says
// which epoch it is at, and goes on from there, so no step is applied twice or lost.
// args.fail_at = "GROUP:RANK:EPOCH" makes that rank abort in that epoch, in its first life only
// ("GROUP:RANK:EPOCH:always": in every life; EPOCH 0: in its constructor, every life;
// "GROUP:RANK:EPOCH:stop": stop itself with SIGSTOP instead, a hung rank whose node a test then
// kills): for the tests.
#include <twinkle/plugin.hpp>

#include <zlib.h>

#ifdef DIGITS_HAVE_CUDA
#include "mlp_cuda.hpp"
#endif

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using twinkle::Context;
using twinkle::Tensor;
using twinkle::Value;

namespace {

constexpr int kFeatures = 64;
constexpr int kClasses = 10;

struct Dataset {
  std::vector<float> x;  // rows x 64, scaled to [0, 1]
  std::vector<std::int64_t> y;
  std::size_t rows() const { return y.size(); }
};

// Data files are read only when they are regular files of a bounded size: a FIFO or a device
// (/dev/zero) as args.data must not hang the driver or fill its memory.
constexpr std::uintmax_t kMaxDataBytes = std::uintmax_t{256} << 20;
constexpr int kMaxRows = 1'000'000;

Dataset read_digits(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::is_regular_file(status)) {
    throw std::runtime_error(path +
                             " is not a regular file; set args.data to the digits.csv.gz file");
  }
  if (std::filesystem::file_size(path, ec) > kMaxDataBytes) {
    throw std::runtime_error(path + " is larger than 256 MiB; this example reads a small data set");
  }
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f)
    throw std::runtime_error("cannot open " + path + "; set args.data to the digits.csv.gz file");
  Dataset d;
  char line[4096];
  int row = 0;
  while (gzgets(f, line, sizeof line)) {
    ++row;
    std::stringstream ss(line);
    std::vector<int> v;
    bool numbers = true;
    for (std::string cell; std::getline(ss, cell, ',');) {
      char* end = nullptr;
      const long n = std::strtol(cell.c_str(), &end, 10);
      numbers &= end != cell.c_str() && (*end == '\0' || *end == '\n' || *end == '\r') && n >= 0 &&
                 n <= 16;
      v.push_back(static_cast<int>(n));
    }
    if (!numbers || row > kMaxRows || v.size() != kFeatures + 1 || v.back() < 0 ||
        v.back() >= kClasses) {
      gzclose(f);
      throw std::runtime_error(
          path + ":" + std::to_string(row) +
          ": expected 64 pixels 0..16 and a label 0..9 (at most 1,000,000 rows)");
    }
    for (int i = 0; i < kFeatures; ++i) d.x.push_back(static_cast<float>(v[i]) / 16.0f);
    d.y.push_back(v.back());
  }
  gzclose(f);
  return d;
}

// Rows `idx` of `d` as tensors X [n, 64] float32 and y [n] int64.
std::pair<Tensor, Tensor> take(const Dataset& d, std::span<const std::size_t> idx) {
  const auto n = static_cast<std::int64_t>(idx.size());
  Tensor x(twinkle::DType::f32, {n, kFeatures});
  Tensor y(twinkle::DType::i64, {n});
  auto xs = x.mutable_span<float>();
  auto ys = y.mutable_span<std::int64_t>();
  for (std::size_t i = 0; i < idx.size(); ++i) {
    std::copy_n(d.x.begin() + static_cast<std::ptrdiff_t>(idx[i] * kFeatures), kFeatures,
                xs.begin() + i * kFeatures);
    ys[i] = d.y[idx[i]];
  }
  return {x, y};
}

}  // namespace

// One replica of the model on each worker of the group.
class Mlp {
 public:
  Mlp(Context& ctx, const Value& args)
      : hidden_(args[0]["hidden"].as<int>()),
        lr_(args[0]["lr"].as<double>()),
        momentum_(args[0]["momentum"].as<double>()) {
    if (args[0].contains("fail_at")) fail_at(ctx, args[0]["fail_at"].as<std::string>());
    // The same seed everywhere: the replicas start equal and stay equal.
    std::mt19937_64 rng(static_cast<std::uint64_t>(args[0]["seed"].as<std::int64_t>()));
    auto init = [&](std::vector<double>& w, int fan_in, int fan_out) {
      const double a = std::sqrt(6.0 / (fan_in + fan_out));
      std::uniform_real_distribution<double> u(-a, a);
      for (auto& v : w) v = u(rng);
    };
    params_.assign(size(), 0.0);
    velocity_.assign(size(), 0.0);
    std::vector<double> w1(kFeatures * hidden_), w2(static_cast<std::size_t>(hidden_) * kClasses);
    init(w1, kFeatures, hidden_);
    init(w2, hidden_, kClasses);
    std::copy(w1.begin(), w1.end(), params_.begin());
    std::copy(w2.begin(), w2.end(), params_.begin() + static_cast<std::ptrdiff_t>(w2_at()));
    committed_params_ = params_;
    committed_velocity_ = velocity_;
    if (ctx.device() == "cuda") {
#ifdef DIGITS_HAVE_CUDA
      // The same initial parameters, then everything happens on the GPU; NCCL sums the gradients.
      cuda_ = std::make_unique<CudaMlp>(hidden_, params_, lr_, momentum_);
#else
      throw std::runtime_error(
          "this build of the digits example has no CUDA kernels (the CUDA toolkit was not "
          "found when it was built); run the cpu job or rebuild where CUDA is installed");
#endif
    }
    ctx.log("MLP 64-{}-10 on rank {} (dp rank {} of {})", hidden_, ctx.rank(), ctx.rank_in("dp"),
            ctx.size_of("dp"));
  }

  // Forward and backward on this worker's slice; the sums of all slices are added with
  // all_reduce, then every replica takes the same step. Returns the global batch's mean loss.
  Value train_step(Context& ctx, const Tensor& x, const Tensor& y) {
    if (fail_epoch_ > 0 && epoch_ + 1 == fail_epoch_) {  // args.fail_at, for tests
      if (!stop_) std::abort();
      ::raise(SIGSTOP);
    }
#ifdef DIGITS_HAVE_CUDA
    if (cuda_) {
      double* grad = cuda_->gradients(x.span<float>().data(), y.span<std::int64_t>().data(),
                                      static_cast<int>(y.numel()));
      ctx.comm("dp").all_reduce(grad, cuda_->grad_size(), twinkle::DType::f64);
      const auto [loss, rows] = cuda_->step();
      return Value::map({{"loss", loss}, {"rows", static_cast<std::int64_t>(rows)}});
    }
#endif
    std::vector<double> grad(size() + 2, 0.0);  // gradients, then loss sum and row count
    const double loss = forward_backward(x, y, &grad);
    grad[size()] = loss;
    grad[size() + 1] = static_cast<double>(y.numel());
    ctx.comm("dp").all_reduce(std::span<double>(grad));
    const double n = grad[size() + 1];
    for (std::size_t i = 0; i < size(); ++i) {
      velocity_[i] = momentum_ * velocity_[i] - lr_ * grad[i] / n;
      params_[i] += velocity_[i];
    }
    return Value::map({{"loss", grad[size()] / n}, {"rows", static_cast<std::int64_t>(n)}});
  }

  // An epoch is done on every replica (the driver says so): its state is committed.
  void finish_epoch(Context&, int epoch) {
    epoch_ = epoch;
#ifdef DIGITS_HAVE_CUDA
    if (cuda_) cuda_->download(params_, velocity_);
#endif
    committed_params_ = params_;
    committed_velocity_ = velocity_;
  }
  // Back to the committed state (after a lost worker, steps of an epoch may have run on some
  // replicas); returns the epochs it holds.
  int rollback(Context&) {
    params_ = committed_params_;
    velocity_ = committed_velocity_;
#ifdef DIGITS_HAVE_CUDA
    if (cuda_) cuda_->restore(params_, velocity_);
#endif
    return epoch_;
  }

  // The replica's committed state, for checkpoints and for a replacement's copy:
  // parameters, velocities and the epochs done.
  Value save(Context&) {
    return Value::map({{"params", Tensor::from(committed_params_)},
                       {"velocity", Tensor::from(committed_velocity_)},
                       {"epoch", epoch_}});
  }
  void load(Context&, const Value& state) {
    epoch_ = state["epoch"].as<int>();
    auto params = state["params"].tensor().span<double>();
    auto velocity = state["velocity"].tensor().span<double>();
    if (params.size() != size() || velocity.size() != size()) {
      throw std::runtime_error("the state holds a model of " + std::to_string(params.size()) +
                               " parameters, this one has " + std::to_string(size()) +
                               " (args.hidden changed?)");
    }
    params_.assign(params.begin(), params.end());
    velocity_.assign(velocity.begin(), velocity.end());
    committed_params_ = params_;
    committed_velocity_ = velocity_;
#ifdef DIGITS_HAVE_CUDA
    if (cuda_) cuda_->restore(params_, velocity_);
#endif
  }

  // Correct predictions and rows of this worker's slice (collect sum adds them up).
  Value evaluate(Context&, const Tensor& x, const Tensor& y) {
    std::int64_t correct = 0;
    const auto xs = x.span<float>();
    const auto ys = y.span<std::int64_t>();
#ifdef DIGITS_HAVE_CUDA
    if (cuda_) {
      correct = cuda_->evaluate(xs.data(), ys.data(), static_cast<int>(ys.size()));
      return Value::map({{"correct", correct}, {"rows", static_cast<std::int64_t>(ys.size())}});
    }
#endif
    std::vector<double> h(static_cast<std::size_t>(hidden_)), logits(kClasses);
    for (std::size_t r = 0; r < ys.size(); ++r) {
      forward(xs.subspan(r * kFeatures, kFeatures), h, logits);
      correct += std::max_element(logits.begin(), logits.end()) - logits.begin() == ys[r];
    }
    return Value::map({{"correct", correct}, {"rows", static_cast<std::int64_t>(ys.size())}});
  }

 private:
  // args.fail_at = "GROUP:RANK:EPOCH[:always|:stop]" for this rank: abort (or stop) in that
  // epoch, in the first life only or in every life (EPOCH 0: in the constructor, every life: a
  // crash loop).
  void fail_at(Context& ctx, const std::string& spec) {
    std::stringstream ss(spec);
    std::string group, rank, epoch;
    std::getline(ss, group, ':');
    std::getline(ss, rank, ':');
    std::getline(ss, epoch, ':');
    std::string always;
    std::getline(ss, always, ':');
    if (group != ctx.group() || rank != std::to_string(ctx.rank())) return;
    if (epoch == "0") std::abort();
    const char* restarts = std::getenv("TWINKLE_RESTART_COUNT");
    stop_ = always == "stop";
    if (always == "always" || !restarts || std::string(restarts) == "0")
      fail_epoch_ = std::stoi(epoch);
  }

  std::size_t size() const {
    return w2_at() + static_cast<std::size_t>(hidden_) * kClasses + kClasses;
  }
  std::size_t b1_at() const { return static_cast<std::size_t>(kFeatures) * hidden_; }
  std::size_t w2_at() const { return b1_at() + static_cast<std::size_t>(hidden_); }
  std::size_t b2_at() const { return w2_at() + static_cast<std::size_t>(hidden_) * kClasses; }

  void forward(std::span<const float> x, std::vector<double>& h,
               std::vector<double>& logits) const {
    for (int j = 0; j < hidden_; ++j) {
      double s = params_[b1_at() + j];
      for (int i = 0; i < kFeatures; ++i)
        s += x[i] * params_[static_cast<std::size_t>(i) * hidden_ + j];
      h[j] = s > 0 ? s : 0;  // ReLU
    }
    for (int k = 0; k < kClasses; ++k) {
      double s = params_[b2_at() + k];
      for (int j = 0; j < hidden_; ++j)
        s += h[j] * params_[w2_at() + static_cast<std::size_t>(j) * kClasses + k];
      logits[k] = s;
    }
  }

  // Adds this slice's gradient sums into `grad`; returns its summed cross-entropy loss.
  double forward_backward(const Tensor& x, const Tensor& y, std::vector<double>* grad) const {
    const auto xs = x.span<float>();
    const auto ys = y.span<std::int64_t>();
    std::vector<double> h(static_cast<std::size_t>(hidden_)), logits(kClasses),
        dh(static_cast<std::size_t>(hidden_));
    double loss = 0;
    auto& g = *grad;
    for (std::size_t r = 0; r < ys.size(); ++r) {
      auto xr = xs.subspan(r * kFeatures, kFeatures);
      forward(xr, h, logits);
      const double top = *std::max_element(logits.begin(), logits.end());
      double z = 0;
      for (double l : logits) z += std::exp(l - top);
      loss += -(logits[ys[r]] - top - std::log(z));
      std::fill(dh.begin(), dh.end(), 0.0);
      for (int k = 0; k < kClasses; ++k) {
        const double dl = std::exp(logits[k] - top) / z - (k == ys[r] ? 1.0 : 0.0);
        g[b2_at() + k] += dl;
        for (int j = 0; j < hidden_; ++j) {
          g[w2_at() + static_cast<std::size_t>(j) * kClasses + k] += dl * h[j];
          dh[j] += dl * params_[w2_at() + static_cast<std::size_t>(j) * kClasses + k];
        }
      }
      for (int j = 0; j < hidden_; ++j) {
        if (h[j] <= 0) continue;
        g[b1_at() + j] += dh[j];
        for (int i = 0; i < kFeatures; ++i)
          g[static_cast<std::size_t>(i) * hidden_ + j] += dh[j] * xr[i];
      }
    }
    return loss;
  }

  int hidden_;
  double lr_;
  double momentum_;
  int epoch_ = 0;               // epochs trained
  int fail_epoch_ = 0;          // args.fail_at for this rank (0: none)
  bool stop_ = false;           // args.fail_at's ":stop": SIGSTOP instead of abort
  std::vector<double> params_;  // W1 [64 x H], b1 [H], W2 [H x 10], b2 [10]
  std::vector<double> velocity_;
  std::vector<double> committed_params_;  // as they were at the end of epoch_
  std::vector<double> committed_velocity_;
#ifdef DIGITS_HAVE_CUDA
  std::unique_ptr<CudaMlp> cuda_;
#endif
};

TWINKLE_CLASS(Mlp, twinkle::execute::all);
TWINKLE_STATE(Mlp, save, load);
TWINKLE_METHOD(Mlp, train_step, twinkle::dispatch::slice_dp, twinkle::collect::mean);
TWINKLE_METHOD(Mlp, evaluate, twinkle::dispatch::slice_dp, twinkle::collect::sum);
TWINKLE_METHOD(Mlp, finish_epoch, twinkle::dispatch::all, twinkle::collect::first);
TWINKLE_METHOD(Mlp, rollback, twinkle::dispatch::all, twinkle::collect::first);

TWINKLE_DRIVER(main, twinkle::Driver& d) {
  const Value& args = d.args();
  const std::int64_t seed = args["seed"].as<std::int64_t>();
  const int epochs = args["epochs"].as<int>();
  const std::size_t batch = args["batch"].as<std::size_t>();

  const Dataset data = read_digits(d.job_path(args["data"].as<std::string>()));
  const std::size_t n_train = data.rows() * 8 / 10;
  std::mt19937_64 rng;
  auto shuffle = [&](std::vector<std::size_t>& v) {
    for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng() % i]);
  };
  // The split and the training order after `done` epochs: the shuffles from the seed on, so that
  // a run that goes on from a checkpoint sees the order an uninterrupted one would have.
  std::vector<std::size_t> train, test;
  auto rewind = [&](int done) {
    rng.seed(static_cast<std::uint64_t>(seed));
    std::vector<std::size_t> order(data.rows());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    shuffle(order);
    train.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(n_train));
    test.assign(order.begin() + static_cast<std::ptrdiff_t>(n_train), order.end());
    for (int e = 0; e < done; ++e) shuffle(train);
  };
  rewind(0);
  d.log("digits: {} samples, {} for training, {} held out; batch {}, {} epochs", data.rows(),
        train.size(), test.size(), batch, epochs);

  Value model_args = Value::map({{"hidden", args["hidden"]},
                                 {"lr", args["lr"]},
                                 {"momentum", args["momentum"]},
                                 {"seed", seed}});
  if (args.contains("fail_at")) model_args.map_items()["fail_at"] = args["fail_at"];
  auto model = d.create<Mlp>("model", model_args);
  // A resumed run: the model has its state back; the loss of every epoch done is known.
  int epoch = 1;
  std::vector<double> losses(static_cast<std::size_t>(epochs) + 1, 0.0);
  if (auto r = d.resumed()) {
    const int done = static_cast<int>(r->step);
    if (done <= epochs) losses[static_cast<std::size_t>(done)] = r->meta["loss"].as<double>();
    rewind(done);
    epoch = done + 1;
    d.log("resumed after epoch {}", done);
  }
  Value eval;
  for (;;) {
    try {
      for (; epoch <= epochs; ++epoch) {
        shuffle(train);
        // Every step of the epoch is sent at once; the workers run them in order.
        std::vector<twinkle::LazyCollect> steps;
        for (std::size_t at = 0; at < train.size(); at += batch) {
          const std::size_t n = std::min(batch, train.size() - at);
          auto [x, y] = take(data, std::span<const std::size_t>(train).subspan(at, n));
          steps.push_back(model.call("train_step", x, y));
        }
        double loss_sum = 0;
        std::int64_t rows = 0;
        for (auto& s : steps) {
          // Every replica reports the same global values; collect mean keeps them (as doubles).
          const double n = s.get()["rows"].as<double>();
          loss_sum += s.get()["loss"].as<double>() * n;
          rows += static_cast<std::int64_t>(n);
        }
        losses[static_cast<std::size_t>(epoch)] = loss_sum / static_cast<double>(rows);
        d.log("epoch {}  loss {}", epoch, losses[static_cast<std::size_t>(epoch)]);
        model.call("finish_epoch", epoch).get();
        // No-op without a checkpoint_dir.
        d.checkpoint(epoch, Value::map({{"loss", losses[static_cast<std::size_t>(epoch)]}}));
        if (d.stop_requested()) {
          d.log("stopping after epoch {} as asked", epoch);
          return;
        }
      }
      auto [x, y] = take(data, test);
      eval = model.call("evaluate", x, y).get();
      break;
    } catch (const twinkle::WorkerLost& e) {
      // A worker was replaced (with a replica's state, the newest checkpoint's, or fresh):
      // every replica goes back to its committed state, and the run goes on from its epoch.
      const int at = model.call("rollback").get().as<int>();
      d.log(
          "a model worker was lost in epoch {}; the group is back at epoch {}, going on from "
          "there",
          epoch, at);
      rewind(at);
      epoch = at + 1;
    }
  }
  char line[64];
  std::snprintf(line, sizeof line, "%.6f", losses[static_cast<std::size_t>(epochs)]);
  d.log("final loss: {}", std::string(line));
  std::snprintf(line, sizeof line, "%.3f",
                eval["correct"].as<double>() / eval["rows"].as<double>());
  d.log("accuracy: {}", std::string(line));
}

TWINKLE_PLUGIN("digits", "1.0.0");
