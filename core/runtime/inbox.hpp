#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/runtime/communicators.hpp"
#include "core/runtime/group_calls.hpp"
#include "transports/zmq/channel.hpp"
#include "transports/zmq/peers.hpp"

// What a welcomed worker is asked to do (docs/ARCHITECTURE.md, Calls between groups): the
// driver's messages on its link and other workers' requests on its serve socket, each read until
// empty. What runs in turn (creates, calls, checkpoints, regroups, recoveries, state pulls, the
// shutdown) is queued in arrival order; what a running call may need takes effect at once (a lost
// worker, a communicator's membership, replaced workers); a request that would close a cycle of
// calls is answered at once with the cycle as its error. Used from the worker's thread, also
// while a call of its own waits for another group (GroupCalls runs read_link and read_serve).
namespace twinkle::core {

class Inbox {
 public:
  // Something to run: a message from the driver (`from` empty) or a request from another worker.
  struct Pending {
    std::string from;
    transport::Message message;
  };

  // `what`: "Trainer.step" for a request (its class from the worker's instances).
  Inbox(transport::WorkerLink& link, transport::ServeSocket& serve, GroupCalls& calls,
        Communicators& comms, std::function<std::string(const transport::Message&)> what);

  // The next thing to run, in arrival order; nullopt when nothing waits.
  std::optional<Pending> take();
  // Reads both sockets and, when nothing waits its turn, waits until one of them is readable.
  void wait();

  void read_link();
  void read_serve();

  // The chain of calls that led to a create or call (none for other messages), and a call's
  // call site.
  static const CallChain::Chain& chain_of(const transport::Message& m);
  static const std::string& caller_of(const transport::Message& m);

 private:
  transport::WorkerLink& link_;
  transport::ServeSocket& serve_;
  GroupCalls& calls_;
  Communicators& comms_;
  std::function<std::string(const transport::Message&)> what_;
  // In arrival order from head_; a vector, not a deque: a deque of these (one a node) allocates
  // at every message.
  std::vector<Pending> queue_;
  std::size_t head_ = 0;
  std::size_t waiting() const { return queue_.size() - head_; }
  // A socket needs no read before the next wait: the last wait found it empty and it did not wake,
  // or it was read empty and its poll says when more comes (Waitable::level_triggered).
  bool link_quiet_ = false;
  bool serve_quiet_ = false;
  const bool link_level_;  // their Waitable::level_triggered
  const bool serve_level_;
};

}  // namespace twinkle::core
