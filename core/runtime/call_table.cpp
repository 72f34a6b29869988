#include "core/runtime/call_table.hpp"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/runtime/heap_pages.hpp"

namespace twinkle::core {

namespace {

using Clock = std::chrono::steady_clock;
using transport::ChannelEvent;
using transport::Message;

Clock::time_point deadline_after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

CallTable::CallTable(transport::CallChannel& channel, std::vector<GroupInfo> groups,
                     std::vector<WorkerInfo> workers, CustomFunctions custom, double timeout_s,
                     std::uint64_t id_base)
    : channel_(channel),
      groups_(std::move(groups)),
      workers_(std::move(workers)),
      custom_(std::move(custom)),
      timeout_s_(timeout_s),
      next_id_(id_base) {
  for (const auto& g : groups_) mesh_abi_.push_back(std::make_unique<MeshAbi>(g.mesh));
}

std::optional<std::size_t> CallTable::find_group(std::string_view name) const {
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    if (groups_[i].name == name) return i;
  }
  return std::nullopt;
}

std::string CallTable::worker_label(std::size_t group, int index) const {
  const WorkerInfo& w = workers_[groups_[group].peers[static_cast<std::size_t>(index)]];
  return fmt::format("group {} rank {} (host {}, pid {})", groups_[group].name, index,
                     w.host.empty() ? "?" : w.host, w.pid);
}

std::string CallTable::lost_text(std::size_t peer, const std::string& reason) const {
  const WorkerInfo& w = workers_[peer];
  if (w.pid == 0) return fmt::format("worker {} {}", w.name, reason);
  return fmt::format("worker {} (host {}, pid {}) {}", w.name, w.host, w.pid, reason);
}

void CallTable::on_lost(std::size_t peer, const std::string& reason,
                        const std::vector<std::size_t>& with) {
  if (peer >= workers_.size() || expecting_exits_ || lost_) return;
  const std::size_t g = workers_[peer].group;
  // The workers being replaced are stopped on purpose (or gone) until their replacements start.
  if (auto it = restarting_.find(g); it != restarting_.end() &&
                                     it->second.phase == Restarting::Phase::waiting &&
                                     it->second.replaced.count(peer))
    return;
  std::string text = lost_text(peer, reason);
  if (restarts_.decide) {
    Restarts::Decision d = restarts_.decide(peer, text);
    if (d.after) {
      std::vector<std::size_t> peers{peer};
      for (std::size_t p : with) {
        if (p < workers_.size() && workers_[p].group == g && p != peer) peers.push_back(p);
      }
      return begin_restart(g, peers, text, *d.after);
    }
    if (!d.text.empty()) text = std::move(d.text);
  }
  lose(peer, std::move(text));
}

// The loss is final: every wait fails with it from now on.
void CallTable::lose(std::size_t peer, std::string text) {
  if (lost_) return;
  LostWorker l;
  l.peer = peer;
  l.text = std::move(text);
  const WorkerInfo& w = workers_[peer];
  for (const auto& [id, c] : calls_) {
    if (c.released || c.group != w.group) continue;
    const auto pos = std::find(c.workers.begin(), c.workers.end(), w.index) - c.workers.begin();
    if (pos >= static_cast<long>(c.workers.size())) continue;
    if (c.settled(static_cast<std::size_t>(pos))) continue;
    l.calls.push_back(fmt::format("{} ({}: {})", c.what(), caller_label_, *c.caller));
  }
  lost_ = std::move(l);
  if (on_first_loss_) on_first_loss_(peer, lost_->text);
}

void CallTable::throw_unobserved(std::size_t gi, const std::string& what) {
  auto it = unobserved_.find(gi);
  if (it == unobserved_.end()) return;
  const Unobserved u = std::move(it->second);
  unobserved_.erase(it);
  throw CallError(
      fmt::format("{}{} failed: {}; group {} restarted {} (its instances were made again{})",
                  TWK_WORKER_LOST_TAG, what, u.text, groups_[gi].name,
                  u.failed_calls ? "before this call, and the caller had not seen it yet"
                                 : "while no call was waiting on it",
                  restarts_.recovered ? restarts_.recovered(gi) : std::string()));
}

void CallTable::send_to(std::size_t peer, Message m) {
  if (auto it = restarting_.find(workers_[peer].group); it != restarting_.end()) {
    it->second.deferred.emplace_back(peer, std::move(m));
    return;
  }
  if (!restarts_.decide) return channel_.send(peer, m);
  try {
    channel_.send(peer, m);
  } catch (const TransportError&) {
    // The worker just died and its loss is on its way (the launcher saw it exit): what it was
    // sent is failed, or sent again, when the loss is handled.
  }
}

// send_to(peer, m) for each of `peers`, all of group `gi`, in one message where the channel can.
void CallTable::send_to_each(std::size_t gi, const std::vector<std::size_t>& peers,
                             const Message& m) {
  if (auto it = restarting_.find(gi); it != restarting_.end()) {
    for (const std::size_t peer : peers) it->second.deferred.emplace_back(peer, m);
    return;
  }
  if (!restarts_.decide) return channel_.send_each(peers, m);
  try {
    channel_.send_each(peers, m);
  } catch (const TransportError&) {
    // As in send_to: the losses are on their way; every peer was tried.
  }
}

// A worker of `group` was lost and the group restarts: whatever waits on the group fails with
// WorkerLost now (the SDK's twinkle::WorkerLost, by the tag), and what is sent to it from now on
// waits until it is back. With restart = "worker" only the lost `peers` are replaced: the survivors
// are told to regroup, in turn with what they were sent, and go on answering it.
void CallTable::begin_restart(std::size_t gi, const std::vector<std::size_t>& peers,
                              const std::string& text, std::chrono::milliseconds after) {
  Restarting& r = restarting_[gi];  // a loss before the group was back: again
  const GroupInfo& g = groups_[gi];
  r.phase = Restarting::Phase::waiting;
  r.respawn_at = Clock::now() + after;
  r.recovering.clear();
  r.donors.clear();
  if (restarts_.whole_group && !restarts_.whole_group(gi)) {
    r.replaced.insert(peers.begin(), peers.end());
  } else {
    r.replaced.insert(g.peers.begin(), g.peers.end());
  }
  auto replaced_index = [&](int index) {
    return r.replaced.count(g.peers[static_cast<std::size_t>(index)]) > 0;
  };
  // Whether a call the caller will wait on fails here (else its next call to the group reports
  // the restart: unobserved_).
  bool reported = false;
  for (auto it = calls_.begin(); it != calls_.end();) {
    Call& c = it->second;
    if (c.group != gi || c.answered == c.workers.size()) {
      ++it;
      continue;
    }
    if (c.retries_left > 0 && !c.released) {
      // Sent again once the group is back, in submission order (calls_ is by id); still
      // waiting to be sent after an earlier loss, it uses no retry.
      const bool pending = std::any_of(r.deferred.begin(), r.deferred.end(),
                                       [&](const auto& d) { return d.second.id == it->first; });
      CallTrouble& t = c.troubled();
      t.stale.resize(c.workers.size(), 0);
      for (std::size_t pos = 0; pos < c.workers.size(); ++pos) {
        if (replaced_index(c.workers[pos])) {
          t.stale[pos] = 0;  // its process is gone: nothing more comes from it
        } else if (!pending && !c.settled(pos)) {
          ++t.stale[pos];  // a survivor still answers this try
        }
      }
      if (!pending) {
        --c.retries_left;
        c.results.assign(c.workers.size(), std::nullopt);
        t.errors.clear();
        c.answered = 0;
        c.deadline = deadline_after(c.timeout_s);
        for (const auto& m : t.sent) r.deferred.push_back(m);
      }
      ++it;
      continue;
    }
    reported |= !c.released;
    // Not sent yet (made during an earlier restart): it fails, so it must never run.
    std::erase_if(r.deferred, [&](const auto& d) { return d.second.id == it->first; });
    std::vector<std::string> done, open;
    for (std::size_t pos = 0; pos < c.workers.size(); ++pos) {
      (c.settled(pos) ? done : open).push_back(std::to_string(c.workers[pos]));
    }
    CallTrouble& t = c.troubled();
    t.worker_lost = fmt::format(
        "{}; group {} restarts. The call had finished on ranks [{}]; it may have run on ranks "
        "[{}]",
        text, g.name, fmt::join(done, ", "), fmt::join(open, ", "));
    for (std::size_t pos = 0; pos < c.workers.size(); ++pos) {
      if (c.settled(pos)) continue;
      t.errors[pos] = *t.worker_lost;
      ++c.answered;
    }
    if (c.released) {
      it = calls_.erase(it);
    } else {
      ++it;
    }
  }
  // An instance being made is made on the replacements instead, once they are there: its
  // constructor ran on none of them. (Survivors answer the create they were sent.)
  for (auto& [id, inst] : instances_) {
    if (inst.group != gi || !inst.creating) continue;
    std::erase_if(r.deferred,
                  [&](const auto& d) { return d.second.id == id && r.replaced.count(d.first); });
    const Message create{id, transport::proto::Create{inst.cls->name, inst.args, {}, std::nullopt}};
    for (int w : inst.workers) {
      if (!replaced_index(w)) continue;
      inst.acks.erase(w);
      r.deferred.emplace_back(g.peers[static_cast<std::size_t>(w)], create);
    }
  }
  if (saving_) {
    reported = true;
    std::erase_if(r.deferred, [&](const auto& d) { return d.second.id == saving_; });
  }
  // Until the caller has seen this restart (a WorkerLost from one of the calls failed here, or
  // from its next call or checkpoint), its calls to the group fail: it made them for the state
  // before the loss.
  unobserved_[gi] = Unobserved{text, reported};
  if (saving_) {
    for (std::size_t p : g.peers) {
      if (!saved_.count(p))
        saved_.emplace(p,
                       transport::proto::Saved{std::string(TWK_WORKER_LOST_TAG) + text, "", 0, 0});
    }
  }
  for (std::size_t p : r.replaced) {
    workers_[p].ready = false;
    workers_[p].completed = false;
  }
  // The survivors: what they were sent before this is of the group as it was (its collectives
  // fail on the lost rank); after it they make the group's communicators again.
  // With recover = "peer", the replicas the replacements will pull from take their state now.
  const int generation = restarts_.generation ? restarts_.generation(gi) : 0;
  std::set<std::size_t> donors;
  if (restarts_.from_peer && restarts_.from_peer(gi)) {
    for (std::size_t p : r.replaced) {
      if (auto donor = donor_for(p, r)) donors.insert(*donor);
    }
  }
  for (std::size_t p : g.peers) {
    if (r.replaced.count(p)) continue;
    try {
      channel_.send(p, Message{0, transport::proto::Regroup{generation, donors.count(p) > 0}});
    } catch (const TransportError&) {
      // That survivor is gone too; its loss is on its way.
    }
  }
}

// Starts the replacements of groups whose backoff has passed.
void CallTable::advance_restarts() {
  if (lost_ || expecting_exits_) return;  // the run is ending: nothing new starts
  const auto now = Clock::now();
  for (auto& [gi, r] : restarting_) {
    if (r.phase != Restarting::Phase::waiting || now < r.respawn_at) continue;
    r.phase = Restarting::Phase::starting;
    for (std::size_t p : r.replaced) workers_[p].ready = false;
    try {
      restarts_.respawn(gi, std::vector<std::size_t>(r.replaced.begin(), r.replaced.end()));
    } catch (const Error& e) {
      lose(*r.replaced.begin(),
           fmt::format("group {} could not be restarted: {}", groups_[gi].name, e.what()));
      return;
    }
  }
}

std::optional<std::size_t> CallTable::donor_for(std::size_t peer, const Restarting& r) const {
  const WorkerInfo& w = workers_[peer];
  const GroupInfo& g = groups_[w.group];
  if (!g.mesh.has("dp")) return std::nullopt;
  for (int rank : g.mesh.group_of(w.index, "dp")) {
    const std::size_t p = g.peers[static_cast<std::size_t>(rank)];
    if (p != peer && !r.replaced.count(p)) return p;
  }
  return std::nullopt;
}

// Every replacement of `group` said hello: welcome them, make the group's instances on them
// again with the ids (and so the handles) they had and, with recover = "peer", have each copy
// its state from a surviving replica. The group is back when they all did.
void CallTable::welcome_replacements(std::size_t gi) {
  Restarting& r = restarting_.at(gi);
  const GroupInfo& g = groups_[gi];
  r.phase = Restarting::Phase::recovering;
  for (std::size_t p : r.replaced) channel_.send(p, Message{0, welcome_(workers_[p])});
  for (auto& [id, inst] : instances_) {
    if (inst.group != gi || !inst.made) continue;
    const Message create{
        id, transport::proto::Create{
                inst.cls->name,
                inst.args,
                {},
                inst.maker.empty() ? std::nullopt : std::optional<std::string>(inst.maker)}};
    for (int w : inst.workers) {
      const std::size_t p = g.peers[static_cast<std::size_t>(w)];
      if (!r.replaced.count(p)) continue;
      inst.acks.erase(w);
      channel_.send(p, create);
    }
  }
  if (restarts_.from_peer && restarts_.from_peer(gi)) {
    const int generation = restarts_.generation ? restarts_.generation(gi) : 0;
    for (std::size_t p : r.replaced) {
      const auto donor = donor_for(p, r);
      if (!donor) continue;  // every replica of it is new: it starts fresh
      const std::uint64_t id = ++next_id_;
      r.recovering[p] = id;
      r.donors[p] = fmt::format("{} from {}", workers_[p].name, workers_[*donor].name);
      channel_.send(p, Message{id, transport::proto::Recover{*donor, generation}});
    }
  }
  if (r.recovering.empty()) finish_restart(gi);
}

// The group is back: the run's other workers learn where the replaced ones serve now (their
// calls between groups), then what waited is sent.
void CallTable::finish_restart(std::size_t gi) {
  Restarting r = std::move(restarting_.at(gi));
  restarting_.erase(gi);
  transport::proto::PeersReplaced moved;
  std::vector<std::string> names;
  for (std::size_t p : r.replaced) {
    const WorkerInfo& w = workers_[p];
    moved.workers.push_back(
        transport::proto::WorkerEntry{w.name, w.group, w.index, w.pid, w.host, w.serve});
    names.push_back(w.name);
  }
  moved.text = fmt::format(
      "worker {} was lost and replaced (its group {} restarted); the call "
      "may have run on it",
      fmt::join(names, ", "), groups_[gi].name);
  for (std::size_t p = 0; p < workers_.size(); ++p) {
    if (r.replaced.count(p)) continue;
    try {
      channel_.send(p, Message{0, moved});
    } catch (const TransportError&) {
      // That worker is gone; its loss is on its way.
    }
  }
  if (restarts_.reform) restarts_.reform(gi);
  for (auto& [peer, m] : r.deferred) send_to(peer, std::move(m));
  std::vector<std::string> donors;
  for (const auto& [p, text] : r.donors) donors.push_back(text);
  if (restarts_.back) restarts_.back(gi, fmt::format("{}", fmt::join(donors, ", ")));
}

std::vector<std::size_t> CallTable::waiting_peers() const {
  std::vector<std::size_t> out;
  auto it = calls_.find(in_wait_);
  if (it == calls_.end()) return out;
  const Call& c = it->second;
  for (std::size_t pos = 0; pos < c.workers.size(); ++pos) {
    if (c.settled(pos)) continue;
    out.push_back(groups_[c.group].peers[static_cast<std::size_t>(c.workers[pos])]);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void CallTable::fail_waiting(std::size_t peer, const std::string& error) {
  if (peer >= workers_.size()) return;
  const WorkerInfo& w = workers_[peer];
  for (auto& [id, c] : calls_) {
    if (c.released || c.group != w.group) continue;
    const auto pos = static_cast<std::size_t>(
        std::find(c.workers.begin(), c.workers.end(), w.index) - c.workers.begin());
    if (pos >= c.workers.size() || c.settled(pos)) continue;
    c.troubled().errors[pos] = error;
    ++c.answered;
  }
}

void CallTable::replace_worker(std::size_t peer, int pid, const std::string& host,
                               const std::string& serve, const std::string& text) {
  if (peer >= workers_.size()) return;
  fail_waiting(peer, text);
  WorkerInfo& w = workers_[peer];
  w.pid = pid;
  w.host = host;
  w.serve = serve;
}

void CallTable::on_event(ChannelEvent& e) {
  if (e.kind == ChannelEvent::Kind::lost) return on_lost(e.peer, e.reason, e.with);
  if (e.kind != ChannelEvent::Kind::message || e.peer >= workers_.size()) return;
  WorkerInfo& w = workers_[e.peer];
  Message& m = e.message;
  // Until a restarting group is back, what comes from the workers being replaced counts only
  // once they are welcomed, and before that only their replacements' hellos: anything else
  // comes from the processes being replaced (a retried call gets the answers of its new run).
  auto rs = restarting_.find(w.group);
  if (rs != restarting_.end() && rs->second.replaced.count(e.peer) &&
      rs->second.phase != Restarting::Phase::recovering) {
    if (!m.get<transport::proto::Hello>() || rs->second.phase != Restarting::Phase::starting)
      return;
  }
  if (auto* hello = m.get<transport::proto::Hello>()) {
    // The channel knows the peer by its identity; a hello that names another worker is not its.
    if (w.ready || hello->name != w.name) return;
    w.pid = hello->pid;
    w.host = std::move(hello->host);
    w.serve = std::move(hello->serve);
    w.ready = true;
    if (rs != restarting_.end() && rs->second.phase == Restarting::Phase::starting) {
      const auto& replaced = rs->second.replaced;
      if (std::all_of(replaced.begin(), replaced.end(),
                      [&](std::size_t p) { return workers_[p].ready; }))
        welcome_replacements(w.group);
    }
  } else if (auto* recovered = m.get<transport::proto::Recovered>()) {
    if (rs == restarting_.end()) return;
    auto at = rs->second.recovering.find(e.peer);
    if (at == rs->second.recovering.end() || at->second != m.id) return;
    if (recovered->error) {
      return on_lost(e.peer, fmt::format("could not recover its state after the restart: {}",
                                         *recovered->error));
    }
    rs->second.recovering.erase(at);
    rs->second.donors[e.peer] +=
        fmt::format(" ({:.1f} MiB in {:.3f} s)", static_cast<double>(recovered->bytes) / 1048576,
                    recovered->seconds);
    if (rs->second.recovering.empty()) finish_restart(w.group);
  } else if (auto* created = m.get<transport::proto::Created>()) {
    auto inst = instances_.find(m.id);
    if (inst == instances_.end()) return;
    // A replacement that cannot make an instance again is lost too (before it was ready).
    if (inst->second.made && created->error) {
      return on_lost(e.peer, fmt::format("could not make its {} again after the restart: {}",
                                         inst->second.cls->name, *created->error));
    }
    inst->second.acks[w.index] = std::move(created->error);
  } else if (auto* made = m.get<transport::proto::Made>()) {
    adopt(w, m.id, *made);
  } else if (auto* saved = m.get<transport::proto::Saved>()) {
    if (m.id == saving_ && saving_ != 0) saved_.emplace(e.peer, std::move(*saved));
  } else if (auto* reply = m.get<transport::proto::Reply>()) {
    auto it = calls_.find(m.id);
    if (it == calls_.end()) return;
    Call& c = it->second;
    const auto pos = static_cast<std::size_t>(
        std::find(c.workers.begin(), c.workers.end(), w.index) - c.workers.begin());
    if (c.group != w.group || pos >= c.workers.size()) return;
    if (c.trouble && pos < c.trouble->stale.size() && c.trouble->stale[pos] > 0) {
      --c.trouble->stale[pos];  // a survivor's answer to a try before the retry
      return;
    }
    if (c.settled(pos)) return;
    w.completed = true;
    if (reply->error) {
      c.troubled().errors[pos] = std::move(*reply->error);
    } else {
      c.results[pos] = Answer{std::move(reply->value.msgpack), std::move(reply->value.tensors)};
    }
    ++c.answered;
    if (c.released && c.answered == c.workers.size()) calls_.erase(it);
  }
}

bool CallTable::pump(std::chrono::milliseconds timeout) {
  advance_restarts();
  for (const auto& [gi, r] : restarting_) {
    if (r.phase != Restarting::Phase::waiting) continue;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(r.respawn_at - Clock::now()) +
        std::chrono::milliseconds(1);
    if (timeout.count() < 0 || left < timeout)
      timeout = std::max(left, std::chrono::milliseconds(0));
  }
  auto e = channel_.next(timeout);
  if (!e) return false;
  on_event(*e);
  return true;
}

void CallTable::drain() {
  while (pump(std::chrono::milliseconds(0))) {
  }
}

void CallTable::cancel(std::string reason) {
  std::lock_guard lock(cancel_mu_);
  if (!cancelled_) cancelled_ = std::move(reason);
  any_cancel_.store(true, std::memory_order_release);
}

std::optional<std::string> CallTable::cancelled() const {
  if (!any_cancel_.load(std::memory_order_acquire)) return std::nullopt;
  std::lock_guard lock(cancel_mu_);
  return cancelled_;
}

void CallTable::check_failed(const std::string& what) const {
  if (auto c = cancelled()) throw CallError(fmt::format("{}: {}", what, *c));
  if (lost_) throw CallError(fmt::format("{} failed: {}", what, lost_->text));
}

void CallTable::start(std::chrono::milliseconds timeout,
                      const std::function<transport::proto::Welcome(const WorkerInfo&)>& welcome) {
  const auto deadline = Clock::now() + timeout;
  auto ready = [&] {
    return std::all_of(workers_.begin(), workers_.end(), [](const auto& w) { return w.ready; });
  };
  while (!ready()) {
    if (auto c = cancelled()) throw CallError(*c);
    if (lost_) throw CallError(fmt::format("{} before it was ready", lost_->text));
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      std::vector<std::string> missing;
      for (const auto& w : workers_) {
        if (!w.ready) missing.push_back(w.name);
      }
      throw CallError(fmt::format("workers {} did not start within {:g} s",
                                  fmt::join(missing, ", "),
                                  std::chrono::duration<double>(timeout).count()));
    }
    pump(left);
  }
  welcome_ = welcome;
  for (std::size_t i = 0; i < workers_.size(); ++i)
    channel_.send(i, Message{0, welcome(workers_[i])});
}

std::uint64_t CallTable::create(const plugins::ClassInfo& cls, std::size_t gi,
                                const EncodedValue& args, std::optional<PeerCaller> peer,
                                const std::vector<transport::proto::ChainLink>& chain) {
  const GroupInfo& g = groups_.at(gi);
  const std::string what = fmt::format("{} constructor on group {}", cls.name, g.name);
  check_failed(what);
  const std::uint64_t id = ++next_id_;
  Instance& inst = instances_[id];
  inst.cls = &cls;
  inst.group = gi;
  try {
    inst.workers = executing_workers(cls.execute == Execute::peer ? Execute::peer : Execute::all,
                                     g.mesh, peer);
  } catch (const std::invalid_argument& e) {
    instances_.erase(id);
    throw CallError(fmt::format("{}: {}", what, e.what()));
  }
  inst.whole = inst.workers.size() == g.peers.size();
  inst.args = args;
  inst.creating = true;
  // An instance that was not made is not made again by a restart either.
  struct Forget {
    std::map<std::uint64_t, Instance>& instances;
    std::uint64_t id;
    bool keep = false;
    ~Forget() {
      if (!keep) instances.erase(id);
    }
  } forget{instances_, id};
  const Message create{id, transport::proto::Create{cls.name, args, chain, std::nullopt}};
  for (int w : inst.workers) send_to(g.peers[static_cast<std::size_t>(w)], create);
  const auto deadline = deadline_after(timeout_s_);
  while (inst.acks.size() < inst.workers.size()) {
    check_failed(what);
    if (Clock::now() > deadline) {
      std::vector<std::string> missing;
      for (int i : inst.workers) {
        if (!inst.acks.count(i)) missing.push_back(std::to_string(i));
      }
      throw CallError(
          fmt::format("{} timed out after {:g} s: ranks [{}] did not answer; raise "
                      "job.timeout_s",
                      what, timeout_s_, fmt::join(missing, ", ")));
    }
    pump(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()) +
         std::chrono::milliseconds(1));
  }
  for (const auto& [index, e] : inst.acks) {
    if (e) {
      throw CallError(
          fmt::format("{} constructor failed on {}: {}", cls.name, worker_label(gi, index), *e));
    }
  }
  inst.made = true;
  inst.creating = false;
  forget.keep = true;
  return id;
}

std::vector<transport::proto::Saved> CallTable::save(
    const transport::proto::Save& save, const std::function<std::string(std::size_t)>& file) {
  const std::string what = fmt::format("checkpoint of step {}", save.step);
  check_failed(what);
  if (restarts_.decide) {
    drain();
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) throw_unobserved(gi, what);
  }
  saving_ = ++next_id_;
  saved_.clear();
  for (std::size_t p = 0; p < workers_.size(); ++p) {
    transport::proto::Save s = save;
    s.file = file(p);
    send_to(p, Message{saving_, std::move(s)});
  }
  const auto deadline = deadline_after(timeout_s_);
  while (saved_.size() < workers_.size()) {
    check_failed(what);
    if (Clock::now() > deadline) {
      std::vector<std::string> missing;
      for (std::size_t p = 0; p < workers_.size(); ++p) {
        if (!saved_.count(p)) missing.push_back(workers_[p].name);
      }
      saving_ = 0;
      throw CallError(fmt::format(
          "{} timed out after {:g} s: workers {} did not answer (each saves after the calls sent "
          "to it before); raise job.timeout_s",
          what, timeout_s_, fmt::join(missing, ", ")));
    }
    pump(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()) +
         std::chrono::milliseconds(1));
  }
  saving_ = 0;
  std::vector<transport::proto::Saved> out;
  for (std::size_t p = 0; p < workers_.size(); ++p) {
    auto& s = saved_.at(p);
    if (s.error && s.error->starts_with(TWK_WORKER_LOST_TAG)) {
      unobserved_.erase(workers_[p].group);  // the caller sees the restart now
      throw CallError(fmt::format("{}{} failed: {}", TWK_WORKER_LOST_TAG, what,
                                  s.error->substr(std::string_view(TWK_WORKER_LOST_TAG).size())));
    }
    if (s.error) {
      const WorkerInfo& w = workers_[p];
      throw CallError(
          fmt::format("{} failed on {}: {}", what, worker_label(w.group, w.index), *s.error));
    }
    out.push_back(std::move(s));
  }
  saved_.clear();
  return out;
}

