#include "transports/gloo/communicator.hpp"

#include <cstring>
#include <vector>

#include <fmt/format.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include "twinkle/errors.hpp"

namespace twinkle::transport {

namespace {

// Gloo's view of our store, with keys under the communicator's name.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(KvStore& store, std::string prefix, std::chrono::milliseconds timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(prefix_ + "/" + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    std::string v = store_.get(prefix_ + "/" + key, timeout_);
    return {v.begin(), v.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    for (const auto& k : keys) store_.get(prefix_ + "/" + k, timeout);
  }

 private:
  KvStore& store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

template <class T>
gloo::AllreduceOptions::Func reducer(ReduceOp op) {
  using Fn = void (*)(void*, const void*, const void*, std::size_t);
  switch (op) {
    case ReduceOp::max: return static_cast<Fn>(&gloo::max<T>);
    case ReduceOp::min: return static_cast<Fn>(&gloo::min<T>);
    default: return static_cast<Fn>(&gloo::sum<T>);
  }
}

// Calls f with a typed null pointer of the element type of `dtype`.
template <class F>
void with_type(DType dtype, bool reduction, F&& f) {
  switch (dtype) {
    case DType::f32: return f(static_cast<float*>(nullptr));
    case DType::f64: return f(static_cast<double*>(nullptr));
    case DType::i32: return f(static_cast<std::int32_t*>(nullptr));
    case DType::i64: return f(static_cast<std::int64_t*>(nullptr));
    case DType::u8: return f(static_cast<std::uint8_t*>(nullptr));
    case DType::i8: return f(static_cast<std::int8_t*>(nullptr));
    case DType::f16: return f(static_cast<gloo::float16*>(nullptr));
    case DType::boolean:
      if (!reduction) return f(static_cast<std::uint8_t*>(nullptr));
      break;
    case DType::bf16:
      if (!reduction) return f(static_cast<std::uint16_t*>(nullptr));
      break;
  }
  throw TransportError(
      fmt::format("{} reductions are not supported on cpu groups (Gloo); use float32, float64, "
                  "int32, int64, int8, uint8 or float16",
                  dtype_name(dtype)));
}

template <class T>
void divide(void* data, std::size_t count, int n) {
  auto* p = static_cast<T*>(data);
  if constexpr (std::is_same_v<T, gloo::float16>) {
    for (std::size_t i = 0; i < count; ++i)
      p[i] = gloo::float16(static_cast<double>(gloo::cpu_half2float(p[i]) / static_cast<float>(n)));
  } else {
    for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(n));
  }
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(KvStore& store, const CommConfig& c) : config_(c) {
    if (c.size <= 1) return;  // a single member needs no connections
    try {
      gloo::transport::tcp::attr attr(c.host.c_str());
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto ctx = std::make_shared<gloo::rendezvous::Context>(c.rank, c.size);
      ctx->setTimeout(c.timeout);
      GlooStore gs(store, c.name, c.timeout);
      ctx->connectFullMesh(gs, device);
      context_ = ctx;
    } catch (const gloo::Exception& e) {
      throw TransportError(fmt::format("connecting {} ({} members): {}", c.name, c.size, e.what()));
    }
  }

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }

  void all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op) override {
    if (config_.size <= 1 || count == 0) return;
    guard("all_reduce", [&] {
      with_type(dtype, true, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        gloo::AllreduceOptions opts(context_);
        opts.setOutput(static_cast<T*>(data), count);
        opts.setReduceFunction(reducer<T>(op));
        opts.setTimeout(config_.timeout);
        gloo::allreduce(opts);
        if (op == ReduceOp::mean) divide<T>(data, count, config_.size);
      });
    });
  }

  void broadcast(void* data, std::size_t count, DType dtype, int root) override {
    check_root(root);
    if (config_.size <= 1 || count == 0) return;
    guard("broadcast", [&] {
      with_type(dtype, false, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        gloo::BroadcastOptions opts(context_);
        opts.setOutput(static_cast<T*>(data), count);
        opts.setRoot(root);
        opts.setTimeout(config_.timeout);
        gloo::broadcast(opts);
      });
    });
  }

  void all_gather(const void* in, void* out, std::size_t count, DType dtype) override {
    const std::size_t bytes = count * dtype_size(dtype);
    if (config_.size <= 1 || count == 0) {
      if (bytes) std::memmove(out, in, bytes);
      return;
    }
    guard("all_gather", [&] {
      with_type(dtype, false, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        gloo::AllgatherOptions opts(context_);
        opts.setInput(const_cast<T*>(static_cast<const T*>(in)), count);
        opts.setOutput(static_cast<T*>(out), count * static_cast<std::size_t>(config_.size));
        opts.setTimeout(config_.timeout);
        gloo::allgather(opts);
      });
    });
  }

  void reduce_scatter(const void* in, void* out, std::size_t count, DType dtype,
                      ReduceOp op) override {
    // All-reduce of the whole input, then this member's part: simple, and exact for every op.
    const std::size_t bytes = count * dtype_size(dtype);
    std::vector<std::byte> all(bytes * static_cast<std::size_t>(config_.size));
    if (!all.empty()) std::memcpy(all.data(), in, all.size());
    all_reduce(all.data(), count * static_cast<std::size_t>(config_.size), dtype, op);
    if (bytes) std::memcpy(out, all.data() + bytes * static_cast<std::size_t>(config_.rank), bytes);
  }

  void barrier() override {
    if (config_.size <= 1) return;
    guard("barrier", [&] {
      gloo::BarrierOptions opts(context_);
      opts.setTimeout(config_.timeout);
      gloo::barrier(opts);
    });
  }

 private:
  void check_root(int root) const {
    if (root < 0 || root >= config_.size) {
      throw TransportError(
          fmt::format("broadcast root {} is outside the communicator of {}", root, config_.size));
    }
  }

  template <class F>
  void guard(const char* op, F&& f) {
    if (broken_) {
      throw TransportError(fmt::format(
          "{} on {}: the communicator failed earlier and cannot be used again", op, config_.name));
    }
    try {
      f();
    } catch (const gloo::Exception& e) {
      // Gloo's context cannot be used after a failed operation.
      broken_ = true;
      throw TransportError(fmt::format("{} on {} failed (a peer died, hung or disconnected): {}",
                                       op, config_.name, e.what()));
    }
  }

  CommConfig config_;
  std::shared_ptr<gloo::Context> context_;
  bool broken_ = false;
};

}  // namespace

}  // namespace twinkle::transport

// The module's entry: a new communicator that the caller owns. Errors are exceptions (the module
// and the binary share one C++ runtime).
extern "C" __attribute__((visibility("default"))) twinkle::transport::Communicator*
twinkle_gloo_create_v1(twinkle::transport::KvStore* store,
                       const twinkle::transport::CommConfig* config) {
  return new twinkle::transport::GlooCommunicator(*store, *config);
}
