#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/job/dispatch.hpp"
#include "core/job/mesh.hpp"
#include "core/runtime/host_abi.hpp"
#include "plugins/loader.hpp"
#include "transports/zmq/channel.hpp"
#include "twinkle/errors.hpp"
#include "twinkle/value.hpp"

namespace twinkle::core {

// A call, a constructor or the start-up failed; the message says where and why.
class CallError : public Error {
 public:
  using Error::Error;
};

// A worker as the call table knows it: fixed by the placement, completed by its hello.
struct WorkerInfo {
  std::string name;  // "model:3"
  std::size_t group = 0;
  int index = 0;  // in its group
  int pid = 0;    // from its hello
  std::string host;
  std::string serve;  // where it serves calls from other workers (its hello)
  bool ready = false;
  bool completed = false;  // answered a call since it started (restarts: crash loops)
};

// A group as the call table knows it.
struct GroupInfo {
  std::string name;
  DeviceMesh mesh = DeviceMesh::data_parallel(1);
  std::vector<std::size_t> peers;  // the channel peer of each worker index
};

// The plugin's custom dispatch and collect functions by name (nullptr when there is none).
struct CustomFunctions {
  std::function<twk_dispatch_fn(std::string_view)> dispatcher;
  std::function<twk_collect_fn(std::string_view)> collector;
};

// How a group whose worker was lost comes back (docs/ARCHITECTURE.md, Restarts). The driver's
// table has these; without them every loss is final.
struct Restarts {
  struct Decision {
    std::optional<std::chrono::milliseconds> after;  // restart the group after this; none: final
    std::string text;                                // final: the loss as the run reports it
  };
  // The loss of `peer` (`text`: "worker model:2 (host h, pid 9) was killed by signal 9"):
  // whether its group restarts.
  std::function<Decision(std::size_t peer, const std::string& text)> decide;
  // Replaces these workers of the group (the launcher). Throws Error when it cannot.
  std::function<void(std::size_t group, const std::vector<std::size_t>& peers)> respawn;
  // The group is back: every replacement welcomed, its instances made again and, with
  // recover = "peer", their state copied; `donors`: "model:2 from model:0", or empty.
  std::function<void(std::size_t group, const std::string& donors)> back;
  // ", with the state of the checkpoint of step 11" or ", without state": for messages.
  std::function<std::string(std::size_t group)> recovered;
  // Whether the group restarts at all (then a call timeout counts as the loss of a rank that
  // did not answer).
  std::function<bool(std::size_t group)> restartable;
  // restart = "group": every worker is replaced; else only the lost ones (restart = "worker").
  std::function<bool(std::size_t group)> whole_group;
  // recover = "peer": a replacement copies its state from a surviving replica.
  std::function<bool(std::size_t group)> from_peer;
  // How many times the group restarted (its communicators' generation).
  std::function<int(std::size_t group)> generation;
  // The group is back, before what waited for it is sent: the communicators across groups that
  // include it are declared to its replacements (and again to the others: no change for them).
  std::function<void(std::size_t group)> reform;
  // The plugin's class of that name (nullptr: none): instances that workers made on a group
  // (calls between groups, proto::Made) are recorded, to be made again on its replacements.
  std::function<const plugins::ClassInfo*(std::string_view name)> find_class;
};

// The first worker the run lost while it still needed it.
struct LostWorker {
  std::size_t peer = 0;
  std::string text;                // "worker model:1 (host h, pid 42) exited with code 3; ..."
  std::vector<std::string> calls;  // its outstanding calls: "Model.step (driver caller: t.cpp:9)"
};

// The instances and outstanding calls of a caller over a worker channel (docs/ARCHITECTURE.md,
// Dispatch, execute and collect; Results and errors; Calls between groups): it dispatches
// arguments, sends, collects results, and fails what a lost or late worker cannot answer. A lost
// worker is an event from the channel; from then on every wait fails with it. The driver has one
// over its control channel; every worker has one over its connections to the other workers (calls
// between groups), with ids from `id_base` so that instances made by different callers never share
// an id. Used from one thread; blocking calls pump the channel while they wait.
class CallTable {
 public:
  CallTable(transport::CallChannel& channel, std::vector<GroupInfo> groups,
            std::vector<WorkerInfo> workers, CustomFunctions custom, double timeout_s,
            std::uint64_t id_base = 0);

  // Waits for every worker's hello, up to `timeout`, then sends each its welcome(worker).
  // Throws CallError naming the workers that were lost or never said hello.
  void start(std::chrono::milliseconds timeout,
             const std::function<transport::proto::Welcome(const WorkerInfo&)>& welcome);

