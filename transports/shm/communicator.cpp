#include "transports/shm/communicator.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <new>
#include <vector>

#include <fmt/format.h>

#include "twinkle/errors.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::transport {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kMagic = 0x74776b2d73686d31;  // "twk-shm1"
constexpr std::size_t kAlign = 64;
// Sets of slots used in turn: a round writes one while the two before it are still being read.
constexpr std::uint64_t kSets = 3;
// How long a waiter sleeps before it looks at its peers again: the bound on noticing a dead one.
constexpr std::chrono::milliseconds kSlice{50};

// One cache line per member, so that members never write the same line.
struct alignas(kAlign) MemberState {
  std::atomic<std::int32_t> pid;
  std::atomic<std::uint32_t> gone;     // the member destroyed its communicator or failed
  std::atomic<std::uint64_t> arrived;  // the last barrier it reached
};

struct Header {
  std::uint64_t magic;
  std::uint32_t size;
  std::uint64_t slot_bytes;
  alignas(kAlign) std::atomic<std::uint64_t> count;       // arrivals at barriers, ever
  alignas(kAlign) std::atomic<std::uint32_t> generation;  // futex word: the last barrier done
  std::atomic<std::uint32_t> waiters;                     // members asleep on the futex
};                                                        // followed by `size` MemberStates
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
static_assert(sizeof(Header) % kAlign == 0 && sizeof(MemberState) == kAlign);
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

std::size_t header_bytes(int size) {
  const std::size_t raw = sizeof(Header) + sizeof(MemberState) * static_cast<std::size_t>(size);
  return (raw + 4095) / 4096 * 4096;
}

std::string os_error(const std::string& what) {
  return fmt::format("{}: {}", what, std::strerror(errno));
}

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// ----- element types and reductions ----------------------------------------------------------

// 16-bit floats are stored as bits, accumulated in float.
struct Half {
  std::uint16_t bits;
};
struct BHalf {
  std::uint16_t bits;
};

inline float to_acc(Half h) { return static_cast<float>(std::bit_cast<_Float16>(h.bits)); }
inline void from_acc(float f, Half& h) { h.bits = std::bit_cast<std::uint16_t>(_Float16(f)); }
inline float to_acc(BHalf h) { return std::bit_cast<float>(std::uint32_t{h.bits} << 16); }
inline void from_acc(float f, BHalf& h) {
  const auto u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
    h.bits = static_cast<std::uint16_t>((u >> 16) | 0x40);
  } else {  // round to nearest even
    h.bits = static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}
template <class T>
inline T to_acc(T v) {
  return v;
}
template <class T>
inline void from_acc(T a, T& v) {
  v = a;
}

template <class T>
struct AccOf {
  using type = T;
};
template <>
struct AccOf<Half> {
  using type = float;
};
template <>
struct AccOf<BHalf> {
  using type = float;
};

// out = srcs[0] op srcs[1] op ... op srcs[n-1], element-wise and always in that order, then
// divided by n for mean; also written to `out2` unless it is null. An output may be one of the
// sources: each block is read before it is written.
template <class T, ReduceOp Op>
void reduce_block(const std::vector<const std::byte*>& srcs, std::byte* out, std::byte* out2,
                  std::size_t count) {
  using Acc = typename AccOf<T>::type;
  constexpr std::size_t kBlock = 1024;
  Acc acc[kBlock];
  const auto n = static_cast<int>(srcs.size());
  for (std::size_t base = 0; base < count; base += kBlock) {
    const std::size_t len = std::min(kBlock, count - base);
    const T* s0 = reinterpret_cast<const T*>(srcs[0]) + base;
    for (std::size_t j = 0; j < len; ++j) acc[j] = to_acc(s0[j]);
    for (int q = 1; q < n; ++q) {
      const T* s = reinterpret_cast<const T*>(srcs[static_cast<std::size_t>(q)]) + base;
      for (std::size_t j = 0; j < len; ++j) {
        const Acc v = to_acc(s[j]);
        if constexpr (Op == ReduceOp::max) {
          acc[j] = acc[j] < v ? v : acc[j];
        } else if constexpr (Op == ReduceOp::min) {
          acc[j] = v < acc[j] ? v : acc[j];
        } else {
          acc[j] = static_cast<Acc>(acc[j] + v);
        }
      }
    }
    if constexpr (Op == ReduceOp::mean) {
      for (std::size_t j = 0; j < len; ++j) acc[j] = static_cast<Acc>(acc[j] / static_cast<Acc>(n));
    }
    T* o = reinterpret_cast<T*>(out) + base;
    for (std::size_t j = 0; j < len; ++j) from_acc(acc[j], o[j]);
    if (out2) std::memcpy(reinterpret_cast<T*>(out2) + base, o, len * sizeof(T));
  }
}

