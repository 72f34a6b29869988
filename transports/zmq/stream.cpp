#include "transports/zmq/stream.hpp"

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include <fmt/format.h>

#include "twinkle/errors.hpp"

namespace twinkle::transport {

namespace {

constexpr std::uint64_t kMore = std::uint64_t{1} << 63;
constexpr std::size_t kReadChunk = std::size_t{64} << 10;
// The largest socket buffers a stream asks for: a driver's burst of pipelined calls fits without
// waiting in the outbox. The kernel caps what an unprivileged process gets (net.core.wmem_max).
constexpr int kSocketBuffer = 4 << 20;
// A pipe's capacity (64 KiB unless asked): 512 KiB holds a burst of ~7,000 calls. It counts
// against the user's pipe-user-pages-soft (64 MiB by default; 1 MiB a worker), and a pipe that
// cannot have it keeps what it has: the outbox takes the rest.
constexpr int kPipeBuffer = 512 << 10;

void make_non_blocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0)
    throw TransportError(
        fmt::format("cannot make a stream non-blocking: {}", std::strerror(errno)));
}

void put_u64(unsigned char* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

std::uint64_t get_u64(const char* c) {
  const auto* p = reinterpret_cast<const unsigned char*>(c);
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= std::uint64_t(p[i]) << (8 * i);
  return v;
}

bool gone(int err) { return err == EPIPE || err == ECONNRESET || err == ENOTCONN; }

// What a frame adopted from a read buffer releases: its share of the buffer.
template <class Buffer>
void release_buffer_of(void*, void* hint) {
  delete static_cast<std::shared_ptr<Buffer>*>(hint);
}

}  // namespace

FrameStream::FrameStream(Fd socket) : read_end_(std::move(socket)) {
  make_non_blocking(read_end_.get());
  (void)::setsockopt(read_end_.get(), SOL_SOCKET, SO_SNDBUF, &kSocketBuffer, sizeof kSocketBuffer);
  (void)::setsockopt(read_end_.get(), SOL_SOCKET, SO_RCVBUF, &kSocketBuffer, sizeof kSocketBuffer);
}

// Pipes rather than a socket pair: a write appends to the pipe's last page while it has room, so
// a burst of small messages costs the reader a few page copies instead of one socket buffer each
// (a pipelined echo of call-sized messages runs about 4x faster; docs/ARCHITECTURE.md, Sockets).
FrameStream::FrameStream(Fd in, Fd out, bool large_pipes)
    : read_end_(std::move(in)), write_end_(std::move(out)) {
  make_non_blocking(read_end_.get());
  make_non_blocking(write_end_.get());
  if (!large_pipes) return;
  // The writer's end sizes its pipe; the reader's end asks for its own (the other side's writer
  // may not have).
  (void)::fcntl(write_end_.get(), F_SETPIPE_SZ, kPipeBuffer);
  (void)::fcntl(read_end_.get(), F_SETPIPE_SZ, kPipeBuffer);
}

void FrameStream::write_failed(int err) {
  out_.clear();
  out_begin_ = 0;
  held_.clear();
  if (gone(err)) {
    write_gone_ = true;
    throw TransportError("the other end of the stream is gone");
  }
  write_error_ = std::strerror(err);
  throw TransportError("cannot write to the stream: " + write_error_);
}

