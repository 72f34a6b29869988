#include "transports/nccl/communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::transport {

namespace {

void check_cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw TransportError(fmt::format("{}: CUDA error: {}", what, cudaGetErrorString(rc)));
}

void check_nccl(ncclResult_t rc, const char* what) {
  if (rc != ncclSuccess && rc != ncclInProgress) {
    throw TransportError(fmt::format("{}: NCCL error: {}", what, ncclGetErrorString(rc)));
  }
}

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
    case DType::i8: return ncclInt8;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::boolean: break;
  }
  throw TransportError(fmt::format("{} is not supported by NCCL collectives", dtype_name(d)));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::mean: return ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(KvStore& store, const CommConfig& c) : config_(c) {
    ncclUniqueId id;
    const std::string key = c.name + "/nccl-unique-id";
    if (c.rank == 0) {
      check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
      store.set(key, std::string(reinterpret_cast<const char*>(&id), sizeof id));
    } else {
      std::string v = store.get(key, c.timeout);
      if (v.size() != sizeof id)
        throw TransportError(fmt::format("{}: malformed NCCL unique id", c.name));
      std::memcpy(&id, v.data(), sizeof id);
    }
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check_nccl(ncclCommInitRank(&comm_, c.size, id, c.rank), "ncclCommInitRank");
    check_cuda(cudaMalloc(&scratch_, sizeof(float)), "cudaMalloc");
  }

  ~NcclCommunicator() override {
    if (comm_) ncclCommDestroy(comm_);
    if (scratch_) cudaFree(scratch_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return config_.rank; }
  // After a failure NCCL's communicator is aborted: later calls must not reach it.
  void usable(const char* op) const {
    if (!comm_) {
      throw TransportError(fmt::format(
          "{} on {}: the communicator failed earlier and cannot be used again", op, config_.name));
    }
  }
  int size() const override { return config_.size; }

  void all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op) override {
    usable("all_reduce");
    check_nccl(ncclAllReduce(data, data, count, nccl_type(dtype), nccl_op(op), comm_, stream_),
               "ncclAllReduce");
    finish("all_reduce");
  }
  void broadcast(void* data, std::size_t count, DType dtype, int root) override {
    usable("broadcast");
    check_nccl(ncclBroadcast(data, data, count, nccl_type(dtype), root, comm_, stream_),
               "ncclBroadcast");
    finish("broadcast");
  }
  void all_gather(const void* in, void* out, std::size_t count, DType dtype) override {
    usable("all_gather");
    check_nccl(ncclAllGather(in, out, count, nccl_type(dtype), comm_, stream_), "ncclAllGather");
    finish("all_gather");
  }
  void reduce_scatter(const void* in, void* out, std::size_t count, DType dtype,
                      ReduceOp op) override {
    check_nccl(ncclReduceScatter(in, out, count, nccl_type(dtype), nccl_op(op), comm_, stream_),
               "ncclReduceScatter");
    finish("reduce_scatter");
  }
  void barrier() override { all_reduce(scratch_, 1, DType::f32, ReduceOp::sum); }

 private:
  // Waits for the stream; a peer failure shows as NCCL's async error or as the deadline passing.
  void finish(const char* op) {
    const auto deadline = std::chrono::steady_clock::now() + config_.timeout;
    for (;;) {
      cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) check_cuda(q, op);
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        throw TransportError(fmt::format("{} on {} failed (a peer died or disconnected): {}", op,
                                         config_.name, ncclGetErrorString(async)));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        throw TransportError(fmt::format("{} on {} timed out after {} ms (a peer hung)", op,
                                         config_.name, config_.timeout.count()));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  CommConfig config_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
};

}  // namespace

}  // namespace twinkle::transport

// The module's entry: a new communicator that the caller owns. Errors are exceptions (the module
// and the binary share one C++ runtime).
extern "C" __attribute__((visibility("default"))) twinkle::transport::Communicator*
twinkle_nccl_create_v1(twinkle::transport::KvStore* store,
                       const twinkle::transport::CommConfig* config) {
  return new twinkle::transport::NcclCommunicator(*store, *config);
}
