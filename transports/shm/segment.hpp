#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "twinkle/fd.hpp"
#include "twinkle/value.hpp"

// Local zero-copy buffers: large tensors live in anonymous shared-memory files (memfd) that are
// handed to the peer process as file descriptors over a Unix socket, never through a byte stream.
// Nothing is ever named in /dev/shm: a segment is freed when the last process that maps it or
// holds its descriptor lets go, whether it exits, crashes or is killed.
namespace twinkle::transport {

// Tensors at least this large travel as shared memory between local processes.
inline constexpr std::size_t kShmThreshold = std::size_t{1} << 20;

// A memfd and a mapping of (part of) it. Unmaps and closes in the destructor.
class ShmSegment {
 public:
  // A new zero-filled segment of `bytes`, mapped read-write. Throws TransportError.
  static std::unique_ptr<ShmSegment> create(std::size_t bytes);
  // Maps [offset, offset + bytes) of the received descriptor `fd`, taking ownership of it.
  static std::unique_ptr<ShmSegment> map(Fd fd, std::size_t offset, std::size_t bytes);

  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  // The segment's descriptor, still owned by the segment.
  int fd() const { return fd_.get(); }

 private:
  ShmSegment() = default;
  Fd fd_;
  void* map_ = nullptr;
  std::size_t map_size_ = 0;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// The driver's reusable segments. Allocating and zeroing fresh shared memory costs several times
// a memcpy, so a segment goes back to the pool once the driver no longer references it and every
// worker it was sent to said it let go of it (ids travel back in replies). Segments a worker keeps
// are never reused. Used from one thread.
class ShmPool {
 public:
  explicit ShmPool(std::size_t max_free_bytes = std::size_t{4} << 30) : max_free_(max_free_bytes) {}
  ShmPool(const ShmPool&) = delete;
  ShmPool& operator=(const ShmPool&) = delete;
  ~ShmPool();

  // A tensor of `dtype` and `shape` in a pooled segment.
  Tensor tensor(DType dtype, std::vector<std::int64_t> shape);

  // The pool id of the segment whose descriptor is `fd` (0 if it is not the pool's), counting one
  // more peer that holds it.
  std::uint64_t sent(int fd);
  // A peer let go of segment `id`.
  void released(std::uint64_t id);

  std::size_t segments() const { return segments_.size(); }

 private:
  struct Entry {
    std::unique_ptr<ShmSegment> segment;
    int remote = 0;     // peers that map it
    bool local = true;  // the driver still references it
  };
  void recycle(std::uint64_t id);

  std::size_t max_free_;
  std::size_t free_bytes_ = 0;
  std::uint64_t next_id_ = 0;
  std::map<std::uint64_t, Entry> segments_;
  std::multimap<std::size_t, std::uint64_t> free_;  // by size
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

// A tensor of `dtype` and `shape` whose storage is a new segment (slices of it stay in it).
Tensor shm_tensor(DType dtype, std::vector<std::int64_t> shape);

// Decodes a value received across the plugin ABI (which must be copied out of the plugin's
// memory) straight into shared memory for tensors of kShmThreshold bytes or more, so that
// sending them on needs no further copy. With a pool, the segments come from it.
Value decode_to_shm(const twk_value_v1& v, ShmPool* pool = nullptr);
// The same without decoding: the value's msgpack bytes copied as they are, its tensors as
// decode_to_shm puts them. What is malformed in it is found by whoever decodes it.
EncodedValue adopt_to_shm(const twk_value_v1& v, ShmPool* pool = nullptr);
// (A value copied out of the plugin's memory without shared memory is the SDK's copy_encoded.)

// One end of a process pair's descriptor channel (a SOCK_SEQPACKET socketpair). Each send passes
// one descriptor with an increasing token; receive(token) returns the descriptor sent with it,
// closing any older ones that were never asked for (their message was dropped).
// The sending end may carry the driver's pool; the receiving end records which pooled segments
// it let go of, for the next message back. Send from one thread; receive from one thread.
class ShmChannel {
 public:
  explicit ShmChannel(Fd socket, ShmPool* pool = nullptr);
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // Passes `fd`, which stays the caller's, and returns its token.
  std::uint64_t send(int fd);
  Fd receive(std::uint64_t token);
  ShmPool* pool() const { return pool_; }

  // Maps a received segment; when the last reference goes, `pool_id` (if not 0) is recorded as
  // released. Thread-safe.
  std::shared_ptr<ShmSegment> map(Fd fd, std::size_t offset, std::size_t bytes,
                                  std::uint64_t pool_id);
  // The pool ids released since the last call. Thread-safe.
  std::vector<std::uint64_t> take_released();
  // Whether take_released() would return some now. Thread-safe.
  bool has_released() const;

 private:
  struct Released {
    std::mutex mu;
    std::vector<std::uint64_t> ids;
  };
  Fd socket_;
  std::uint64_t next_token_ = 0;
  ShmPool* pool_ = nullptr;
  std::shared_ptr<Released> released_ = std::make_shared<Released>();
};

}  // namespace twinkle::transport