void FrameStream::write_frames(Frames& frames, bool now, bool shared) {
  if (write_gone_) throw TransportError("the other end of the stream is gone");
  if (!write_error_.empty()) throw TransportError("cannot write to the stream: " + write_error_);
  // A message of up to kInline frames (every call and reply) needs no allocation here.
  constexpr std::size_t kInline = 8;
  unsigned char inline_heads[8 * kInline];
  iovec inline_iov[2 * kInline];
  std::size_t inline_frame_of[2 * kInline];
  std::vector<unsigned char> more_heads;
  std::vector<iovec> more_iov;
  std::vector<std::size_t> more_frame_of;
  unsigned char* heads = inline_heads;
  iovec* iov = inline_iov;
  std::size_t* frame_of = inline_frame_of;  // by iovec: its frame + 1 for a payload, 0 for a head
  if (frames.size() > kInline) {
    more_heads.resize(frames.size() * 8);
    more_iov.resize(frames.size() * 2);
    more_frame_of.resize(frames.size() * 2);
    heads = more_heads.data();
    iov = more_iov.data();
    frame_of = more_frame_of.data();
  }
  std::size_t count = 0;  // iovecs
  for (std::size_t i = 0; i < frames.size(); ++i) {
    const std::uint64_t size = frames[i].size();
    put_u64(heads + 8 * i, size | (i + 1 < frames.size() ? kMore : 0));
    frame_of[count] = 0;
    iov[count++] = {heads + 8 * i, 8};
    if (size == 0) continue;
    frame_of[count] = i + 1;
    iov[count++] = {frames[i].data(), size};
  }
  std::size_t done = 0;  // iovecs written whole
  if (now && !has_output()) {
    while (done < count) {
      const std::size_t batch = std::min<std::size_t>(count - done, IOV_MAX);
      ssize_t n;
      if (!write_end_) {
        msghdr msg{};
        msg.msg_iov = iov + done;
        msg.msg_iovlen = batch;
        n = ::sendmsg(read_end_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      } else {
        n = ::writev(write_end_.get(), iov + done, static_cast<int>(batch));
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        write_failed(errno);
      }
      std::size_t left = static_cast<std::size_t>(n);
      while (left > 0 && left >= iov[done].iov_len) left -= iov[done++].iov_len;
      if (left > 0) {  // part of one iovec: the rest of it starts the next write
        iov[done].iov_base = static_cast<char*>(iov[done].iov_base) + left;
        iov[done].iov_len -= left;
        break;
      }
    }
  }
  // What the socket did not take waits, after what waited already: a large frame's payload as
  // the frame itself (not copied), the rest as bytes.
  for (std::size_t i = done; i < count; ++i) {
    if (frame_of[i] != 0 && iov[i].iov_len >= kHoldBytes) {
      zmq::message_t& f = frames[frame_of[i] - 1];
      const std::size_t at = f.size() - iov[i].iov_len;
      zmq::message_t kept;
      if (shared) {
        kept.copy(f);  // a reference to the same bytes
      } else {
        kept = std::move(f);
      }
      held_.push_back(Held{out_.size(), std::move(kept), at});
      continue;
    }
    const char* p = static_cast<const char*>(iov[i].iov_base);
    out_.insert(out_.end(), p, p + iov[i].iov_len);
  }
}

bool FrameStream::flush() {
  while (has_output()) {
    // The bytes before the next held frame, else that frame's payload.
    const std::size_t stop = held_.empty() ? out_.size() : held_.front().before;
    const bool bytes = out_begin_ < stop;
    Held* h = bytes ? nullptr : &held_.front();
    const char* data =
        bytes ? out_.data() + out_begin_ : static_cast<const char*>(h->frame.data()) + h->at;
    const std::size_t size = bytes ? stop - out_begin_ : h->frame.size() - h->at;
    const ssize_t n = write_end_ ? ::write(write_end_.get(), data, size)
                                 : ::send(read_end_.get(), data, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      write_failed(errno);
    }
    if (bytes) {
      out_begin_ += static_cast<std::size_t>(n);
    } else if ((h->at += static_cast<std::size_t>(n)) == h->frame.size()) {
      held_.pop_front();
    }
  }
  if (!has_output()) {
    out_.clear();
    out_begin_ = 0;
    return true;
  }
  if (out_begin_ > out_.size() / 2) {  // what was written goes, so that the outbox stays small
    out_.erase(out_.begin(), out_.begin() + static_cast<std::ptrdiff_t>(out_begin_));
    for (Held& held : held_) held.before -= out_begin_;
    out_begin_ = 0;
  }
  return false;
}

bool FrameStream::flush_wait(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  while (!flush()) {
    long left = -1;
    if (timeout.count() >= 0) {
      left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
    }
    pollfd p{out_fd(), POLLOUT, 0};
    if (::poll(&p, 1, static_cast<int>(left)) < 0 && errno != EINTR)
      throw TransportError(fmt::format("cannot wait on a stream: {}", std::strerror(errno)));
  }
  return true;
}

bool FrameStream::whole(std::size_t& pos, std::size_t& count) {
  pos = in_begin_;
  count = 0;
  for (;;) {
    if (in_end_ - pos < 8) {
      want_ = pos - in_begin_ + 8;
      return false;
    }
    const std::uint64_t head = get_u64(in_.data() + pos);
    const std::uint64_t size = head & ~kMore;
    if (size > kMaxFrame) {
      closed_ = true;
      error_ = fmt::format("a frame of {} bytes (the framing is broken)", size);
      in_begin_ = in_end_ = 0;
      return false;
    }
    if (in_end_ - pos - 8 < size) {
      want_ = pos - in_begin_ + 8 + static_cast<std::size_t>(size);
      return false;
    }
    pos += 8 + static_cast<std::size_t>(size);
    ++count;
    if (!(head & kMore)) return true;
  }
}

std::optional<Message> FrameStream::take_message(ShmChannel* shm) {
  std::size_t pos = 0, count = 0;
  if (!whole(pos, count)) return std::nullopt;
  if (count > 1 || pos - in_begin_ >= kAdoptBytes) {
    auto frames = take();
    return decode_message(std::move(*frames), shm);
  }
  // Taken before it is decoded (a message that does not decode is gone too); its bytes stay
  // where they are until the next read.
  const char* data = in_.data() + in_begin_ + 8;
  const std::size_t size = pos - in_begin_ - 8;
  in_begin_ = pos;
  want_ = 0;
  if (in_begin_ == in_end_) in_begin_ = in_end_ = 0;
  return decode_message(data, size, shm);
}

std::optional<Frames> FrameStream::take() {
  std::size_t pos = 0, count = 0;
  if (!whole(pos, count)) return std::nullopt;
  Frames frames;
  frames.reserve(count);
  if (pos - in_begin_ >= kAdoptBytes) {
    auto held = std::make_shared<Buffer>(std::move(in_));
    in_ = Buffer(held->begin() + static_cast<std::ptrdiff_t>(pos),
                 held->begin() + static_cast<std::ptrdiff_t>(in_end_));
    for (std::size_t p = in_begin_; p < pos;) {
      const auto size = static_cast<std::size_t>(get_u64(held->data() + p) & ~kMore);
      if (size == 0) {
        frames.emplace_back();
      } else {
        frames.emplace_back(held->data() + p + 8, size, &release_buffer_of<Buffer>,
                            new std::shared_ptr<Buffer>(held));
      }
      p += 8 + size;
    }
    in_begin_ = 0;
    in_end_ = in_.size();
    want_ = 0;
    return frames;
  }
  for (std::size_t p = in_begin_; p < pos;) {
    const auto size = static_cast<std::size_t>(get_u64(in_.data() + p) & ~kMore);
    frames.emplace_back(in_.data() + p + 8, size);
    p += 8 + size;
  }
  in_begin_ = pos;
  want_ = 0;
  if (in_begin_ == in_end_) in_begin_ = in_end_ = 0;
  return frames;
}

FrameStream::Read FrameStream::read() {
  if (closed_) return Read::closed;
  // Room for the message being read in one piece, and at least a chunk more.
  const std::size_t have = in_end_ - in_begin_;
  const std::size_t need = std::max(kReadChunk, want_ > have ? want_ - have : 0);
  if (in_.size() - in_end_ < need) {
    if (in_begin_ > 0) {
      std::memmove(in_.data(), in_.data() + in_begin_, have);
      in_begin_ = 0;
      in_end_ = have;
    }
    if (in_.size() - in_end_ < need) in_.resize(std::max(in_.size() * 2, in_end_ + need));
  }
  const std::size_t room = in_.size() - in_end_;
  for (;;) {
    const ssize_t n = ::read(read_end_.get(), in_.data() + in_end_, room);
    if (n > 0) {
      in_end_ += static_cast<std::size_t>(n);
      drained_ = static_cast<std::size_t>(n) < room;
      return Read::data;
    }
    if (n == 0) {
      closed_ = true;
      return Read::closed;
    }
    if (errno == EINTR) continue;
    // Empty: the caller polls before it reads again, so the next recv reads (drained_ would
    // skip that read and cost another turn of the caller's loop).
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      drained_ = false;
      return Read::empty;
    }
    closed_ = true;
    if (!gone(errno)) error_ = std::strerror(errno);
    return Read::closed;
  }
}

