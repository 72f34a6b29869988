#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <zmq.hpp>

#include "transports/zmq/auth.hpp"
#include "transports/zmq/message.hpp"
#include "transports/zmq/protocol.hpp"
#include "twinkle/fd.hpp"

namespace twinkle::core::cluster {

using transport::MsgType;
using Message = transport::ClusterMessage;
namespace proto = transport::proto;

// A member's connection to the head (agents, drivers, `twinkle nodes`): a DEALER over TCP with
// CURVE and heartbeats. First synchronous requests, then (after start) a thread that hands
// incoming messages to a handler, sends a beat every heartbeat interval, and sends what other
// threads post.
class HeadLink {
 public:
  using Handler = std::function<void(Message&)>;
  using Beat = std::function<std::optional<Message>()>;

  // Connects and waits up to `handshake` for the head to accept this member; throws
  // TransportError naming the fix when it refuses or does not answer.
  HeadLink(const std::string& address, const transport::SocketSecurity& security,
           const std::string& identity,
           std::chrono::milliseconds handshake = std::chrono::seconds(5));
  HeadLink(const HeadLink&) = delete;
  HeadLink& operator=(const HeadLink&) = delete;
  ~HeadLink();

  const std::string& address() const { return address_; }

  // Sends `m` and waits up to `timeout` for a message of type `expect` with its id (before
  // start(), others are dropped; after it, they go to the handler and the answer is taken off the
  // link's thread: `m` needs an id then). Throws TransportError when none comes.
  Message request(const Message& m, MsgType expect, std::chrono::milliseconds timeout);
  // The same, returning the answer's body.
  template <class Answer>
  Answer request(const Message& m, std::chrono::milliseconds timeout) {
    return std::get<Answer>(request(m, Answer::kType, timeout).body);
  }

  // Before start(): sends `m` and expects no answer.
  void send(const Message& m) { transport::send_message(socket_, m); }

  // Starts the thread. `on_message` and `beat` run on it.
  void start(Handler on_message, Beat beat);
  // Thread-safe: queues `m` for the head (dropped when the head is unreachable for long).
  void post(Message m);
  // Sends what is queued, then stops the thread (waiting up to `linger` for the head to take it).
  void stop(std::chrono::milliseconds linger = std::chrono::milliseconds(1000));

  // This member's address as the head sees it: the local address of the route to the head.
  std::string local_address() const;

 private:
  void loop();
  void flush_outbox();
  // The link's thread: whether `m` answers a request() made after start() (then it is handed to
  // that request).
  bool answered(Message& m);

  // A request() after start() that waits for its answer.
  struct Waiting {
    MsgType expect;
    std::promise<Message> answer;
  };

  std::string address_;
  zmq::context_t context_;
  zmq::socket_t socket_;
  Handler on_message_;
  Beat beat_;
  Fd wake_;
  std::mutex mu_;
  std::deque<Message> outbox_;
  std::map<std::uint64_t, Waiting> waiting_;  // by request id (mu_)
  std::atomic<bool> stop_{false};
  transport::DropLog drops_{"the link to the head"};  // the link's thread's
  std::thread thread_;
};

// The host part of "tcp://HOST:PORT".
std::string endpoint_host(const std::string& endpoint);
// The local address this machine uses to reach `host` (the route's source address): what the
// peers of a cluster are told to connect to.
std::string route_source_address(const std::string& host);

}  // namespace twinkle::core::cluster