// Worker `maker` made instance `id` on another group (a call between groups): recorded as made,
// so that a restart of that group makes it again on its replacements, for the maker (the same
// id, the same state key).
void CallTable::adopt(const WorkerInfo& maker, std::uint64_t id, transport::proto::Made& m) {
  if (!restarts_.find_class || m.group >= groups_.size()) return;
  const plugins::ClassInfo* cls = restarts_.find_class(m.cls);
  const std::size_t size = groups_[m.group].peers.size();
  const bool valid =
      cls && !m.workers.empty() && std::all_of(m.workers.begin(), m.workers.end(), [&](int w) {
        return w >= 0 && static_cast<std::size_t>(w) < size;
      });
  if (!valid) return;
  Instance& inst = instances_[id];
  if (inst.made || (inst.cls && (inst.cls != cls || inst.group != m.group)))
    return;  // not another's, nor made twice
  inst.cls = cls;
  inst.group = m.group;
  inst.workers = std::move(m.workers);
  inst.whole = inst.workers.size() == size;
  inst.args = std::move(m.args);
  inst.made = true;
  inst.maker = maker.name;
  for (int w : inst.workers) inst.acks[w] = std::nullopt;
}

std::vector<int> CallTable::workers_of(std::uint64_t instance) const {
  auto it = instances_.find(instance);
  return it == instances_.end() ? std::vector<int>() : it->second.workers;
}

