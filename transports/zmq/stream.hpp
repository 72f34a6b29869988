#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "transports/zmq/message.hpp"
#include "twinkle/fd.hpp"

// The wire protocol's messages over a byte stream: a pair of pipes (the control channel between the
// driver and a local worker, docs/ARCHITECTURE.md, Sockets) or a Unix stream socket. The frames of
// message.hpp, each preceded by its length, written and read by the threads that use them. No I/O
// thread stands between the caller and the kernel, which is what a ZeroMQ socket costs per message
// (two thread wake-ups a side).
namespace twinkle::transport {

namespace detail {
// An allocator whose elements start uninitialised: a read buffer is written by read() before
// anything looks at it, so growing it need not zero it first.
template <class T>
struct UninitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <class U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}  // NOLINT: as std::allocator's
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    if constexpr (sizeof...(Args) == 0) {
      ::new (static_cast<void*>(p)) U;
    } else {
      ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
  }
};
}  // namespace detail

// One end of the stream, non-blocking. On the wire every frame is a u64 (little endian): its
// length in the low 63 bits and, in bit 63, whether another frame of the same message follows;
// then its bytes. Used from one thread.
class FrameStream {
 public:
  // Takes over `socket` (a SOCK_STREAM Unix socket, read and written) and makes it non-blocking.
  // Throws TransportError when it cannot.
  explicit FrameStream(Fd socket);
  // Reads `in` and writes `out` (the ends of two pipes), both made non-blocking. Writing to a pipe
  // whose reader is gone raises SIGPIPE: a process that writes to one ignores it (the driver and
  // the workers do). With `large_pipes` both pipes are asked to hold 512 KiB (a driver's burst of
  // calls); without, they keep the kernel's 64 KiB (the many connections between workers, each of
  // which counts against the user's pipe allowance). Throws TransportError when it cannot.
  FrameStream(Fd in, Fd out, bool large_pipes = true);
  FrameStream(const FrameStream&) = delete;
  FrameStream& operator=(const FrameStream&) = delete;

  // What is read (poll it for POLLIN) and what is written (POLLOUT); the same for a socket.
  int in_fd() const { return read_end_.get(); }
  int out_fd() const { return write_end_ ? write_end_.get() : read_end_.get(); }

  // Writes `frames` as far as the socket takes them now; the rest waits in the outbox for
  // flush(), in order. With `now` false, all of it waits (a later flush() writes it with what
  // comes after it, in one system call). Never blocks. Throws TransportError when the other end
  // is gone (then peer_gone()); what it sent before is still read, up to its end.
  //
  // The write side (send, flush, flush_wait, has_output) and the read side (take, read, recv)
  // share no state but an atomic flag: one thread may read while another writes, and a write
  // side used by two threads is guarded by its user (LocalDriverChannel). peer_gone() looks at
  // both: ask it where the stream is read.
  void send(Frames&& frames, bool now = true) { write_frames(frames, now, false); }
  // send() of frames that other streams are sent too (one encoding of a message to several
  // workers): they stay as they are; what waits keeps a reference to a large frame, or a copy.
  void send_shared(Frames& frames, bool now = true) { write_frames(frames, now, true); }
  // Writes what waits in the outbox as far as the socket takes it; true when it is empty. Throws
  // TransportError when the other end is gone.
  bool flush();
  // flush() until the outbox is empty, waiting up to `timeout` (negative: no limit) for room;
  // false when time ran out.
  bool flush_wait(std::chrono::milliseconds timeout);
  bool has_output() const { return out_begin_ < out_.size() || !held_.empty(); }

  // The next whole message that was read already, without reading the socket.
  std::optional<Frames> take();
  // The same, decoded (decode_message with `shm`); a message of one frame is decoded where it
  // lies in the stream's buffer, without a copy. Throws ProtocolError for one that does not
  // decode: it is taken all the same.
  std::optional<Message> take_message(ShmChannel* shm);
  enum class Read { data, empty, closed };
  // One read of what the socket has. `data`: bytes came (take() may have a message now);
  // `empty`: nothing was there; `closed`: the other end is gone and everything it sent was read.
  // A stream that breaks the framing (a frame longer than kMaxFrame) is closed too: its bytes
  // cannot be trusted past that point. `error()` says why.
  Read read();
  // take(), else read() and take() again, until a message or nothing more: the next message.
  // `read_data`, when given, is set when a read got bytes.
  std::optional<Frames> recv(bool* read_data = nullptr);
  // The same with take_message: the next message, decoded. Throws as take_message does.
  std::optional<Message> recv_message(ShmChannel* shm, bool* read_data = nullptr);
  bool closed() const { return closed_; }
  // The other end is gone (a write found it so, or a read reached its end), as opposed to a
  // stream closed for an error of its own (error()).
  bool peer_gone() const { return write_gone_ || (closed_ && error_.empty()); }
  // The last read got bytes and left the socket empty.
  bool drained() const { return drained_; }
  // Why the stream closed ("" for the other end's close). A failed write is not a close: send
  // and flush throw it.
  const std::string& error() const { return error_; }

  // A frame longer than this is no frame of Twinkle's: the framing is broken.
  static constexpr std::uint64_t kMaxFrame = std::uint64_t{1} << 40;

 private:
  void write_frames(Frames& frames, bool now, bool shared);
  // A write failed with `err`: nothing more is written (the other end is gone, or write_error_
  // says why); what it sent is still read. Throws TransportError.
  [[noreturn]] void write_failed(int err);

