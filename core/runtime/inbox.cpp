#include "core/runtime/inbox.hpp"

#include <fmt/format.h>

namespace twinkle::core {

namespace proto = transport::proto;
using transport::Message;

Inbox::Inbox(transport::WorkerLink& link, transport::ServeSocket& serve, GroupCalls& calls,
             Communicators& comms, std::function<std::string(const Message&)> what)
    : link_(link),
      serve_(serve),
      calls_(calls),
      comms_(comms),
      what_(std::move(what)),
      link_level_(link.waitable().level_triggered()),
      serve_level_(serve.waitable().level_triggered()) {}

std::optional<Inbox::Pending> Inbox::take() {
  if (waiting() == 0) return std::nullopt;
  // What runs may use a ZeroMQ socket (its descriptor then no longer wakes for what waits).
  link_quiet_ = link_quiet_ && link_level_;
  serve_quiet_ = serve_quiet_ && serve_level_;
  Pending p = std::move(queue_[head_++]);
  // The slots are kept for the next messages: taken ones go when all are, or when they are more
  // than half of a long queue.
  if (head_ == queue_.size()) {
    queue_.clear();
    head_ = 0;
  } else if (head_ >= 64 && 2 * head_ >= queue_.size()) {
    queue_.erase(queue_.begin(), queue_.begin() + static_cast<std::ptrdiff_t>(head_));
    head_ = 0;
  }
  return p;
}

void Inbox::wait() {
  // A socket is read until empty before waiting (wait_readable's condition), unless it is quiet:
  // a local worker's pipe and serve socket are read only when a poll says they have something
  // (three system calls a call: the poll, a read, the answer's write).
  if (!link_quiet_) read_link();
  if (!serve_quiet_) read_serve();
  if (waiting() == 0) {
    const transport::Woke woke = transport::wait_readable({link_.waitable(), serve_.waitable()}, -1,
                                                          std::chrono::milliseconds(-1));
    // A socket that was read empty and did not wake has nothing, and nothing runs before the
    // next wait: the next wait does not read it.
    link_quiet_ = link_level_ && (woke.sockets & 1u) == 0;  // a DEALER is read all the same
    serve_quiet_ = (woke.sockets & 2u) == 0;
  }
}

// Messages from the driver: a lost worker and a communicator's membership take effect at once (a
// call in progress may need them); the rest waits its turn.
void Inbox::read_link() {
  while (auto m = link_.recv_ready()) {
    if (auto* lost = m->get<proto::PeerLost>()) {
      calls_.peer_lost(lost->peer, std::move(lost->text));
    } else if (auto* join = m->get<proto::CommJoin>()) {
      comms_.join(*join);
    } else if (auto* moved = m->get<proto::PeersReplaced>()) {
      // A group restarted: its new workers serve elsewhere; calls waiting on the old fail.
      calls_.peers_replaced(*moved);
    } else if (m->get<proto::Create>() || m->get<proto::Call>() || m->get<proto::Shutdown>() ||
               m->get<proto::Save>() || m->get<proto::Regroup>() || m->get<proto::Recover>()) {
      queue_.push_back(Pending{"", std::move(*m)});
    } else {
      link_.drop(fmt::format("a {} message from the driver is not for a worker",
                             transport::to_string(m->type())));
    }
  }
  link_quiet_ = link_level_;
}

// Requests from other workers. While this worker is in a call, one that this call (directly or
// through others) waits for is a cycle: answered at once with an error naming it.
void Inbox::read_serve() {
  while (auto r = serve_.recv(std::chrono::milliseconds(0))) {
    Message& m = r->message;
    if (!calls_.peer_index(r->from)) {
      // Not a worker of this run (it cannot be one: they all are in the address book).
      serve_.drop(fmt::format("a {} message from \"{}\", not a worker of this run",
                              transport::to_string(m.type()), r->from.substr(0, 64)));
      continue;
    }
    if (auto* probe = m.get<proto::Probe>()) {
      calls_.chain().on_probe(*probe);
      continue;
    }
    if (m.get<proto::StatePull>()) {  // a replacement of this worker's group: in turn
      queue_.push_back(Pending{std::move(r->from), std::move(m)});
      continue;
    }
    if (!m.get<proto::Create>() && !m.get<proto::Call>()) {
      serve_.drop(fmt::format("a {} message from worker {} is not a call",
                              transport::to_string(m.type()), r->from));
      continue;
    }
    if (auto cycle = calls_.chain().find_cycle(chain_of(m), r->from, what_(m), caller_of(m))) {
      if (m.get<proto::Create>()) {
        serve_.reply(r->from, Message{m.id, proto::Created{*cycle}});
      } else {
        serve_.reply(r->from, Message{m.id, proto::Reply{*cycle, {}}});
      }
      continue;
    }
    queue_.push_back(Pending{std::move(r->from), std::move(m)});
  }
  serve_quiet_ = serve_level_;
}

const CallChain::Chain& Inbox::chain_of(const Message& m) {
  static const CallChain::Chain none;
  if (const auto* c = m.get<proto::Create>()) return c->chain;
  if (const auto* c = m.get<proto::Call>()) return c->chain;
  return none;
}

const std::string& Inbox::caller_of(const Message& m) {
  static const std::string none;
  if (const auto* c = m.get<proto::Call>()) return c->caller;
  return none;
}

}  // namespace twinkle::core