  // Constructs `cls` on every worker of `group` (a class with execute = peer and a `peer`
  // caller: on its peer block only) and waits for all. Returns the instance handle. `chain`: the
  // calls that led here (calls between groups).
  // The workers (indices in its group) that instance `instance` lives on; none for no instance.
  std::vector<int> workers_of(std::uint64_t instance) const;
  std::uint64_t create(const plugins::ClassInfo& cls, std::size_t group, const EncodedValue& args,
                       std::optional<PeerCaller> peer = std::nullopt,
                       const std::vector<transport::proto::ChainLink>& chain = {});
  // Makes an instance that another caller made on every worker of `group` callable here.
  void attach(std::uint64_t instance, const plugins::ClassInfo& cls, std::size_t group);
  // Dispatches and sends a call; returns its future at once. `caller` is "file.cpp:42"; `peer`
  // is the calling worker for execute = peer (none: the driver, every worker).
  std::uint64_t call(std::uint64_t instance, std::string_view method, const EncodedValue& args,
                     const std::string& caller, std::optional<PeerCaller> peer = std::nullopt,
                     const std::vector<transport::proto::ChainLink>& chain = {});
  // Waits for a call and collects its results. A single worker's result under collect first or
  // none comes as that worker sent it, without being decoded.
  EncodedValue wait(std::uint64_t future);
  // The driver no longer wants the result; late answers are dropped.
  void release(std::uint64_t future);
  // Sends `save` to every worker (each in turn with its calls) and waits for every answer, up
  // to the job's timeout: the parts in worker order. Throws CallError naming the first worker
  // that could not save or write its part.
  std::vector<transport::proto::Saved> save(const transport::proto::Save& save,
                                            const std::function<std::string(std::size_t)>& file);

  // Handles the channel's next event, waiting up to `timeout` for it; false when none came.
  bool pump(std::chrono::milliseconds timeout);
  // Handles every event that is already there.
  void drain();

  // Every wait fails with `reason` from now on (the run was interrupted). Thread-safe: the
  // caller then wakes the channel so that a waiting call notices.
  void cancel(std::string reason);
  // Lost workers are no longer failures (orderly shutdown).
  void expect_exits() { expecting_exits_ = true; }
  void set_restarts(Restarts r) { restarts_ = std::move(r); }
  // Whether `group` is being restarted now.
  bool restarting(std::size_t group) const { return restarting_.count(group) > 0; }
  // Called once with the first lost worker (peer, text): the driver tells the other workers.
  void on_first_loss(std::function<void(std::size_t, const std::string&)> f) {
    on_first_loss_ = std::move(f);
  }
  // How calls name their call site in lost_().calls: "driver caller" (the default) or
  // "worker caller".
  void set_caller_label(std::string label) { caller_label_ = std::move(label); }
  // The peers that the call in wait() (if any) still waits for, ascending.
  std::vector<std::size_t> waiting_peers() const;
  // Every call still waiting for `peer` gets `error` as that worker's answer (a cycle of calls
  // that would never end).
  void fail_waiting(std::size_t peer, const std::string& error);
  // Worker `peer` was replaced (its group restarted): calls that wait on it fail with `text`,
  // and from now on it is the process of `pid` on `host`, serving at `serve`.
  void replace_worker(std::size_t peer, int pid, const std::string& host, const std::string& serve,
                      const std::string& text);

  const std::optional<LostWorker>& lost() const { return lost_; }
  const std::vector<WorkerInfo>& workers() const { return workers_; }
  const std::vector<GroupInfo>& groups() const { return groups_; }
  std::optional<std::size_t> find_group(std::string_view name) const;
  // "group model rank 1 (host h, pid 42)"
  std::string worker_label(std::size_t group, int index) const;
  // How many calls are waiting for answers.
  std::size_t outstanding() const { return calls_.size(); }

 private:
  struct Instance {
    const plugins::ClassInfo* cls = nullptr;
    std::size_t group = 0;
    std::vector<int> workers;                        // where it lives (worker indices)
    bool whole = true;                               // on every worker of the group
    std::map<int, std::optional<std::string>> acks;  // worker index -> error (nullopt: ok)
    EncodedValue args;      // its constructor's, to make it again when its group restarts
    bool made = false;      // constructed on every worker
    bool creating = false;  // create() waits for it: a restart makes it on the replacements
    std::string maker;      // the worker that made it (proto::Made); empty: this caller
  };
  // What only a call that failed somewhere or can be retried needs: most calls have none, and
  // a call waiting for its answers is kept small (pipelined calls hold many of them).
  struct CallTrouble {
    std::map<std::size_t, std::string> errors;  // position -> message
    std::optional<std::string> worker_lost;     // its group restarted before every answer came
    // Per position: answers still due from a survivor for a try before a retry (restart =
    // "worker"), dropped when they come.
    std::vector<int> stale;
    std::vector<std::pair<std::size_t, transport::Message>> sent;  // with retries: what to resend
  };
  // A worker's result as it came: an EncodedValue without its view, a third of the size.
  struct Answer {
    std::string msgpack;
    std::vector<Tensor> tensors;
    EncodedValue take() {
      EncodedValue e;
      e.msgpack = std::move(msgpack);
      e.tensors = std::move(tensors);
      return e;
    }
  };
  struct Call {
    const plugins::ClassInfo* cls = nullptr;
    const plugins::MethodInfo* method = nullptr;
    const std::string* caller = nullptr;  // "train.cpp:42", kept once in callers_
    std::size_t group = 0;
    std::vector<int> workers;
    std::vector<std::optional<Answer>> results;
    std::size_t answered = 0;
    double timeout_s = 0;
    std::chrono::steady_clock::time_point deadline;
    bool released = false;
    int retries_left = 0;  // twinkle::retry
    std::unique_ptr<CallTrouble> trouble;