  Fd read_end_;   // read; written too (with sendmsg, MSG_NOSIGNAL) when write_end_ is empty
  Fd write_end_;  // written with writev, when it is not read_end_ (a pipe)
  // A message of kAdoptBytes or more is not copied out of the read buffer: its frames keep the
  // buffer, and reading goes on in a new one.
  // Whether a whole message starts at in_begin_: then `pos` is where it ends and `count` its
  // frames. Else want_ says how many bytes it needs (or the stream is closed, its framing broken).
  bool whole(std::size_t& pos, std::size_t& count);
  // recv() and recv_message(), with the take they use.
  template <class Take>
  auto recv_with(Take&& take, bool* read_data) -> decltype(take());
  static constexpr std::size_t kAdoptBytes = std::size_t{1} << 20;
  using Buffer = std::vector<char, detail::UninitAllocator<char>>;
  Buffer in_;  // [in_begin_, in_end_) read and not taken yet
  std::size_t in_begin_ = 0, in_end_ = 0;
  std::size_t want_ = 0;   // bytes the message at in_begin_ needs in all (0: not known)
  bool drained_ = false;   // the last read got less than it asked for: the socket is empty
  std::vector<char> out_;  // [out_begin_, end) waits to be written
  std::size_t out_begin_ = 0;
  // A frame payload of kHoldBytes or more that waits is kept as its frame, not copied into out_:
  // its bytes [at, size) go after out_'s first `before` bytes (and before the rest).
  static constexpr std::size_t kHoldBytes = std::size_t{64} << 10;
  struct Held {
    std::size_t before;
    zmq::message_t frame;
    std::size_t at;
  };
  std::deque<Held> held_;
  bool closed_ = false;
  std::atomic<bool> write_gone_{false};  // a write found the other end gone: reads go on to its end
  std::string write_error_;              // a write failed otherwise: nothing more is written
  std::string error_;
};

// A stream's write side shared by its writer's thread and a Flusher (LocalDriverChannel's peers,
// StreamWorkerLink): the lock both take, and when a message waits for the ones after it.
struct CoalescedWrites {
  // Sends `frames` on `stream` under `mu`: at once when something came from the other end since
  // the last message it was sent, else into the outbox. True when something waits there (the
  // caller arms its Flusher). Throws as FrameStream::send.
  bool send(FrameStream& stream, Frames&& frames) { return write(stream, frames, false); }
  // send() of frames that other streams are sent too (FrameStream::send_shared).
  bool send_shared(FrameStream& stream, Frames& frames) { return write(stream, frames, true); }
  // For the Flusher, under `mu`: writes what waits; adds the write end to `full` when its pipe is
  // still full. A failed write is left for the next send to report.
  void flush(FrameStream& stream, std::vector<int>& full);
  // Something came from the other end (a read got bytes): the next message is written at once.
  void heard() { unanswered = 0; }

  std::mutex mu;            // the stream's write side: send, flush, flush_wait, has_output
  unsigned unanswered = 0;  // messages sent since something came (the writer's thread only)

 private:
  bool write(FrameStream& stream, Frames& frames, bool shared);
};

// A peer's stream as a driver's channel polls it (LocalDriverChannel, StreamDriverChannel): its
// write side and whether the last poll found it readable.
struct PolledStream {
  FrameStream* stream = nullptr;  // nullptr: no connection (yet)
  CoalescedWrites* writes = nullptr;
  bool* readable = nullptr;  // the last poll said so, and no read emptied it since
  bool* broken = nullptr;    // its framing broke: reported once

  // The next whole message already read, decoded (with `shm` for shared-memory tensors); what
  // does not decode, and a framing that broke, go into `drops` naming worker `who`.
  std::optional<Message> take(ShmChannel* shm, DropLog& drops, const std::string& who) const;

  // One read if the last poll found input: true when bytes came.
  bool read_ready() const;
  // Its two poll entries: what it sent (POLLIN) and room for what waits for it (POLLOUT), each
  // -1 when there is nothing to wait for.
  void add_entries(std::vector<pollfd>& polled) const;
  // After the poll, with its two entries: writes what waits where there is room, notes input.
  // True when it has input.
  bool polled(const pollfd* entries) const;
};

// How long a driver's channel may wait in its poll: 0 while it holds an event to deliver, no
// limit (-1) without a deadline, else what is left until `deadline`.
long poll_wait_ms(bool holding, bool forever, std::chrono::steady_clock::time_point deadline);

// A thread that writes what waits in streams' outboxes (FrameStream::send with `now` false)
// kCoalesce after the first of it waited, so that a burst of messages to one peer costs one
// system call instead of one each (docs/ARCHITECTURE.md, Sockets). `flush` runs on that thread:
// it writes what waits, under the streams' own locks, and returns the write ends that still have
// output (their pipe is full); the thread waits for room in them and calls it again.
class Flusher {
 public:
  // How long a message may wait to be written with the ones after it.
  static constexpr std::chrono::microseconds kCoalesce{50};

  // Throws TransportError when the thread's eventfd cannot be made.
  explicit Flusher(std::function<std::vector<int>()> flush);
  ~Flusher();  // stops the thread; what still waits is its owner's to write
  Flusher(const Flusher&) = delete;
  Flusher& operator=(const Flusher&) = delete;

  // A message waits: it is written within kCoalesce (once its pipe has room). Called by one
  // thread only (the stream's writer), which starts the flusher's thread the first time.
  void arm();

 private:
  void loop();

  std::function<std::vector<int>()> flush_;
  std::atomic<bool> armed_{false};    // a message waits, and this thread will write it
  std::atomic<bool> waiting_{false};  // the thread waits for room: arm() wakes it through wake_
  std::mutex mu_;                     // stop_ and the thread's sleep
  std::condition_variable cv_;
  bool stop_ = false;
  Fd wake_;  // an eventfd: arm() and the destructor while the thread waits for room
  std::thread thread_;
};

}  // namespace twinkle::transport