void CallTable::attach(std::uint64_t instance, const plugins::ClassInfo& cls, std::size_t gi) {
  if (auto it = instances_.find(instance); it != instances_.end()) {
    if (it->second.cls != &cls || it->second.group != gi)
      throw CallError(fmt::format("handle {} is an instance of {} on group {}, not of {} on {}",
                                  instance, it->second.cls->name, groups_[it->second.group].name,
                                  cls.name, groups_.at(gi).name));
    return;
  }
  Instance& inst = instances_[instance];
  inst.cls = &cls;
  inst.group = gi;
  for (std::size_t i = 0; i < groups_.at(gi).peers.size(); ++i)
    inst.workers.push_back(static_cast<int>(i));
}

std::uint64_t CallTable::call(std::uint64_t instance, std::string_view method_name,
                              const EncodedValue& args, const std::string& caller,
                              std::optional<PeerCaller> peer,
                              const std::vector<transport::proto::ChainLink>& chain) {
  auto inst = instances_.find(instance);
  if (inst == instances_.end()) throw CallError("unknown instance handle");
  const plugins::ClassInfo& cls = *inst->second.cls;
  const plugins::MethodInfo* m = cls.find_method(method_name);
  if (!m) {
    std::vector<std::string> names;
    for (const auto& mm : cls.methods) names.push_back(mm.name);
    throw CallError(fmt::format(
        "no remote method {} (class {} has: {}); declare it with TWINKLE_METHOD", method_name,
        cls.name, names.empty() ? std::string("none") : fmt::format("{}", fmt::join(names, ", "))));
  }
  // Made only where it is needed (every error, and a dispatch that splits the arguments).
  auto what = [&] { return fmt::format("{}.{}", cls.name, m->name); };
  if (cancelled() || lost_) check_failed(what());
  const std::size_t gi = inst->second.group;
  const GroupInfo& g = groups_[gi];
  if (restarts_.decide) {
    drain();  // a loss that came meanwhile is seen by this call
    if (m->retries == 0) throw_unobserved(gi, what());
  }

  Call c;
  c.cls = &cls;
  c.method = m;
  auto known = callers_.find(caller);
  c.caller = &*(known != callers_.end() ? known : callers_.insert(caller).first);
  c.group = gi;
  try {
    c.workers = executing_workers(m->execute, g.mesh, peer);
  } catch (const std::invalid_argument& e) {
    throw CallError(fmt::format("{}: {}", what(), e.what()));
  }
  if (!inst->second.whole && (m->execute != Execute::peer || !peer)) {
    // An instance on a peer block: `all` (and peer from the driver) means its workers.
    c.workers = m->execute == Execute::first ? std::vector<int>{inst->second.workers.front()}
                                             : inst->second.workers;
  }
  // Arguments that every executing worker gets whole are sent as the plugin encoded them, in one
  // message for all of them.
  const bool whole = m->execute == Execute::first || m->dispatch == Dispatch::all;
  std::vector<EncodedValue> per_worker;
  if (!whole && m->dispatch == Dispatch::custom) {
    twk_dispatch_fn fn = custom_.dispatcher ? custom_.dispatcher(m->custom_dispatch) : nullptr;
    if (!fn) throw CallError(fmt::format("{}: no custom dispatch {}", what(), m->custom_dispatch));
    EncodedValue ea = args;
    for (std::size_t i = 0; i < c.workers.size(); ++i) {
      SinkCapture got;
      got.adopt = [this](const twk_value_v1& v) { return decode(channel_.adopt(v)); };
      twk_sink_v1 sink = got.sink();
      if (fn(static_cast<std::int32_t>(c.workers.size()), static_cast<std::int32_t>(i),
             mesh_abi_[gi]->view(), ea.view(), &sink) != TWK_OK ||
          !got.value) {
        throw CallError(fmt::format("{}: custom dispatch {} failed for worker {}: {}", what(),
                                    m->custom_dispatch, i, got.error.value_or("no value")));
      }
      per_worker.push_back(encode(*got.value));
    }
  } else if (!whole) {
    Value value;
    try {
      value = decode(args.msgpack.data(), args.msgpack.size(), args.tensors);
    } catch (const ValueError& e) {
      throw CallError(fmt::format("{}: its arguments: {}", what(), e.what()));
    }
    for (auto& v : dispatch_args(m->dispatch, value, g.mesh, c.workers, what()))
      per_worker.push_back(encode(v));
  }
  c.results.resize(c.workers.size());
  c.timeout_s = m->timeout_s > 0 ? m->timeout_s : timeout_s_;
  c.deadline = deadline_after(c.timeout_s);
  const std::uint64_t id = ++next_id_;
  c.retries_left = restarts_.decide ? m->retries : 0;
  auto peer_of = [&](std::size_t i) { return g.peers[static_cast<std::size_t>(c.workers[i])]; };
  if (whole) {
    const Message msg{id, transport::proto::Call{instance, m->name, caller, args, chain}};
    std::vector<std::size_t> peers(c.workers.size());
    for (std::size_t i = 0; i < peers.size(); ++i) {
      peers[i] = peer_of(i);
      if (c.retries_left > 0) c.troubled().sent.emplace_back(peers[i], msg);
    }
    send_to_each(gi, peers, msg);
  } else {
    for (std::size_t i = 0; i < c.workers.size(); ++i) {
      Message msg{
          id, transport::proto::Call{instance, m->name, caller, std::move(per_worker[i]), chain}};
      if (c.retries_left > 0) c.troubled().sent.emplace_back(peer_of(i), msg);
      send_to(peer_of(i), std::move(msg));
    }
  }
  calls_.emplace(id, std::move(c));
  if (id % 1024 == 0) heap_pages::advise_growth();
  return id;
}