using ReduceFn = void (*)(const std::vector<const std::byte*>&, std::byte*, std::byte*,
                          std::size_t);

template <class T>
ReduceFn reducer_for(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return &reduce_block<T, ReduceOp::sum>;
    case ReduceOp::mean: return &reduce_block<T, ReduceOp::mean>;
    case ReduceOp::max: return &reduce_block<T, ReduceOp::max>;
    case ReduceOp::min: return &reduce_block<T, ReduceOp::min>;
  }
  return &reduce_block<T, ReduceOp::sum>;
}

ReduceFn reducer(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::f32: return reducer_for<float>(op);
    case DType::f64: return reducer_for<double>(op);
    case DType::i32: return reducer_for<std::int32_t>(op);
    case DType::i64: return reducer_for<std::int64_t>(op);
    case DType::u8: return reducer_for<std::uint8_t>(op);
    case DType::i8: return reducer_for<std::int8_t>(op);
    case DType::f16: return reducer_for<Half>(op);
    case DType::bf16: return reducer_for<BHalf>(op);
    case DType::boolean: break;
  }
  throw TransportError(fmt::format(
      "{} reductions are not supported on cpu groups (shared memory); use float32, float64, "
      "int32, int64, int8, uint8, float16 or bfloat16",
      dtype_name(dtype)));
}

// ----- the communicator ----------------------------------------------------------------------

class ShmCommunicator : public Communicator {
 public:
  ShmCommunicator(KvStore& store, const CommConfig& c, std::size_t slot_bytes)
      : config_(c), slot_(slot_bytes / kAlign * kAlign) {
    const auto n = static_cast<std::size_t>(c.size);
    if (slot_ < kAlign * n) {
      throw TransportError(fmt::format("shared-memory slot of {} bytes is too small for {} members",
                                       slot_bytes, c.size));
    }
    pidfds_.resize(n);
    if (c.size <= 1) return;  // a single member shares nothing
    try {
      connect(store);
    } catch (...) {
      release();
      throw;
    }
  }

