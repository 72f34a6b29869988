#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "twinkle/value.hpp"

// The collective interface every backend implements (gloo/ for cpu groups, nccl/ for cuda
// groups), and the key-value store their rendezvous goes through.
namespace twinkle::transport {

enum class ReduceOp { sum = 0, mean = 1, max = 2, min = 3 };

// Rendezvous store. Implementations are thread-safe.
class KvStore {
 public:
  virtual ~KvStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` is set; throws TransportError naming the key after `timeout`.
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

struct CommConfig {
  std::string name;  // unique within the run, e.g. "model/dp/1": prefixes the store keys
  int rank = 0;
  int size = 1;
  std::string host = "127.0.0.1";  // the address this member listens on
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

// A communicator over `size` members. Every call blocks until this member's part is done and
// throws TransportError when a peer fails or the timeout passes. Not thread-safe: one caller.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op) = 0;
  virtual void broadcast(void* data, std::size_t count, DType dtype, int root) = 0;
  // `out` holds count x size elements.
  virtual void all_gather(const void* in, void* out, std::size_t count, DType dtype) = 0;
  // `in` holds count x size elements; `out` count.
  virtual void reduce_scatter(const void* in, void* out, std::size_t count, DType dtype,
                              ReduceOp op) = 0;
  virtual void barrier() = 0;
};

}  // namespace twinkle::transport
