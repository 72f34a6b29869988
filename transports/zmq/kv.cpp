#include "transports/zmq/kv.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <vector>

#include <fmt/format.h>

#include "transports/zmq/channel.hpp"
#include "transports/zmq/message.hpp"
#include "twinkle/errors.hpp"

namespace twinkle::transport {

KvServer::KvServer(zmq::context_t& context, const std::string& endpoint,
                   const SocketSecurity& security)
    : endpoint_(endpoint), context_(context) {
  if (endpoint.starts_with("ipc://") && endpoint.size() - 6 > kMaxSocketPath) {
    throw TransportError(fmt::format(
        "the rendezvous socket path {} is {} characters long, more than a Unix socket allows ({}); "
        "set TMPDIR to a shorter folder",
        endpoint.substr(6), endpoint.size() - 6, kMaxSocketPath));
  }
  // Bind here so that a bad endpoint fails the caller, then serve on the thread.
  auto socket = std::make_shared<zmq::socket_t>(context_, zmq::socket_type::router);
  socket->set(zmq::sockopt::linger, 0);
  secure_server(*socket, security);
  try {
    socket->bind(endpoint_);
  } catch (const zmq::error_t& e) {
    throw TransportError(
        fmt::format("cannot bind the rendezvous store {}: {}", endpoint_, e.what()));
  }
  // "tcp://HOST:*" binds an ephemeral port: the endpoint is the one that was bound.
  endpoint_ = socket->get(zmq::sockopt::last_endpoint);
  wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_)
    throw TransportError(fmt::format("cannot create an eventfd: {}", std::strerror(errno)));
  thread_ = std::thread([this, socket] { serve(*socket); });
}

KvServer::~KvServer() {
  stop_ = true;
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();
}

void KvServer::retire(std::vector<std::string> prefixes, std::string reason) {
  {
    std::lock_guard lock(retire_mu_);
    for (auto& p : prefixes) retiring_.emplace_back(std::move(p), reason);
  }
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void KvServer::serve(zmq::socket_t& socket) {
  std::map<std::string, std::string> values;
  std::map<std::string, std::vector<std::pair<std::string, std::uint64_t>>> waiting;
  std::vector<std::pair<std::string, std::string>> retired;  // prefix, reason
  auto answer = [&](const std::string& to, std::uint64_t id, const std::string& value,
                    const std::string* error = nullptr) {
    proto::KvValue v;
    v.value.data.assign(value.begin(), value.end());
    if (error) v.error = *error;
    try {
      send_message(socket, Message{id, std::move(v)}, &to);
    } catch (const zmq::error_t&) {
      // The asker is gone.
    }
  };
  auto retired_reason = [&](const std::string& key) -> const std::string* {
    for (const auto& [prefix, reason] : retired) {
      if (key.starts_with(prefix)) return &reason;
    }
    return nullptr;
  };
  DropLog drops("the rendezvous store");
  while (!stop_) {
    // Waits for a request or for a wake-up (the destructor, retire): no polling interval.
    zmq::pollitem_t items[2] = {{socket.handle(), 0, ZMQ_POLLIN, 0},
                                {nullptr, wake_.get(), ZMQ_POLLIN, 0}};
    zmq::poll(items, 2, std::chrono::milliseconds(-1));
    if (stop_) break;
    if (items[1].revents & ZMQ_POLLIN) {
      std::uint64_t n = 0;
      (void)!::read(wake_.get(), &n, sizeof n);
      std::lock_guard lock(retire_mu_);
      for (auto& r : retiring_) retired.push_back(std::move(r));
      retiring_.clear();
      for (auto w = waiting.begin(); w != waiting.end();) {
        if (const std::string* why = retired_reason(w->first)) {
          for (const auto& [to, id] : w->second) answer(to, id, "", why);
          w = waiting.erase(w);
        } else {
          ++w;
        }
      }
    }
    std::string from;
    std::optional<Message> m;
    try {
      // A malformed request is dropped; its sender times out with a clear message.
      auto frames = recv_frames(socket, 0, &from);
      if (!frames) continue;
      m = decode_message(std::move(*frames));
    } catch (const TransportError& e) {
      drops.drop(e.what());
      continue;
    }
    if (auto* set = m->get<proto::KvSet>()) {
      std::string value(set->value.data.begin(), set->value.data.end());
      values[set->key] = value;
      if (auto w = waiting.find(set->key); w != waiting.end()) {
        for (const auto& [to, id] : w->second) answer(to, id, value);
        waiting.erase(w);
      }
    } else if (auto* get = m->get<proto::KvGet>()) {
      if (auto v = values.find(get->key); v != values.end()) {
        answer(from, m->id, v->second);
      } else if (const std::string* why = retired_reason(get->key)) {
        answer(from, m->id, "", why);
      } else {
        waiting[get->key].emplace_back(from, m->id);
      }
    } else {
      drops.drop(fmt::format("a {} message is not a request to the store", to_string(m->type())));
    }
  }
}

KvClient::KvClient(zmq::context_t& context, const std::string& endpoint,
                   const SocketSecurity& security)
    : socket_(context, zmq::socket_type::dealer) {
  socket_.set(zmq::sockopt::linger, 1000);
  secure_client(socket_, security);
  socket_.connect(endpoint);
}

void KvClient::set(const std::string& key, const std::string& value) {
  std::lock_guard lock(mu_);
  proto::KvSet set;
  set.key = key;
  set.value.data.assign(value.begin(), value.end());
  send_message(socket_, Message{0, std::move(set)});
}

std::string KvClient::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::lock_guard lock(mu_);
  const std::uint64_t id = ++next_id_;
  send_message(socket_, Message{id, proto::KvGet{key}});
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      throw TransportError(
          fmt::format("rendezvous: key \"{}\" was not set within {} ms (a peer did not join)", key,
                      timeout.count()));
    }
    auto frames = recv_frames(socket_, static_cast<int>(left.count()));
    if (!frames) continue;
    Message m;
    try {
      m = decode_message(std::move(*frames));
    } catch (const ProtocolError&) {
      continue;  // not the store's answer; the deadline still holds
    }
    // Answers to earlier requests that timed out are skipped.
    const auto* v = m.get<proto::KvValue>();
    if (!v || m.id != id) continue;
    if (v->error) throw TransportError(fmt::format("rendezvous: key \"{}\": {}", key, *v->error));
    return std::string(v->value.data.begin(), v->value.data.end());
  }
}

}  // namespace twinkle::transport