EncodedValue CallTable::wait(std::uint64_t future) {
  auto it = calls_.find(future);
  if (it == calls_.end()) throw CallError("unknown or already collected call");
  // The SDK puts "[twinkle driver caller: FILE:LINE]" in front (detail::caller_prefix).
  const std::string prefix = it->second.what();
  struct InWait {
    std::uint64_t& slot;
    ~InWait() { slot = 0; }
  } in_wait{in_wait_ = future};
  while (it->second.answered < it->second.workers.size()) {
    Call& c = it->second;
    const auto cancelled = this->cancelled();
    if (cancelled || lost_) {
      const std::string msg = cancelled ? fmt::format("{}: {}", prefix, *cancelled)
                                        : fmt::format("{} failed: {}", prefix, lost_->text);
      calls_.erase(it);
      throw CallError(msg);
    }
    const auto now = Clock::now();
    if (now > c.deadline) {
      std::vector<std::string> missing;
      std::vector<std::size_t> silent;  // their peers
      for (std::size_t i = 0; i < c.workers.size(); ++i) {
        if (c.settled(i)) continue;
        missing.push_back(std::to_string(c.workers[i]));
        silent.push_back(groups_[c.group].peers[static_cast<std::size_t>(c.workers[i])]);
      }
      // In a group that restarts, the ranks that do not answer in time are lost: they are
      // replaced (with the others: restart = "group"), and the call fails with WorkerLost (or
      // runs again: twinkle::retry). One restart for all of them.
      if (!silent.empty() && restarts_.restartable && restarts_.restartable(c.group) &&
          !restarting_.count(c.group)) {
        on_lost(silent.front(),
                fmt::format("did not answer {} within {:g} s (a call timeout, counted as its loss)",
                            prefix, c.timeout_s),
                silent);
        it = calls_.find(future);
        if (it == calls_.end()) throw CallError(prefix + ": the call was dropped");
        if (restarting_.count(it->second.group)) continue;
      }
      c.released = true;  // late answers are dropped
      throw CallError(fmt::format(
          "{} timed out after {:g} s: ranks [{}] of group {} did not answer; raise the method's "
          "timeout (twinkle::timeout in TWINKLE_METHOD) or job.timeout_s",
          prefix, c.timeout_s, fmt::join(missing, ", "), groups_[c.group].name));
    }
    pump(std::chrono::duration_cast<std::chrono::milliseconds>(c.deadline - now) +
         std::chrono::milliseconds(1));
    it = calls_.find(future);
    if (it == calls_.end()) throw CallError(prefix + ": the call was dropped");
  }
  Call c = std::move(it->second);
  calls_.erase(it);
  if (c.trouble && c.trouble->worker_lost) {
    unobserved_.erase(c.group);  // the caller sees the restart now
    throw CallError(
        fmt::format("{}{} failed: {}", TWK_WORKER_LOST_TAG, prefix, *c.trouble->worker_lost));
  }
  if (c.trouble && !c.trouble->errors.empty()) {
    const auto& errors = c.trouble->errors;
    const auto& [pos, e] = *errors.begin();
    std::string msg =
        fmt::format("{} failed on {}: {}", prefix, worker_label(c.group, c.workers[pos]), e);
    if (errors.size() > 1) {
      std::vector<std::string> others;
      for (const auto& [p, _] : errors) {
        if (p != pos) others.push_back(std::to_string(c.workers[p]));
      }
      msg += fmt::format(" (ranks {} failed too)", fmt::join(others, ", "));
    }
    throw CallError(msg);
  }
  return collect(c, prefix);
}