    std::string what() const;  // "Model.train_step"
    CallTrouble& troubled() {
      if (!trouble) trouble = std::make_unique<CallTrouble>();
      return *trouble;
    }
    bool failed(std::size_t pos) const { return trouble && trouble->errors.count(pos); }
    // Its answer from position `pos` came (a result or an error).
    bool settled(std::size_t pos) const { return results[pos] || failed(pos); }
  };
  // A group between the loss of a worker and the moment it is back: waiting (the backoff),
  // starting (replacements spawned, their hellos awaited), recovering (welcomed and their
  // instances made; with recover = "peer", their `recovered` answers awaited).
  struct Restarting {
    enum class Phase { waiting, starting, recovering } phase = Phase::waiting;
    std::chrono::steady_clock::time_point respawn_at;
    std::set<std::size_t> replaced;  // the peers being replaced (all of them: restart = "group")
    std::map<std::size_t, std::uint64_t> recovering;  // peer -> its recover id
    std::map<std::size_t, std::string> donors;        // by replaced peer: "model:2 from model:0"
    std::vector<std::pair<std::size_t, transport::Message>> deferred;  // sent once it is back
  };

  void on_event(transport::ChannelEvent& e);
  // `with`: others of its group lost in the same event (one restart replaces them all).
  void adopt(const WorkerInfo& maker, std::uint64_t id, transport::proto::Made& m);
  void on_lost(std::size_t peer, const std::string& reason,
               const std::vector<std::size_t>& with = {});
  void lose(std::size_t peer, std::string text);
  void begin_restart(std::size_t group, const std::vector<std::size_t>& peers,
                     const std::string& text, std::chrono::milliseconds after);
  void advance_restarts();
  void welcome_replacements(std::size_t group);
  void finish_restart(std::size_t group);
  // A surviving worker of `peer`'s group with the same mesh coordinates but dp, to copy its
  // state from (none when every such replica is being replaced too).
  std::optional<std::size_t> donor_for(std::size_t peer, const Restarting& r) const;
  // Sends now, or once `peer`'s group is back when it is restarting.
  void send_to(std::size_t peer, transport::Message m);
  // send_to each of `peers` (all of group `group`): one message the channel may encode once.
  void send_to_each(std::size_t group, const std::vector<std::size_t>& peers,
                    const transport::Message& m);
  // Throws WorkerLost for a restart of `group` that the caller has not seen yet.
  void throw_unobserved(std::size_t group, const std::string& what);
  void check_failed(const std::string& what) const;
  std::string lost_text(std::size_t peer, const std::string& reason) const;
  EncodedValue collect(Call& c, const std::string& prefix);

  transport::CallChannel& channel_;
  std::vector<GroupInfo> groups_;
  std::vector<WorkerInfo> workers_;                 // by channel peer
  std::vector<std::unique_ptr<MeshAbi>> mesh_abi_;  // by group, for custom functions
  CustomFunctions custom_;
  double timeout_s_;
  std::map<std::uint64_t, Instance> instances_;
  std::map<std::uint64_t, Call> calls_;
  std::set<std::string, std::less<>> callers_;  // the call sites of calls, each kept once
  // The checkpoint being saved: its request id and the answers so far, by peer.
  std::uint64_t saving_ = 0;
  std::map<std::size_t, transport::proto::Saved> saved_;
  std::uint64_t next_id_ = 0;
  std::uint64_t in_wait_ = 0;  // the call that wait() waits for (0: none)
  std::optional<LostWorker> lost_;
  std::function<void(std::size_t, const std::string&)> on_first_loss_;
  Restarts restarts_;
  std::map<std::size_t, Restarting> restarting_;  // by group
  // Restarts the caller has not seen yet, by group: the loss, and whether calls were failed.
  struct Unobserved {
    std::string text;
    bool failed_calls = false;
  };
  std::map<std::size_t, Unobserved> unobserved_;
  std::function<transport::proto::Welcome(const WorkerInfo&)> welcome_;
  std::string caller_label_ = "driver caller";
  std::optional<std::string> cancelled() const;

  mutable std::mutex cancel_mu_;
  std::optional<std::string> cancelled_;  // guarded by cancel_mu_
  std::atomic<bool> any_cancel_{false};   // cancelled_ is set: every call looks, without the lock
  bool expecting_exits_ = false;
};

}  // namespace twinkle::core
