#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

// The digits MLP on a CUDA device (mlp_cuda.cu): the same model and arithmetic (double
// precision) as the CPU path in digits.cpp, with the parameters, the batch and the gradients in
// device memory so that NCCL all-reduces the gradients where they are.
class CudaMlp {
 public:
  // `params` are the initial parameters in the CPU layout: W1 [64 x H], b1 [H], W2 [H x 10], b2
  // [10].
  CudaMlp(int hidden, const std::vector<double>& params, double lr, double momentum);
  ~CudaMlp();
  CudaMlp(const CudaMlp&) = delete;
  CudaMlp& operator=(const CudaMlp&) = delete;

  // Gradient sums of a batch, followed by the loss sum and the row count: a device buffer of
  // grad_size() doubles, ready for all_reduce.
  double* gradients(const float* x, const std::int64_t* y, int rows);
  std::size_t grad_size() const { return size_ + 2; }
  // One SGD-with-momentum step from the (all-reduced) gradient buffer; returns the batch's mean
  // loss and its row count.
  std::pair<double, double> step();
  // Correct predictions on rows.
  std::int64_t evaluate(const float* x, const std::int64_t* y, int rows);
  // The parameters and velocities in the CPU layout (checkpoints), and back.
  void download(std::vector<double>& params, std::vector<double>& velocity) const;
  void restore(const std::vector<double>& params, const std::vector<double>& velocity);

 private:
  struct Device;
  void upload(const float* x, const std::int64_t* y, int rows);
  void forward(const float* x, const std::int64_t* y, int rows);
  // Offsets in the parameter (and gradient) buffer: W1 at 0, then b1, W2, b2.
  std::size_t b1_at() const { return std::size_t{64} * static_cast<std::size_t>(hidden_); }
  std::size_t w2_at() const { return b1_at() + static_cast<std::size_t>(hidden_); }
  std::size_t b2_at() const { return w2_at() + static_cast<std::size_t>(hidden_) * 10; }

  int hidden_;
  std::size_t size_;
  double lr_, momentum_;
  std::unique_ptr<Device> d_;
};