  ShmCommunicator(const ShmCommunicator&) = delete;
  ShmCommunicator& operator=(const ShmCommunicator&) = delete;
  ~ShmCommunicator() override { release(); }

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }

  void all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op) override {
    const ReduceFn reduce = reducer(dtype, op);
    if (config_.size <= 1 || count == 0) return;
    guard("all_reduce");
    const std::size_t esz = dtype_size(dtype);
    const std::size_t per_round = slot_ / esz;
    const std::size_t rounds = (count + per_round - 1) / per_round;
    const int me = config_.rank;
    auto* bytes = static_cast<std::byte*>(data);
    std::vector<const std::byte*> srcs(static_cast<std::size_t>(config_.size));
    const std::uint64_t first = round_;
    auto set_of = [&](std::size_t k) { return static_cast<std::size_t>((first + k) % kSets); };
    auto span_of = [&](std::size_t k) {
      const std::size_t off = k * per_round;
      return std::pair{off, std::min(per_round, count - off)};
    };
    // Round k: copy in (every member's part except its own share, which only it reads), reduce
    // its share (from its own buffer and the others' slots, into its slot and its buffer), copy
    // the others' shares out. Phase j copies round j-2 out, reduces round j-1 and copies round j
    // in: three sets, one barrier per round.
    for (std::size_t j = 0; j <= rounds + 1; ++j) {
      if (j >= 2) {
        const std::size_t k = j - 2;
        const auto [off, m] = span_of(k);
        for (int q = 0; q < config_.size; ++q) {
          const auto [qa, qlen] = share(m, esz, q);
          if (q != me && qlen)
            std::memcpy(bytes + (off + qa) * esz, slot(set_of(k), q) + qa * esz, qlen * esz);
        }
      }
      if (j >= 1 && j <= rounds) {
        const std::size_t k = j - 1;
        const auto [off, m] = span_of(k);
        const auto [a, len] = share(m, esz, me);
        for (int q = 0; q < config_.size; ++q) {
          srcs[static_cast<std::size_t>(q)] =
              q == me ? bytes + (off + a) * esz : slot(set_of(k), q) + a * esz;
        }
        if (len) reduce(srcs, slot(set_of(k), me) + a * esz, bytes + (off + a) * esz, len);
      }
      if (j < rounds) {
        const auto [off, m] = span_of(j);
        const auto [a, len] = share(m, esz, me);
        std::byte* mine = slot(set_of(j), me);
        if (a) std::memcpy(mine, bytes + off * esz, a * esz);
        if (a + len < m)
          std::memcpy(mine + (a + len) * esz, bytes + (off + a + len) * esz, (m - a - len) * esz);
      }
      if (j <= rounds) wait_all("all_reduce");
    }
    round_ += rounds;
  }

  void broadcast(void* data, std::size_t count, DType dtype, int root) override {
    if (root < 0 || root >= config_.size) {
      throw TransportError(
          fmt::format("broadcast root {} is outside the communicator of {}", root, config_.size));
    }
    if (config_.size <= 1 || count == 0) return;
    guard("broadcast");
    // The root may fill the whole set: nobody else writes during a broadcast.
    const std::size_t total = count * dtype_size(dtype);
    const std::size_t per_round = slot_ * static_cast<std::size_t>(config_.size);
    auto* bytes = static_cast<std::byte*>(data);
    for (std::size_t off = 0; off < total; off += per_round) {
      const std::size_t m = std::min(per_round, total - off);
      if (config_.rank == root) std::memcpy(slot(0), bytes + off, m);
      wait_all("broadcast");
      if (config_.rank != root) std::memcpy(bytes + off, slot(0), m);
      next_round();
    }
  }

  void all_gather(const void* in, void* out, std::size_t count, DType dtype) override {
    const std::size_t esz = dtype_size(dtype);
    const std::size_t bytes = count * esz;
    if (config_.size <= 1 || count == 0) {
      if (bytes) std::memmove(out, in, bytes);
      return;
    }
    guard("all_gather");
    auto* src = static_cast<const std::byte*>(in);
    auto* dst = static_cast<std::byte*>(out);
    for (std::size_t off = 0; off < bytes; off += slot_) {
      const std::size_t m = std::min(slot_, bytes - off);
      std::memcpy(slot(config_.rank), src + off, m);
      wait_all("all_gather");
      for (int q = 0; q < config_.size; ++q)
        std::memcpy(dst + static_cast<std::size_t>(q) * bytes + off, slot(q), m);
      next_round();
    }
  }

  void reduce_scatter(const void* in, void* out, std::size_t count, DType dtype,
                      ReduceOp op) override {
    const ReduceFn reduce = reducer(dtype, op);
    const std::size_t esz = dtype_size(dtype);
    if (count == 0) return;
    if (config_.size <= 1) {
      const std::vector<const std::byte*> srcs{static_cast<const std::byte*>(in)};
      reduce(srcs, static_cast<std::byte*>(out), nullptr, count);  // a mean of one is a copy
      return;
    }
    guard("reduce_scatter");
    const auto n = static_cast<std::size_t>(config_.size);
    const std::size_t per_round = std::max<std::size_t>(slot_ / esz / n, 1);
    auto* src = static_cast<const std::byte*>(in);
    auto* dst = static_cast<std::byte*>(out);
    std::vector<const std::byte*> srcs(n);
    for (std::size_t off = 0; off < count; off += per_round) {
      const std::size_t m = std::min(per_round, count - off);
      // Member r's slot holds, for every member q, q's part of this round.
      for (std::size_t q = 0; q < n; ++q)
        std::memcpy(slot(config_.rank) + q * m * esz, src + (q * count + off) * esz, m * esz);
      wait_all("reduce_scatter");
      for (std::size_t q = 0; q < n; ++q)
        srcs[q] = slot(static_cast<int>(q)) + static_cast<std::size_t>(config_.rank) * m * esz;
      reduce(srcs, dst + off * esz, nullptr, m);
      next_round();
    }
  }

  void barrier() override {
    if (config_.size <= 1) return;
    guard("barrier");
    wait_all("barrier");
  }

 private:
  // Shares the segment and waits until every member mapped it.
  void connect(KvStore& store) {
    const CommConfig& c = config_;
    const auto n = static_cast<std::size_t>(c.size);
    header_bytes_ = header_bytes(c.size);
    bytes_ = header_bytes_ + kSets * n * slot_;
    const std::string key = c.name + "/shm-segment";
    if (c.rank == 0) {
      // memfd names are limited to 249 bytes; the name only helps whoever reads /proc/PID/maps.
      const std::string label = fmt::format("twinkle-collectives:{}", c.name).substr(0, 200);
      fd_.reset(memfd_create(label.c_str(), MFD_CLOEXEC));
      if (!fd_) throw TransportError(os_error("shared memory for " + c.name + " (memfd_create)"));
      if (ftruncate(fd_.get(), static_cast<off_t>(bytes_)) != 0) {
        throw TransportError(
            os_error(fmt::format("shared memory of {} bytes for {} (ftruncate)", bytes_, c.name)));
      }
      map();
      header_ = new (base_) Header{};
      header_->magic = kMagic;
      header_->size = static_cast<std::uint32_t>(c.size);
      header_->slot_bytes = slot_;
      for (int r = 0; r < c.size; ++r) new (&member(r)) MemberState{};
      store.set(key, fmt::format("{}:{}:{}", getpid(), fd_.get(), bytes_));
    } else {
      attach(store.get(key, c.timeout));
    }
    self().pid.store(getpid(), std::memory_order_release);
    deadline_ = Clock::now() + c.timeout;
    wait_all("connecting");
    // Every member opened the segment: the descriptor is no longer needed, only the mapping.
    fd_.reset();
    for (std::size_t q = 0; q < n; ++q) {
      const int pid = member(q).pid.load(std::memory_order_acquire);
      if (pid != getpid()) pidfds_[q] = open_pidfd(pid);
    }
  }

  // Leaves the communicator (peers waiting on this member fail) and unmaps: safe at any stage.
  void release() noexcept {
    if (header_) {
      self().gone.store(1, std::memory_order_seq_cst);
      wake();
      header_ = nullptr;
    }
    if (base_) munmap(base_, bytes_);
    base_ = nullptr;
    fd_.reset();
    for (Fd& fd : pidfds_) fd.reset();
  }

  void map() {
    void* p =
        mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_.get(), 0);
    if (p == MAP_FAILED) {
      throw TransportError(
          os_error(fmt::format("mapping {} bytes of shared memory for {}", bytes_, config_.name)));
    }
    base_ = static_cast<std::byte*>(p);
  }

  // Opens rank 0's segment, published as "PID:FD:BYTES", through /proc (same host, same user).
  void attach(const std::string& published) {
    long long pid = 0, fd = 0;
    unsigned long long size = 0;
    if (std::sscanf(published.c_str(), "%lld:%lld:%llu", &pid, &fd, &size) != 3 || size != bytes_) {
      throw TransportError(fmt::format(
          "{}: rank 0 published shared memory \"{}\" but {} bytes were expected (members built "
          "from different versions?)",
          config_.name, published, bytes_));
    }
    const std::string path = fmt::format("/proc/{}/fd/{}", pid, fd);
    fd_.reset(open(path.c_str(), O_RDWR | O_CLOEXEC));
    if (!fd_) {
      throw TransportError(os_error(fmt::format(
          "{}: opening rank 0's shared memory {} (rank 0 must be a live process of the same user "
          "on this host; set collectives = \"gloo\" where /proc is restricted)",
          config_.name, path)));
    }
    struct stat st {};
    if (fstat(fd_.get(), &st) != 0 || static_cast<std::size_t>(st.st_size) != bytes_) {
      throw TransportError(fmt::format("{}: {} is not the expected segment of {} bytes",
                                       config_.name, path, bytes_));
    }
    map();
    auto* h = std::launder(reinterpret_cast<Header*>(base_));
    if (h->magic != kMagic || h->size != static_cast<std::uint32_t>(config_.size) ||
        h->slot_bytes != slot_) {
      throw TransportError(
          fmt::format("{}: {} is not this communicator's segment", config_.name, path));
    }
    header_ = h;
  }

  MemberState& member(int q) const {
    return std::launder(reinterpret_cast<MemberState*>(base_ + sizeof(Header)))[q];
  }
  MemberState& self() const { return member(config_.rank); }

  // Slot `q` of set `set`, or of the current round's set.
  std::byte* slot(std::size_t set, int q) const {
    return base_ + header_bytes_ +
           (set * static_cast<std::size_t>(config_.size) + static_cast<std::size_t>(q)) * slot_;
  }
  std::byte* slot(int q) const { return slot(static_cast<std::size_t>(round_ % kSets), q); }
  void next_round() { ++round_; }

  // Member q's share [first, first + len) of a round of m elements: cache-line multiples.
  std::pair<std::size_t, std::size_t> share(std::size_t m, std::size_t esz, int q) const {
    const std::size_t unit = kAlign / esz;
    const auto n = static_cast<std::size_t>(config_.size);
    const std::size_t each = ((m + n - 1) / n + unit - 1) / unit * unit;
    const std::size_t first = std::min(m, each * static_cast<std::size_t>(q));
    return {first, std::min(m, first + each) - first};
  }

  void guard(const char* op) {
    if (broken_) {
      throw TransportError(fmt::format(
          "{} on {}: the communicator failed earlier and cannot be used again", op, config_.name));
    }
    deadline_ = Clock::now() + config_.timeout;
  }

  void wake() {
    syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&header_->generation), FUTEX_WAKE, INT_MAX,
            nullptr, nullptr, 0);
  }

  // A barrier of all members. Barrier k is complete when `count` reaches size x k: no member can
  // arrive at k + 1 before k is complete.
  void wait_all(const char* op) {
    const std::uint64_t k = ++barriers_;
    const auto target = static_cast<std::uint32_t>(k);
    self().arrived.store(k, std::memory_order_release);
    const std::uint64_t before = header_->count.fetch_add(1, std::memory_order_acq_rel);
    if (before + 1 == k * static_cast<std::uint64_t>(config_.size)) {
      header_->generation.store(target, std::memory_order_seq_cst);
      if (header_->waiters.load(std::memory_order_seq_cst) > 0) wake();
      return;
    }
    auto done = [&] {
      return static_cast<std::int32_t>(header_->generation.load(std::memory_order_acquire) -
                                       target) >= 0;
    };
    // Spinning only pays while every member has a core of its own.
    static const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    const int spins = config_.size <= cpus ? 2000 : 0;
    for (int i = 0; i < spins; ++i) {
      if (done()) return;
      __builtin_ia32_pause();
    }
    for (;;) {
      header_->waiters.fetch_add(1, std::memory_order_seq_cst);
      const std::uint32_t seen = header_->generation.load(std::memory_order_seq_cst);
      if (static_cast<std::int32_t>(seen - target) < 0) {
        timespec ts{0, std::chrono::nanoseconds(kSlice).count()};
        syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&header_->generation), FUTEX_WAIT, seen,
                &ts, nullptr, 0);
      }
      header_->waiters.fetch_sub(1, std::memory_order_seq_cst);
      if (done()) return;
      check_peers(op, k);
    }
  }

  [[noreturn]] void fail(const std::string& what) {
    broken_ = true;
    self().gone.store(1, std::memory_order_seq_cst);
    wake();
    throw TransportError(what);
  }

  // Fails naming the first member that is gone, or the ones that did not arrive at barrier k
  // once the deadline passed.
  void check_peers(const char* op, std::uint64_t k) {
    // Exited processes first: a member that failed because of one is not the cause.
    for (int q = 0; q < config_.size; ++q) {
      if (q == config_.rank) continue;
      const int pid = member(q).pid.load(std::memory_order_acquire);
      bool exited = false;
      if (const Fd& pidfd = pidfds_[static_cast<std::size_t>(q)]) {
        pollfd p{pidfd.get(), POLLIN, 0};
        exited = poll(&p, 1, 0) > 0;
      } else if (pid > 0 && pid != getpid()) {
        exited = kill(pid, 0) != 0 && errno == ESRCH;
      }
      if (exited) {
        fail(fmt::format("{} on {} failed: rank {} (pid {}) exited during the collective", op,
                         config_.name, q, pid));
      }
    }
    for (int q = 0; q < config_.size; ++q) {
      if (q != config_.rank && member(q).gone.load(std::memory_order_acquire)) {
        fail(fmt::format(
            "{} on {} failed: rank {} left the communicator (it failed or was destroyed)", op,
            config_.name, q));
      }
    }
    if (Clock::now() < deadline_) return;
    std::string late;
    for (int q = 0; q < config_.size; ++q) {
      if (member(q).arrived.load(std::memory_order_acquire) < k)
        late += fmt::format("{}{}", late.empty() ? "" : ", ", q);
    }
    fail(fmt::format("{} on {} failed: rank(s) {} did not arrive within {} ms", op, config_.name,
                     late, config_.timeout.count()));
  }

  CommConfig config_;
  std::size_t slot_;
  std::size_t header_bytes_ = 0;
  std::size_t bytes_ = 0;
  Fd fd_;  // the segment's, until every member mapped it
  std::byte* base_ = nullptr;
  Header* header_ = nullptr;
  std::vector<Fd> pidfds_;  // per member: readable once it exited; empty for self or unknown
  std::uint64_t barriers_ = 0;
  std::uint64_t round_ = 0;
  Clock::time_point deadline_;
  bool broken_ = false;
};

}  // namespace

