// CUDA kernels of the digits MLP: one thread per output element, double precision, no libraries.
#include "mlp_cuda.hpp"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace {

constexpr int kFeatures = 64;
constexpr int kClasses = 10;
constexpr int kThreads = 128;

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(rc));
}

int blocks(int n) { return (n + kThreads - 1) / kThreads; }

__global__ void hidden_layer(const float* x, const double* w1, const double* b1, double* h,
                             int rows, int hidden) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= rows * hidden) return;
  int r = t / hidden, j = t % hidden;
  double s = b1[j];
  for (int i = 0; i < kFeatures; ++i) s += x[r * kFeatures + i] * w1[i * hidden + j];
  h[t] = s > 0 ? s : 0;
}

__global__ void output_layer(const double* h, const double* w2, const double* b2, double* logits,
                             int rows, int hidden) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= rows * kClasses) return;
  int r = t / kClasses, k = t % kClasses;
  double s = b2[k];
  for (int j = 0; j < hidden; ++j) s += h[r * hidden + j] * w2[j * kClasses + k];
  logits[t] = s;
}

// Per row: softmax cross-entropy loss and d(loss)/d(logits).
__global__ void softmax_xent(const double* logits, const long long* y, double* dl, double* loss,
                             int rows) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const double* l = logits + r * kClasses;
  double top = l[0];
  for (int k = 1; k < kClasses; ++k) top = l[k] > top ? l[k] : top;
  double z = 0;
  for (int k = 0; k < kClasses; ++k) z += exp(l[k] - top);
  loss[r] = -(l[y[r]] - top - log(z));
  for (int k = 0; k < kClasses; ++k)
    dl[r * kClasses + k] = exp(l[k] - top) / z - (k == y[r] ? 1.0 : 0.0);
}

__global__ void grad_output(const double* h, const double* dl, double* gw2, double* gb2, int rows,
                            int hidden) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= hidden * kClasses + kClasses) return;
  if (t < hidden * kClasses) {
    int j = t / kClasses, k = t % kClasses;
    double s = 0;
    for (int r = 0; r < rows; ++r) s += dl[r * kClasses + k] * h[r * hidden + j];
    gw2[t] = s;
  } else {
    int k = t - hidden * kClasses;
    double s = 0;
    for (int r = 0; r < rows; ++r) s += dl[r * kClasses + k];
    gb2[k] = s;
  }
}

__global__ void grad_hidden(const double* h, const double* dl, const double* w2, double* dh,
                            int rows, int hidden) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= rows * hidden) return;
  int r = t / hidden, j = t % hidden;
  double s = 0;
  for (int k = 0; k < kClasses; ++k) s += dl[r * kClasses + k] * w2[j * kClasses + k];
  dh[t] = h[t] > 0 ? s : 0;
}

__global__ void grad_input(const float* x, const double* dh, double* gw1, double* gb1, int rows,
                           int hidden) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= kFeatures * hidden + hidden) return;
  if (t < kFeatures * hidden) {
    int i = t / hidden, j = t % hidden;
    double s = 0;
    for (int r = 0; r < rows; ++r) s += dh[r * hidden + j] * x[r * kFeatures + i];
    gw1[t] = s;
  } else {
    int j = t - kFeatures * hidden;
    double s = 0;
    for (int r = 0; r < rows; ++r) s += dh[r * hidden + j];
    gb1[j] = s;
  }
}

// The loss sum and the row count after the gradients, for one all_reduce of everything.
__global__ void totals(const double* loss, double* out, int rows) {
  double s = 0;
  for (int r = 0; r < rows; ++r) s += loss[r];
  out[0] = s;
  out[1] = rows;
}

__global__ void sgd(double* p, double* v, const double* g, size_t n, double lr, double momentum) {
  size_t t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const double count = g[n + 1];
  v[t] = momentum * v[t] - lr * g[t] / count;
  p[t] += v[t];
}

__global__ void count_correct(const double* logits, const long long* y, unsigned long long* correct,
                              int rows) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  int best = 0;
  for (int k = 1; k < kClasses; ++k)
    best = logits[r * kClasses + k] > logits[r * kClasses + best] ? k : best;
  if (best == y[r]) atomicAdd(correct, 1ull);
}

}  // namespace

struct CudaMlp::Device {
  double *params = nullptr, *velocity = nullptr, *grad = nullptr;
  float* x = nullptr;
  long long* y = nullptr;
  double *h = nullptr, *logits = nullptr, *dl = nullptr, *dh = nullptr, *loss = nullptr;
  unsigned long long* correct = nullptr;
  int capacity = 0;

  ~Device() {
    for (void* p :
         {static_cast<void*>(params), static_cast<void*>(velocity), static_cast<void*>(grad),
          static_cast<void*>(x), static_cast<void*>(y), static_cast<void*>(h),
          static_cast<void*>(logits), static_cast<void*>(dl), static_cast<void*>(dh),
          static_cast<void*>(loss), static_cast<void*>(correct)}) {
      if (p) cudaFree(p);
    }
  }
};