template <class Take>
auto FrameStream::recv_with(Take&& take, bool* read_data) -> decltype(take()) {
  for (;;) {
    if (auto m = take()) return m;
    if (closed_) return std::nullopt;
    // The last read emptied the socket: nothing more until a poll says so (poll on a socket is
    // level-triggered, so what came since is not missed).
    if (drained_) {
      drained_ = false;
      return std::nullopt;
    }
    if (read() != Read::data) return std::nullopt;
    if (read_data) *read_data = true;
  }
}

std::optional<Frames> FrameStream::recv(bool* read_data) {
  return recv_with([this] { return take(); }, read_data);
}

std::optional<Message> FrameStream::recv_message(ShmChannel* shm, bool* read_data) {
  return recv_with([this, shm] { return take_message(shm); }, read_data);
}

bool CoalescedWrites::write(FrameStream& stream, Frames& frames, bool shared) {
  const bool wait = unanswered > 0;
  std::lock_guard lock(mu);
  if (shared) {
    stream.send_shared(frames, !wait);
  } else {
    stream.send(std::move(frames), !wait);
  }
  ++unanswered;
  return stream.has_output();
}

void CoalescedWrites::flush(FrameStream& stream, std::vector<int>& full) {
  std::lock_guard lock(mu);
  try {
    if (stream.has_output() && !stream.flush()) full.push_back(stream.out_fd());
  } catch (const TransportError&) {
    // The other end is gone (peer_gone says so where the stream is read), or the write failed:
    // the next send throws it.
  }
}