EncodedValue CallTable::collect(Call& c, const std::string& prefix) {
  // One result that is returned whole goes back as the worker sent it.
  if (!c.results.empty() && (c.method->collect == Collect::first ||
                             (c.method->collect == Collect::none && c.results.size() == 1)))
    return c.results[0]->take();
  std::vector<Value> results;
  results.reserve(c.results.size());
  for (std::size_t i = 0; i < c.results.size(); ++i) {
    const Answer& r = *c.results[i];
    try {
      results.push_back(decode(r.msgpack.data(), r.msgpack.size(), r.tensors));
    } catch (const ValueError& e) {
      throw CallError(fmt::format("{}: the result of {} does not decode: {}", prefix,
                                  worker_label(c.group, c.workers[i]), e.what()));
    }
  }
  if (c.method->collect != Collect::custom) {
    try {
      return encode(collect_results(c.method->collect, std::move(results), groups_[c.group].mesh,
                                    c.workers, prefix));
    } catch (const std::exception& e) {
      throw CallError(fmt::format("{}: {}", prefix, e.what()));
    }
  }
  twk_collect_fn fn = custom_.collector ? custom_.collector(c.method->custom_collect) : nullptr;
  if (!fn)
    throw CallError(fmt::format("{}: no custom collect {}", prefix, c.method->custom_collect));
  std::vector<twk_value_v1> views;
  std::vector<EncodedValue> encoded;
  encoded.reserve(c.results.size());
  for (auto& r : c.results) views.push_back(*encoded.emplace_back(r->take()).view());
  SinkCapture got;
  twk_sink_v1 sink = got.sink();
  if (fn(views.data(), static_cast<std::uint32_t>(views.size()), mesh_abi_[c.group]->view(),
         &sink) != TWK_OK ||
      !got.value) {
    throw CallError(fmt::format("{}: custom collect {} failed: {}", prefix,
                                c.method->custom_collect, got.error.value_or("no value")));
  }
  return encode(*got.value);
}

void CallTable::release(std::uint64_t future) {
  auto it = calls_.find(future);
  if (it == calls_.end()) return;
  if (it->second.answered == it->second.workers.size()) {
    calls_.erase(it);
  } else {
    it->second.released = true;
  }
}

std::string CallTable::Call::what() const { return fmt::format("{}.{}", cls->name, method->name); }

}  // namespace twinkle::core
