// twinkle/torch.hpp: libtorch tensors in Twinkle plugins (twinkle-plugin(7), LIBTORCH).
//
// Optional: only a plugin that includes this header needs libtorch (it links torch, torch_cpu and
// c10; the SDK's pkg-config and CMake files say how). Nothing else in the SDK depends on it.
//
//   at::Tensor a = twinkle::torch::view(t);        // a twinkle::Tensor as an at::Tensor, no copy
//   twinkle::Tensor r = twinkle::torch::from(a);   // an at::Tensor as a twinkle::Tensor
//   twinkle::torch::all_reduce(ctx.comm("dp"), grad, twinkle::ReduceOp::mean);  // in place
//
// Memory and lifetime:
// - view(t) aliases t's memory (a dispatched argument's shared-memory segment, a received
//   result's buffer): writes through either are seen by the other. The view keeps that memory
//   mapped for as long as it (or any tensor sharing its storage) lives, even after t is gone.
//   Treat a view of a method's argument as read-only (clone() it to write): every worker that
//   received the same argument may map the same segment, and a tensor restored from a checkpoint
//   is a read-only mapping of the file.
// - from(a) aliases a's memory when a is contiguous and on the CPU: the twinkle::Tensor keeps a's
//   storage alive. Otherwise (a CUDA tensor, a transposed or strided view) it COPIES into a new
//   contiguous CPU buffer; is_alias() says which happened. A tensor that requires grad is detached
//   first (its values, not its graph, cross to other workers).
// - The collectives work in place on the tensor's own memory when it is contiguous; a
//   non-contiguous tensor goes through a contiguous copy that is written back. The tensor must
//   live where the group's collectives do: on the CPU for cpu groups, on the GPU for cuda groups
//   (NCCL; not tested here without a GPU).
//
// dtypes map both ways: float32, float64, float16, bfloat16, int8, uint8, int32, int64, bool.
// Any other (complex, int16, quantised) is a twinkle::ValueError that names it.
#pragma once

#include <twinkle/plugin.hpp>

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

namespace twinkle::torch {

// The at::ScalarType of a twinkle dtype.
inline at::ScalarType scalar_type(DType d) {
  switch (d) {
    case DType::f32: return at::kFloat;
    case DType::f64: return at::kDouble;
    case DType::f16: return at::kHalf;
    case DType::bf16: return at::kBFloat16;
    case DType::i8: return at::kChar;
    case DType::u8: return at::kByte;
    case DType::i32: return at::kInt;
    case DType::i64: return at::kLong;
    case DType::boolean: return at::kBool;
  }
  throw ValueError("twinkle::torch: unknown twinkle dtype " + std::to_string(static_cast<int>(d)));
}

// The twinkle dtype of an at::ScalarType; a ValueError for one Twinkle cannot carry.
inline DType twinkle_dtype(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return DType::f32;
    case at::kDouble: return DType::f64;
    case at::kHalf: return DType::f16;
    case at::kBFloat16: return DType::bf16;
    case at::kChar: return DType::i8;
    case at::kByte: return DType::u8;
    case at::kInt: return DType::i32;
    case at::kLong: return DType::i64;
    case at::kBool: return DType::boolean;
    default: break;
  }
  throw ValueError(std::string("twinkle::torch: torch dtype ") + c10::toString(s) +
                   " has no twinkle dtype; convert it first (e.g. .to(torch::kFloat)); twinkle "
                   "carries float32, float64, float16, bfloat16, int8, uint8, int32, int64 and "
                   "bool");
}

// `t` as an at::Tensor on the CPU, sharing its memory (no copy). The view keeps t's storage alive.
inline at::Tensor view(const Tensor& t) {
  if (!t.defined()) throw ValueError("twinkle::torch::view: the tensor is empty (default-made)");
  std::vector<std::int64_t> sizes(t.shape().begin(), t.shape().end());
  Tensor keep = t;  // copies share the storage: this one lives as long as the at::Tensor's
  void* data = const_cast<std::byte*>(t.data());
  return at::from_blob(
      data, sizes, [keep](void*) mutable { keep = Tensor(); },
      at::TensorOptions().dtype(scalar_type(t.dtype())).device(at::kCPU));
}