long poll_wait_ms(bool holding, bool forever, std::chrono::steady_clock::time_point deadline) {
  if (holding) return 0;
  if (forever) return -1;
  return std::max<long>(0, std::chrono::duration_cast<std::chrono::milliseconds>(
                               deadline - std::chrono::steady_clock::now())
                               .count());
}

std::optional<Message> PolledStream::take(ShmChannel* shm, DropLog& drops,
                                          const std::string& who) const {
  for (;;) {
    try {
      auto m = stream->take_message(shm);
      if (!m) break;
      return m;
    } catch (const TransportError& err) {
      drops.drop(fmt::format("from worker {}: {}", who, err.what()));
    }
  }
  if (stream->closed() && !stream->error().empty() && !*broken) {
    *broken = true;
    drops.drop(fmt::format("from worker {}: {}", who, stream->error()));
  }
  return std::nullopt;
}

bool PolledStream::read_ready() const {
  if (!stream || !*readable) return false;
  if (stream->read() == FrameStream::Read::data) {
    writes->heard();
    *readable = !stream->drained();
    return true;
  }
  *readable = false;
  return false;
}

void PolledStream::add_entries(std::vector<pollfd>& polled) const {
  const bool open = stream && !stream->closed();
  polled.push_back(pollfd{open ? stream->in_fd() : -1, POLLIN, 0});
  bool out = false;
  if (open) {
    std::lock_guard lock(writes->mu);
    out = stream->has_output();
  }
  polled.push_back(pollfd{out ? stream->out_fd() : -1, POLLOUT, 0});
}

bool PolledStream::polled(const pollfd* entries) const {
  if (!stream) return false;
  // POLLERR on a pipe's write end: its reader is gone (flush says so).
  if (entries[1].revents & (POLLOUT | POLLERR)) {
    try {
      std::lock_guard lock(writes->mu);
      stream->flush();
    } catch (const TransportError&) {
      // That worker is gone: its launcher reports it.
    }
  }
  if (entries[0].revents & (POLLIN | POLLHUP | POLLERR)) return *readable = true;
  return false;
}

Flusher::Flusher(std::function<std::vector<int>()> flush) : flush_(std::move(flush)) {
  wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_)
    throw TransportError(fmt::format("cannot create an eventfd: {}", std::strerror(errno)));
}

Flusher::~Flusher() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  thread_.join();
}

void Flusher::arm() {
  // The thread starts with the first message that waits: a run whose messages never wait (round
  // trips only) starts none.
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  if (armed_.exchange(true)) return;
  if (waiting_) {
    const std::uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
    return;
  }
  // The thread sleeps on mu_ until armed: a notify under the lock cannot be missed.
  std::lock_guard lock(mu_);
  cv_.notify_one();
}

void Flusher::loop() {
  // A sleep of kCoalesce, not of the default timer slack (50 us) more.
  (void)::prctl(PR_SET_TIMERSLACK, 1000UL);
  const auto coalesce_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(kCoalesce).count();
  const timespec coalesce{0, static_cast<long>(coalesce_ns)};
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || armed_.load(); });
    if (stop_) return;
    cv_.wait_for(lock, kCoalesce, [&] { return stop_; });
    if (stop_) return;
    lock.unlock();
    // Disarmed before writing: a message that waits from now on arms the thread again, and one
    // that waited before is written by this flush.
    armed_ = false;
    std::vector<int> full = flush_();
    std::vector<pollfd> fds;
    while (!full.empty()) {
      // Room in a full pipe, or kCoalesce after a message waited meanwhile (to a stream that may
      // have room), or the end. An arm rings wake_ once (armed_ stays set until the next flush),
      // so a writer that keeps sending to a full pipe wakes this thread at most once a kCoalesce,
      // not once a message.
      fds.clear();
      for (int fd : full) fds.push_back(pollfd{fd, POLLOUT, 0});
      fds.push_back(pollfd{wake_.get(), POLLIN, 0});
      waiting_ = true;
      const bool armed = armed_;
      int rc;
      do {
        rc = ::ppoll(fds.data(), fds.size(), armed ? &coalesce : nullptr, nullptr);
      } while (rc < 0 && errno == EINTR);
      waiting_ = false;
      if (fds.back().revents) {
        std::uint64_t n;
        (void)!::read(wake_.get(), &n, sizeof n);
      }
      {
        std::lock_guard stop(mu_);
        if (stop_) return;
      }
      const bool room =
          std::any_of(fds.begin(), fds.end() - 1, [](const pollfd& p) { return p.revents != 0; });
      // Rung by an arm: the message is written with the others a kCoalesce from now.
      if (!room && !(armed && rc == 0)) continue;
      armed_ = false;
      full = flush_();
    }
    lock.lock();
  }
}

}  // namespace twinkle::transport
