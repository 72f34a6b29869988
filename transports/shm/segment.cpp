#include "transports/shm/segment.hpp"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::transport {

namespace {

std::size_t page_size() {
  static const auto size = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

std::string os_error(const char* what) { return fmt::format("{}: {}", what, std::strerror(errno)); }

}  // namespace

std::unique_ptr<ShmSegment> ShmSegment::create(std::size_t bytes) {
  std::unique_ptr<ShmSegment> s(new ShmSegment);
  s->fd_.reset(memfd_create("twinkle-tensor", MFD_CLOEXEC));
  if (!s->fd_) throw TransportError(os_error("shared memory for a tensor (memfd_create)"));
  const std::size_t len = std::max<std::size_t>(bytes, 1);
  if (ftruncate(s->fd_.get(), static_cast<off_t>(len)) != 0) {
    throw TransportError(
        os_error(fmt::format("shared memory of {} bytes (ftruncate)", bytes).c_str()));
  }
  s->map_ = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, s->fd_.get(), 0);
  if (s->map_ == MAP_FAILED) {
    s->map_ = nullptr;
    throw TransportError(os_error(fmt::format("mapping {} bytes of shared memory", bytes).c_str()));
  }
  s->map_size_ = len;
  s->data_ = static_cast<std::byte*>(s->map_);
  s->size_ = bytes;
  return s;
}

std::unique_ptr<ShmSegment> ShmSegment::map(Fd fd, std::size_t offset, std::size_t bytes) {
  // A mapping past the file's end would fault (SIGBUS) on first access, not fail here.
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw TransportError(os_error("checking a received tensor"));
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (offset > size || bytes > size - offset) {
    throw TransportError(fmt::format(
        "a shared-memory tensor of {} bytes at offset {} does not fit its segment of {} bytes",
        bytes, offset, size));
  }
  std::unique_ptr<ShmSegment> s(new ShmSegment);
  s->fd_ = std::move(fd);
  const std::size_t start = offset / page_size() * page_size();
  const std::size_t len = std::max<std::size_t>(offset - start + bytes, 1);
  s->map_ = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, s->fd_.get(),
                 static_cast<off_t>(start));
  if (s->map_ == MAP_FAILED) {
    s->map_ = nullptr;
    throw TransportError(os_error("mapping a received tensor"));
  }
  s->map_size_ = len;
  s->data_ = static_cast<std::byte*>(s->map_) + (offset - start);
  s->size_ = bytes;
  return s;
}

ShmSegment::~ShmSegment() {
  if (map_) munmap(map_, map_size_);
}

namespace {
std::size_t bytes_of(DType dtype, const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return static_cast<std::size_t>(n) * dtype_size(dtype);
}
}  // namespace

Tensor shm_tensor(DType dtype, std::vector<std::int64_t> shape) {
  const std::size_t bytes = bytes_of(dtype, shape);
  std::shared_ptr<ShmSegment> seg = ShmSegment::create(bytes);
  return Tensor::view_fd(dtype, std::move(shape), seg->data(), bytes, seg, seg->fd(), 0);
}

ShmPool::~ShmPool() { *alive_ = false; }

Tensor ShmPool::tensor(DType dtype, std::vector<std::int64_t> shape) {
  const std::size_t bytes = bytes_of(dtype, shape);
  std::uint64_t id = 0;
  // A free segment of this size, or at most twice it.
  for (auto it = free_.lower_bound(bytes); it != free_.end() && it->first <= 2 * bytes; ++it) {
    id = it->second;
    free_bytes_ -= it->first;
    free_.erase(it);
    break;
  }
  if (!id) {
    id = ++next_id_;
    segments_[id].segment = ShmSegment::create(bytes);
  }
  Entry& e = segments_[id];
  e.local = true;
  e.remote = 0;
  ShmSegment* seg = e.segment.get();
  // The driver's references: when the last one goes, the segment waits for its peers.
  std::shared_ptr<const void> owner(seg, [this, id, alive = alive_](const void*) {
    if (!*alive) return;
    auto it = segments_.find(id);
    if (it == segments_.end()) return;
    it->second.local = false;
    if (it->second.remote == 0) recycle(id);
  });
  return Tensor::view_fd(dtype, std::move(shape), seg->data(), bytes, std::move(owner), seg->fd(),
                         0);
}

std::uint64_t ShmPool::sent(int fd) {
  for (auto& [id, e] : segments_) {
    if (e.segment->fd() == fd && e.local) {
      ++e.remote;
      return id;
    }
  }
  return 0;
}