// `a` as a twinkle::Tensor: aliasing a's memory when a is contiguous on the CPU, a contiguous CPU
// copy otherwise (see the header's comment).
inline Tensor from(const at::Tensor& a) {
  if (!a.defined()) throw ValueError("twinkle::torch::from: the at::Tensor is undefined");
  const DType d = twinkle_dtype(a.scalar_type());
  at::Tensor held = a.detach();
  if (!held.device().is_cpu() || !held.is_contiguous()) held = held.to(at::kCPU).contiguous();
  std::vector<std::int64_t> shape(held.sizes().begin(), held.sizes().end());
  const auto nbytes = static_cast<std::size_t>(held.numel()) * held.element_size();
  void* data = held.data_ptr();
  auto owner = std::make_shared<at::Tensor>(std::move(held));
  return Tensor::view(d, std::move(shape), data, nbytes, std::move(owner));
}

// True when from(a) would share a's memory rather than copy it.
inline bool is_alias(const at::Tensor& a) {
  return a.defined() && a.device().is_cpu() && a.is_contiguous();
}

namespace detail {
// Runs `op` on the contiguous memory of `a`: a's own when it is contiguous, else a copy that is
// written back into `a` afterwards.
template <class Op>
void in_place(const at::Tensor& a, const char* what, Op op) {
  if (!a.defined()) throw CollectiveError(std::string(what) + ": the at::Tensor is undefined");
  const DType d = twinkle_dtype(a.scalar_type());
  if (a.is_contiguous()) {
    op(a.data_ptr(), static_cast<std::size_t>(a.numel()), d);
    // Written behind torch's back: autograd learns of it as of any in-place op.
    auto* impl = a.unsafeGetTensorImpl();
    if (impl->version_counter().enabled()) impl->bump_version();
    return;
  }
  at::Tensor c = a.contiguous();
  op(c.data_ptr(), static_cast<std::size_t>(c.numel()), d);
  a.copy_(c);
}
}  // namespace detail

// The collectives of twinkle::Communicator on at::Tensors (every member makes the same calls in
// the same order). In place on the tensor's data: a const at::Tensor& is a handle, its data is
// written (a parameter's p.grad() is passed as it is). Use a tensor that requires grad only under
// torch::NoGradGuard, as with torch.distributed.
inline void all_reduce(const Communicator& c, const at::Tensor& a, ReduceOp op = ReduceOp::sum) {
  detail::in_place(a, "all_reduce",
                   [&](void* p, std::size_t n, DType d) { c.all_reduce(p, n, d, op); });
}

inline void broadcast(const Communicator& c, const at::Tensor& a, int root = 0) {
  detail::in_place(a, "broadcast",
                   [&](void* p, std::size_t n, DType d) { c.broadcast(p, n, d, root); });
}

// Every rank's `in` concatenated along dim 0 (rank r's part at rows r x in.size(0)), on in's
// device.
inline at::Tensor all_gather(const Communicator& c, const at::Tensor& in) {
  if (!in.defined()) throw CollectiveError("all_gather: the at::Tensor is undefined");
  const DType d = twinkle_dtype(in.scalar_type());
  at::Tensor src = in.contiguous();
  std::vector<std::int64_t> shape(src.sizes().begin(), src.sizes().end());
  if (shape.empty()) shape = {1};
  shape[0] *= c.size();
  at::Tensor out = at::empty(shape, src.options());
  c.all_gather(src.data_ptr(), out.data_ptr(), static_cast<std::size_t>(src.numel()), d);
  return out;
}

// `in` holds size() parts of out's size along dim 0; `out` receives the reduction of part rank().
inline void reduce_scatter(const Communicator& c, const at::Tensor& in, const at::Tensor& out,
                           ReduceOp op = ReduceOp::sum) {
  if (!in.defined() || !out.defined())
    throw CollectiveError("reduce_scatter: an at::Tensor is undefined");
  if (in.scalar_type() != out.scalar_type()) {
    throw CollectiveError(std::string("reduce_scatter: in holds ") +
                          c10::toString(in.scalar_type()) + ", out holds " +
                          c10::toString(out.scalar_type()));
  }
  if (in.numel() != out.numel() * c.size()) {
    throw CollectiveError("reduce_scatter: in has " + std::to_string(in.numel()) +
                          " elements, needs " + std::to_string(out.numel() * c.size()) +
                          " (out's " + std::to_string(out.numel()) + " x " +
                          std::to_string(c.size()) + " ranks)");
  }
  at::Tensor src = in.contiguous();
  detail::in_place(out, "reduce_scatter", [&](void* p, std::size_t n, DType d) {
    c.reduce_scatter(src.data_ptr(), p, n, d, op);
  });
}

}  // namespace twinkle::torch