std::string shm_host_id() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  char ns[64] = {};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  return fmt::format("{}/{}/{}", host, read_first_line("/proc/sys/kernel/random/boot_id"),
                     n > 0 ? std::string(ns, static_cast<std::size_t>(n)) : std::string("?"));
}

bool members_share_host(KvStore& store, const CommConfig& config) {
  if (config.size <= 1) return true;
  const std::string id = shm_host_id();
  store.set(fmt::format("{}/host/{}", config.name, config.rank), id);
  bool same = true;
  for (int q = 0; q < config.size; ++q) {
    if (q == config.rank) continue;
    same = same && store.get(fmt::format("{}/host/{}", config.name, q), config.timeout) == id;
  }
  return same;
}

std::size_t shm_slot_bytes(int size) {
  const auto n = static_cast<std::size_t>(std::max(size, 1));
  return std::clamp((std::size_t{8} << 20) / (n * n), std::size_t{128} << 10, std::size_t{2} << 20);
}

std::unique_ptr<Communicator> create_shm_communicator(KvStore& store, const CommConfig& config,
                                                      std::size_t slot_bytes) {
  return std::make_unique<ShmCommunicator>(store, config,
                                           slot_bytes ? slot_bytes : shm_slot_bytes(config.size));
}

}  // namespace twinkle::transport