CudaMlp::CudaMlp(int hidden, const std::vector<double>& params, double lr, double momentum)
    : hidden_(hidden),
      size_(params.size()),
      lr_(lr),
      momentum_(momentum),
      d_(std::make_unique<Device>()) {
  check(cudaMalloc(&d_->params, size_ * sizeof(double)), "cudaMalloc");
  check(cudaMalloc(&d_->velocity, size_ * sizeof(double)), "cudaMalloc");
  check(cudaMalloc(&d_->grad, (size_ + 2) * sizeof(double)), "cudaMalloc");
  check(cudaMalloc(&d_->correct, sizeof(unsigned long long)), "cudaMalloc");
  check(cudaMemcpy(d_->params, params.data(), size_ * sizeof(double), cudaMemcpyHostToDevice),
        "cudaMemcpy");
  check(cudaMemset(d_->velocity, 0, size_ * sizeof(double)), "cudaMemset");
}

CudaMlp::~CudaMlp() = default;

void CudaMlp::download(std::vector<double>& params, std::vector<double>& velocity) const {
  params.resize(size_);
  velocity.resize(size_);
  check(cudaMemcpy(params.data(), d_->params, size_ * sizeof(double), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  check(cudaMemcpy(velocity.data(), d_->velocity, size_ * sizeof(double), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
}

void CudaMlp::restore(const std::vector<double>& params, const std::vector<double>& velocity) {
  check(cudaMemcpy(d_->params, params.data(), size_ * sizeof(double), cudaMemcpyHostToDevice),
        "cudaMemcpy");
  check(cudaMemcpy(d_->velocity, velocity.data(), size_ * sizeof(double), cudaMemcpyHostToDevice),
        "cudaMemcpy");
}

void CudaMlp::upload(const float* x, const std::int64_t* y, int rows) {
  if (rows > d_->capacity) {
    for (void* p : {static_cast<void*>(d_->x), static_cast<void*>(d_->y), static_cast<void*>(d_->h),
                    static_cast<void*>(d_->logits), static_cast<void*>(d_->dl),
                    static_cast<void*>(d_->dh), static_cast<void*>(d_->loss)}) {
      if (p) cudaFree(p);
    }
    check(cudaMalloc(&d_->x, sizeof(float) * rows * kFeatures), "cudaMalloc");
    check(cudaMalloc(&d_->y, sizeof(long long) * rows), "cudaMalloc");
    check(cudaMalloc(&d_->h, sizeof(double) * rows * hidden_), "cudaMalloc");
    check(cudaMalloc(&d_->logits, sizeof(double) * rows * kClasses), "cudaMalloc");
    check(cudaMalloc(&d_->dl, sizeof(double) * rows * kClasses), "cudaMalloc");
    check(cudaMalloc(&d_->dh, sizeof(double) * rows * hidden_), "cudaMalloc");
    check(cudaMalloc(&d_->loss, sizeof(double) * rows), "cudaMalloc");
    d_->capacity = rows;
  }
  check(cudaMemcpy(d_->x, x, sizeof(float) * rows * kFeatures, cudaMemcpyHostToDevice),
        "cudaMemcpy");
  check(cudaMemcpy(d_->y, y, sizeof(long long) * rows, cudaMemcpyHostToDevice), "cudaMemcpy");
}

// Uploads a batch and computes its hidden activations and logits.
void CudaMlp::forward(const float* x, const std::int64_t* y, int rows) {
  upload(x, y, rows);
  hidden_layer<<<blocks(rows * hidden_), kThreads>>>(d_->x, d_->params, d_->params + b1_at(), d_->h,
                                                     rows, hidden_);
  output_layer<<<blocks(rows * kClasses), kThreads>>>(
      d_->h, d_->params + w2_at(), d_->params + b2_at(), d_->logits, rows, hidden_);
}

double* CudaMlp::gradients(const float* x, const std::int64_t* y, int rows) {
  forward(x, y, rows);
  const std::size_t w2 = w2_at(), b2 = b2_at();
  softmax_xent<<<blocks(rows), kThreads>>>(d_->logits, d_->y, d_->dl, d_->loss, rows);
  grad_output<<<blocks(hidden_ * kClasses + kClasses), kThreads>>>(d_->h, d_->dl, d_->grad + w2,
                                                                   d_->grad + b2, rows, hidden_);
  grad_hidden<<<blocks(rows * hidden_), kThreads>>>(d_->h, d_->dl, d_->params + w2, d_->dh, rows,
                                                    hidden_);
  grad_input<<<blocks(kFeatures * hidden_ + hidden_), kThreads>>>(
      d_->x, d_->dh, d_->grad, d_->grad + b1_at(), rows, hidden_);
  totals<<<1, 1>>>(d_->loss, d_->grad + size_, rows);
  check(cudaGetLastError(), "digits kernels");
  check(cudaDeviceSynchronize(), "digits kernels");
  return d_->grad;
}

std::pair<double, double> CudaMlp::step() {
  sgd<<<blocks(static_cast<int>(size_)), kThreads>>>(d_->params, d_->velocity, d_->grad, size_, lr_,
                                                     momentum_);
  check(cudaGetLastError(), "sgd kernel");
  double tail[2];
  check(cudaMemcpy(tail, d_->grad + size_, sizeof tail, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return {tail[0] / tail[1], tail[1]};
}

std::int64_t CudaMlp::evaluate(const float* x, const std::int64_t* y, int rows) {
  forward(x, y, rows);
  check(cudaMemset(d_->correct, 0, sizeof(unsigned long long)), "cudaMemset");
  count_correct<<<blocks(rows), kThreads>>>(d_->logits, d_->y, d_->correct, rows);
  unsigned long long correct = 0;
  check(cudaMemcpy(&correct, d_->correct, sizeof correct, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return static_cast<std::int64_t>(correct);
}