void ShmPool::released(std::uint64_t id) {
  auto it = segments_.find(id);
  if (it == segments_.end() || it->second.remote == 0) return;
  if (--it->second.remote == 0 && !it->second.local) recycle(id);
}

void ShmPool::recycle(std::uint64_t id) {
  auto it = segments_.find(id);
  const std::size_t size = it->second.segment->size();
  if (free_bytes_ + size > max_free_) {
    segments_.erase(it);  // over the limit: really freed
    return;
  }
  free_.emplace(size, id);
  free_bytes_ += size;
}

namespace {

// The plugin's tensor `i` of `v`, viewed in place (valid while the plugin's value is).
Tensor plugin_tensor_view(const twk_value_v1& v, std::uint32_t i) {
  const twk_tensor_v1& t = v.tensors[i];
  if (!dtype_known(t.dtype) || t.ndim < 0 || (t.ndim > 0 && !t.shape)) {
    throw ValueError("tensor " + std::to_string(i) + " has an unknown dtype or a bad shape");
  }
  std::vector<std::int64_t> shape(t.shape, t.shape + t.ndim);
  return Tensor::view(static_cast<DType>(t.dtype), std::move(shape), const_cast<void*>(t.data),
                      t.nbytes, std::shared_ptr<const void>(t.data, [](const void*) {}));
}

}  // namespace

EncodedValue adopt_to_shm(const twk_value_v1& v, ShmPool* pool) {
  EncodedValue out;
  out.msgpack.assign(reinterpret_cast<const char*>(v.msgpack), v.msgpack_size);
  for (std::uint32_t i = 0; i < v.n_tensors; ++i) {
    Tensor view = plugin_tensor_view(v, i);
    if (view.nbytes() >= kShmThreshold) {
      Tensor copy =
          pool ? pool->tensor(view.dtype(), view.shape()) : shm_tensor(view.dtype(), view.shape());
      std::memcpy(copy.mutable_data(), view.data(), view.nbytes());
      out.tensors.push_back(copy);
    } else {
      out.tensors.push_back(view.clone());
    }
  }
  return out;
}

Value decode_to_shm(const twk_value_v1& v, ShmPool* pool) {
  EncodedValue e = adopt_to_shm(v, pool);
  return decode(e.msgpack.data(), e.msgpack.size(), e.tensors);
}

ShmChannel::ShmChannel(Fd socket, ShmPool* pool) : socket_(std::move(socket)), pool_(pool) {}

std::shared_ptr<ShmSegment> ShmChannel::map(Fd fd, std::size_t offset, std::size_t bytes,
                                            std::uint64_t pool_id) {
  std::unique_ptr<ShmSegment> seg = ShmSegment::map(std::move(fd), offset, bytes);
  return std::shared_ptr<ShmSegment>(seg.release(), [pool_id, released = released_](ShmSegment* s) {
    delete s;
    if (pool_id) {
      std::lock_guard lock(released->mu);
      released->ids.push_back(pool_id);
    }
  });
}

std::vector<std::uint64_t> ShmChannel::take_released() {
  std::lock_guard lock(released_->mu);
  return std::exchange(released_->ids, {});
}

bool ShmChannel::has_released() const {
  std::lock_guard lock(released_->mu);
  return !released_->ids.empty();
}

std::uint64_t ShmChannel::send(int fd) {
  const std::uint64_t token = ++next_token_;
  iovec iov{const_cast<std::uint64_t*>(&token), sizeof token};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  while (sendmsg(socket_.get(), &msg, MSG_NOSIGNAL) < 0) {
    if (errno != EINTR)
      throw TransportError(os_error("passing a shared-memory tensor to the peer"));
  }
  return token;
}

Fd ShmChannel::receive(std::uint64_t token) {
  for (;;) {
    std::uint64_t got = 0;
    iovec iov{&got, sizeof got};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    // Never waits: the sender passes a descriptor before it sends the message that names it, so
    // a token with nothing queued for it was never sent (a forged or corrupt message).
    ssize_t n = recvmsg(socket_.get(), &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      throw TransportError(
          fmt::format("shared-memory tensor {} was never sent on this channel", token));
    }
    if (n <= 0)
      throw TransportError(n == 0 ? "the peer closed the shared-memory channel"
                                  : os_error("receiving a shared-memory tensor"));
    Fd fd;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        int received = -1;
        std::memcpy(&received, CMSG_DATA(c), sizeof received);
        fd.reset(received);
      }
    }
    if (got == token && fd) return fd;
    if (got > token) {
      throw TransportError(fmt::format("shared-memory tensor {} is missing (got {})", token, got));
    }
  }
}

}  // namespace twinkle::transport
