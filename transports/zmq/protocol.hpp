#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "twinkle/errors.hpp"
#include "twinkle/value.hpp"

// The wire protocol: one struct per message, with its fields. These structs are its
// documentation (docs/ARCHITECTURE.md, Wire protocol, lists them as `twinkle-protocol` prints
// them). Encoding and decoding live in protocol.cpp and message.cpp; nothing else builds or
// reads a message body.
//
// A struct's fields() lists its wire fields (a msgpack map, by name). A field of type
// std::optional is left out when empty; every other field must be present with its type, or the
// message is malformed. Field types: strings, bool, integers, double, Bytes, Tensor, Value (any
// value, inline), EncodedValue (a user value carried as its own msgpack bytes, so that it passes
// through without being decoded), vectors, maps of strings, and other structs of this file.
namespace twinkle::transport {

// Version of the wire protocol, checked at every message. Bump on any incompatible change.
inline constexpr std::uint16_t kProtocolVersion = 14;

enum class MsgType : std::uint16_t {
  // Control messages: driver <-> worker, worker <-> worker (calls between groups), rendezvous.
  hello = 1,
  welcome = 2,
  create = 3,
  created = 4,
  call = 5,
  reply = 6,
  shutdown = 7,
  kv_set = 8,
  kv_get = 9,
  kv_value = 10,
  comm_join = 11,
  peer_lost = 12,
  probe = 13,
  save = 14,
  saved = 15,
  // restart = "worker" (docs/ARCHITECTURE.md, Restarts): survivors and replacements
  regroup = 16,
  recover = 17,
  recovered = 18,
  state_pull = 19,
  state = 61,
  peers_replaced = 62,
  made = 64,
  // Cluster messages (remote mode): between the head and its agents, drivers and clients.
  node_register = 20,
  node_welcome = 21,
  heartbeat = 22,
  reregister = 23,
  nodes_query = 24,
  nodes_info = 25,
  reserve = 26,
  reservation = 27,
  release = 28,
  lease = 29,
  launch = 30,
  launched = 31,
  need_plugin = 32,
  plugin = 33,
  stop_job = 34,
  stopped = 35,
  worker_exit = 36,
  output = 37,
  node_dead = 38,
  kill_job = 39,
  node_leave = 40,
  // The job service (docs/ARCHITECTURE.md, Job service): clients and the head.
  upload_check = 41,
  upload_part = 42,
  upload_state = 43,
  submit = 44,
  job_answer = 45,
  jobs_query = 46,
  jobs_info = 47,
  logs_query = 48,
  logs_chunk = 49,
  job_stop = 50,
  // The dashboard (docs/ARCHITECTURE.md, Dashboard): a member's login link.
  dashboard_link = 51,
  dashboard_grant = 52,
  // Teams and quotas (docs/ARCHITECTURE.md, Teams and quotas).
  quotas_query = 53,
  quotas_info = 54,
  // a submitted job's driver on a node (driver_labels)
  driver_start = 55,
  need_archive = 56,
  archive_part = 57,
  driver_status = 58,
  driver_ack = 59,
  job_resume = 60,
  // restart = "worker" on a DEAD node (docs/ARCHITECTURE.md, Restarts): more room for a run
  relocate = 63,
};

// "call"; "unknown" for a value that is no message type.
const char* to_string(MsgType t);

// A message that does not decode: its frames, header, body or tensor table.
class ProtocolError : public TransportError {
 public:
  using TransportError::TransportError;
};

namespace proto {

template <class C, class T>
struct Field {
  const char* name;
  T C::*member;
};
template <class C, class T>
constexpr Field<C, T> field(const char* name, T C::*member) {
  return {name, member};
}

// ----- control messages ---------------------------------------------------------------------

// worker -> driver, first thing after connecting.
struct Hello {
  static constexpr MsgType kType = MsgType::hello;
  std::string name;  // "model:3": the worker's identity on the channel
  std::string group;
  int rank = 0;
  int pid = 0;
  std::string host;
  std::string serve;  // where it serves calls from other workers
  static constexpr auto fields() {
    return std::tuple{field("name", &Hello::name), field("group", &Hello::group),
                      field("rank", &Hello::rank), field("pid", &Hello::pid),
                      field("host", &Hello::host), field("serve", &Hello::serve)};
  }
};

// A group in the run's address book (Welcome).
struct GroupEntry {
  std::string name;
  Value mesh;                        // core::mesh_to_value
  std::vector<std::uint64_t> peers;  // the run-wide index of each of its workers
  static constexpr auto fields() {
    return std::tuple{field("name", &GroupEntry::name), field("mesh", &GroupEntry::mesh),
                      field("peers", &GroupEntry::peers)};
  }
};

// A worker in the run's address book (Welcome).
struct WorkerEntry {
  std::string name;
  std::uint64_t group = 0;
  int index = 0;
  int pid = 0;
  std::string host;
  std::string serve;
  static constexpr auto fields() {
    return std::tuple{field("name", &WorkerEntry::name),   field("group", &WorkerEntry::group),
                      field("index", &WorkerEntry::index), field("pid", &WorkerEntry::pid),
                      field("host", &WorkerEntry::host),   field("serve", &WorkerEntry::serve)};
  }
};

// The checkpoint a run resumes from: this worker's part of it (docs/ARCHITECTURE.md,
// Checkpoints).
struct ResumePart {
  std::string file;    // absolute path; empty: this worker has no part
  std::string sha256;  // of the file, from the manifest
  std::int64_t step = 0;
  static constexpr auto fields() {
    return std::tuple{field("file", &ResumePart::file), field("sha256", &ResumePart::sha256),
                      field("step", &ResumePart::step)};
  }
};

// driver -> worker, once every worker said hello.
struct Welcome {
  static constexpr MsgType kType = MsgType::welcome;
  std::string job;
  std::vector<GroupEntry> groups;
  std::vector<WorkerEntry> workers;
  std::uint64_t self = 0;   // this worker's index in `workers`
  Value args;               // the job's [args]
  Value mesh;               // this worker's group's mesh
  std::string device;       // "cpu" | "cuda"
  std::string kv;           // the rendezvous store's endpoint
  std::string collectives;  // "auto" | "shm" | "gloo"
  double timeout_s = 0;
  std::optional<ResumePart> resume;  // a resumed run, or a group restarted from a checkpoint
  int generation = 0;                // how many times this worker's group was restarted
  static constexpr auto fields() {
    return std::tuple{field("job", &Welcome::job),
                      field("groups", &Welcome::groups),
                      field("workers", &Welcome::workers),
                      field("self", &Welcome::self),
                      field("args", &Welcome::args),
                      field("mesh", &Welcome::mesh),
                      field("device", &Welcome::device),
                      field("kv", &Welcome::kv),
                      field("collectives", &Welcome::collectives),
                      field("timeout_s", &Welcome::timeout_s),
                      field("resume", &Welcome::resume),
                      field("generation", &Welcome::generation)};
  }
};

// One step of the chain of calls that led to a call between groups, for the cycle checks.
struct ChainLink {
  std::string worker;       // "trainer:0", or "driver"
  std::uint64_t token = 0;  // that worker's call number
  std::string what;         // "Trainer.step"
  std::string caller;       // its call site, "train.cpp:12"
  static constexpr auto fields() {
    return std::tuple{field("worker", &ChainLink::worker), field("token", &ChainLink::token),
                      field("what", &ChainLink::what), field("caller", &ChainLink::caller)};
  }
};

// caller -> worker, id = the instance: construct `cls` with `args`.
struct Create {
  static constexpr MsgType kType = MsgType::create;
  std::string cls;
  EncodedValue args;
  std::vector<ChainLink> chain;  // empty from the driver
  // A restart's replacement makes again an instance that worker `maker` made first (its state's
  // key names the maker).
  std::optional<std::string> maker;
  static constexpr auto fields() {
    return std::tuple{field("class", &Create::cls), field("args", &Create::args),
                      field("chain", &Create::chain), field("maker", &Create::maker)};
  }
};

// worker -> caller, id = the instance.
struct Created {
  static constexpr MsgType kType = MsgType::created;
  std::optional<std::string> error;  // none: constructed
  static constexpr auto fields() { return std::tuple{field("error", &Created::error)}; }
};

// caller -> worker, id = the call.
struct Call {
  static constexpr MsgType kType = MsgType::call;
  std::uint64_t instance = 0;
  std::string method;
  std::string caller;  // call site, "train.cpp:42"
  EncodedValue args;   // this worker's share (dispatch)
  std::vector<ChainLink> chain;
  static constexpr auto fields() {
    return std::tuple{field("instance", &Call::instance), field("method", &Call::method),
                      field("caller", &Call::caller), field("args", &Call::args),
                      field("chain", &Call::chain)};
  }
};

// worker -> caller, id = the call.
struct Reply {
  static constexpr MsgType kType = MsgType::reply;
  std::optional<std::string> error;  // none: `value` is the result
  EncodedValue value;
  static constexpr auto fields() {
    return std::tuple{field("error", &Reply::error), field("value", &Reply::value)};
  }
};

// driver -> worker: destroy the instances and exit.
struct Shutdown {
  static constexpr MsgType kType = MsgType::shutdown;
  static constexpr auto fields() { return std::tuple{}; }
};

// client -> rendezvous store.
struct KvSet {
  static constexpr MsgType kType = MsgType::kv_set;
  std::string key;
  Bytes value;
  static constexpr auto fields() {
    return std::tuple{field("key", &KvSet::key), field("value", &KvSet::value)};
  }
};

// client -> rendezvous store, id = the request: answered once `key` is set.
struct KvGet {
  static constexpr MsgType kType = MsgType::kv_get;
  std::string key;
  static constexpr auto fields() { return std::tuple{field("key", &KvGet::key)}; }
};

// rendezvous store -> client, id = the request.
struct KvValue {
  static constexpr MsgType kType = MsgType::kv_value;
  Bytes value;
  std::optional<std::string> error;  // the key will never be set (KvServer::retire)
  static constexpr auto fields() {
    return std::tuple{field("value", &KvValue::value), field("error", &KvValue::error)};
  }
};

// driver -> worker: its place in a communicator across groups.
struct CommJoin {
  static constexpr MsgType kType = MsgType::comm_join;
  std::string name;
  int rank = 0;
  std::vector<std::string> members;  // "group:index" by rank
  double timeout_s = 0;
  // Declared again after a member's group restarted (its rendezvous keys are new): the worker
  // drops what it had of the communicator.
  int generation = 0;
  static constexpr auto fields() {
    return std::tuple{field("name", &CommJoin::name), field("rank", &CommJoin::rank),
                      field("members", &CommJoin::members),
                      field("timeout_s", &CommJoin::timeout_s),
                      field("generation", &CommJoin::generation)};
  }
};

// driver -> worker: a worker of the run is gone.
struct PeerLost {
  static constexpr MsgType kType = MsgType::peer_lost;
  std::uint64_t peer = 0;
  std::string text;
  static constexpr auto fields() {
    return std::tuple{field("peer", &PeerLost::peer), field("text", &PeerLost::text)};
  }
};

// worker -> worker: who waits on whom (cycles of calls through several workers).
struct Probe {
  static constexpr MsgType kType = MsgType::probe;
  std::string origin;
  std::uint64_t token = 0;
  std::vector<std::string> nodes;  // the workers it passed, origin first
  std::vector<std::string> path;   // what each of them runs
  static constexpr auto fields() {
    return std::tuple{field("origin", &Probe::origin), field("token", &Probe::token),
                      field("nodes", &Probe::nodes), field("path", &Probe::path)};
  }
};

// driver -> worker, id = the request: save the state of every instance that has state into
// `dir`/`file` (the worker's part of the checkpoint of `step`), in turn with its calls.
struct Save {
  static constexpr MsgType kType = MsgType::save;
  std::string dir;   // the checkpoint's folder while it is written (absolute)
  std::string file;  // the part's name in it
  std::int64_t step = 0;
  static constexpr auto fields() {
    return std::tuple{field("dir", &Save::dir), field("file", &Save::file),
                      field("step", &Save::step)};
  }
};

// worker -> driver, id = the request: the part is on disk (fsynced), or why not.
struct Saved {
  static constexpr MsgType kType = MsgType::saved;
  std::optional<std::string> error;
  std::string sha256;
  std::uint64_t bytes = 0;
  std::uint64_t instances = 0;  // how many states the part holds
  static constexpr auto fields() {
    return std::tuple{field("error", &Saved::error), field("sha256", &Saved::sha256),
                      field("bytes", &Saved::bytes), field("instances", &Saved::instances)};
  }
};

// driver -> a surviving worker of a group whose lost ranks are being replaced, in turn with its
// calls: what was sent before it is of the group as it was; from now on the group's
// communicators are those of `generation` (their rendezvous keys are new). `donor`: a
// replacement will pull this worker's state (recover = "peer"), so it is taken now, while the
// replacement starts (docs/ARCHITECTURE.md, Restarts).
struct Regroup {
  static constexpr MsgType kType = MsgType::regroup;
  int generation = 0;
  bool donor = false;
  static constexpr auto fields() {
    return std::tuple{field("generation", &Regroup::generation), field("donor", &Regroup::donor)};
  }
};

// driver -> a replacement, after the creates of its instances: copy their state from worker
// `donor` (a surviving replica; the index in the welcome's workers). Answered with recovered.
struct Recover {
  static constexpr MsgType kType = MsgType::recover;
  std::uint64_t donor = 0;
  int generation = 0;
  static constexpr auto fields() {
    return std::tuple{field("donor", &Recover::donor), field("generation", &Recover::generation)};
  }
};

// replacement -> driver, id = the recover: the states it loaded, or why it could not.
struct Recovered {
  static constexpr MsgType kType = MsgType::recovered;
  std::optional<std::string> error;
  std::uint64_t instances = 0;
  std::uint64_t bytes = 0;  // of tensors
  double seconds = 0;       // from the pull to the last load
  static constexpr auto fields() {
    return std::tuple{field("error", &Recovered::error), field("instances", &Recovered::instances),
                      field("bytes", &Recovered::bytes), field("seconds", &Recovered::seconds)};
  }
};

// replacement -> donor (its serve socket): the state of every instance that has state, once the
// donor is at `generation` (it has run what was sent to it before its regroup).
struct StatePull {
  static constexpr MsgType kType = MsgType::state_pull;
  int generation = 0;
  static constexpr auto fields() { return std::tuple{field("generation", &StatePull::generation)}; }
};

// One instance's state: its key (docs/ARCHITECTURE.md, Checkpoints), its class, its save().
struct StateEntry {
  std::string key;
  std::string cls;
  EncodedValue state;
  static constexpr auto fields() {
    return std::tuple{field("key", &StateEntry::key), field("cls", &StateEntry::cls),
                      field("state", &StateEntry::state)};
  }
};

// donor -> replacement, id = the state_pull.
struct State {
  static constexpr MsgType kType = MsgType::state;
  std::optional<std::string> error;
  std::vector<StateEntry> entries;
  static constexpr auto fields() {
    return std::tuple{field("error", &State::error), field("entries", &State::entries)};
  }
};

// driver -> the other workers of the run, when a restarted group is back: where its replaced
// workers serve now; calls that wait on one of them fail with `text` (their worker was lost).
struct PeersReplaced {
  static constexpr MsgType kType = MsgType::peers_replaced;
  std::vector<WorkerEntry> workers;
  std::string text;
  static constexpr auto fields() {
    return std::tuple{field("workers", &PeersReplaced::workers),
                      field("text", &PeersReplaced::text)};
  }
};

// worker -> driver, id = the instance: this worker made an instance of `cls` on workers `workers`
// of group `group` (a call between groups); a restart of that group makes it again there.
struct Made {
  static constexpr MsgType kType = MsgType::made;
  std::uint64_t group = 0;
  std::vector<int> workers;
  std::string cls;
  EncodedValue args;
  static constexpr auto fields() {
    return std::tuple{field("group", &Made::group), field("workers", &Made::workers),
                      field("class", &Made::cls), field("args", &Made::args)};
  }
};

using Control = std::variant<Hello, Welcome, Create, Created, Call, Reply, Shutdown, KvSet, KvGet,
                             KvValue, CommJoin, PeerLost, Probe, Save, Saved, Regroup, Recover,
                             Recovered, StatePull, State, PeersReplaced, Made>;

// ----- cluster messages ---------------------------------------------------------------------
// The head forwards launch, plugin and stop_job to the agent of their `node`, and launched,
// need_plugin, stopped, worker_exit and output to the driver of their `run`.

struct GpuEntry {
  int index = 0;
  std::string name;
  std::int64_t memory = 0;  // bytes
  std::string uuid;
  std::string run;  // nodes_info: the run that holds it ("" free)
  // nodes_info: its use in the node's last heartbeat, when its agent samples NVML.
  std::optional<int> util;                  // percent
  std::optional<std::int64_t> memory_used;  // bytes
  static constexpr auto fields() {
    return std::tuple{field("index", &GpuEntry::index),
                      field("name", &GpuEntry::name),
                      field("memory", &GpuEntry::memory),
                      field("uuid", &GpuEntry::uuid),
                      field("run", &GpuEntry::run),
                      field("util", &GpuEntry::util),
                      field("memory_used", &GpuEntry::memory_used)};
  }
};

// One GPU's use, sampled through NVML.
struct GpuUseEntry {
  int index = 0;
  int util = 0;                  // percent
  std::int64_t memory_used = 0;  // bytes
  static constexpr auto fields() {
    return std::tuple{field("index", &GpuUseEntry::index), field("util", &GpuUseEntry::util),
                      field("memory_used", &GpuUseEntry::memory_used)};
  }
};

// A run's part on a node, as the agent reports it when it registers.
struct NodeJob {
  std::string run, job, owner;
  std::string user;        // the member it runs for, as the head named it at launch
  std::int64_t since = 0;  // unix seconds
  std::vector<int> gpus;
  int cpus = 0;
  std::int64_t memory = 0;  // its workers' memory limits, summed
  static constexpr auto fields() {
    return std::tuple{field("run", &NodeJob::run),       field("job", &NodeJob::job),
                      field("owner", &NodeJob::owner),   field("since", &NodeJob::since),
                      field("gpus", &NodeJob::gpus),     field("cpus", &NodeJob::cpus),
                      field("memory", &NodeJob::memory), field("user", &NodeJob::user)};
  }
};

// agent -> head.
struct NodeRegister {
  static constexpr MsgType kType = MsgType::node_register;
  std::string node, host, address;
  int cpus = 0;
  std::int64_t memory = 0;
  std::vector<GpuEntry> gpus;
  std::map<std::string, std::string> labels;
  std::vector<NodeJob> jobs;  // what it still runs (a restarted head adopts them)
  // How it keeps jobs apart: "cgroup v1 (cpu, memory)", or "not enforced: WHY".
  std::string isolation;
  // Whether it keeps users apart: "apart: alice as tw-alice, ...", or "not apart: WHY".
  std::string users;
  static constexpr auto fields() {
    return std::tuple{
        field("node", &NodeRegister::node),           field("host", &NodeRegister::host),
        field("address", &NodeRegister::address),     field("cpus", &NodeRegister::cpus),
        field("memory", &NodeRegister::memory),       field("gpus", &NodeRegister::gpus),
        field("labels", &NodeRegister::labels),       field("jobs", &NodeRegister::jobs),
        field("isolation", &NodeRegister::isolation), field("users", &NodeRegister::users)};
  }
};

// head -> agent.
struct NodeWelcome {
  static constexpr MsgType kType = MsgType::node_welcome;
  std::optional<std::string> error;  // none: registered
  static constexpr auto fields() { return std::tuple{field("error", &NodeWelcome::error)}; }
};

// agent -> head, every heartbeat interval.
struct Heartbeat {
  static constexpr MsgType kType = MsgType::heartbeat;
  std::string node;
  // Its GPUs' use now; absent where the agent has no NVML to ask.
  std::optional<std::vector<GpuUseEntry>> gpus;
  static constexpr auto fields() {
    return std::tuple{field("node", &Heartbeat::node), field("gpus", &Heartbeat::gpus)};
  }
};

// head -> agent: the head does not know this agent (it restarted).
struct Reregister {
  static constexpr MsgType kType = MsgType::reregister;
  static constexpr auto fields() { return std::tuple{}; }
};

// client -> head.
struct NodesQuery {
  static constexpr MsgType kType = MsgType::nodes_query;
  static constexpr auto fields() { return std::tuple{}; }
};

struct NodeEntry {
  std::string id, host, address;
  std::string state;  // "ALIVE" | "DEAD"
  int cpus = 0;
  int cpus_free = 0;
  std::int64_t memory = 0;
  std::vector<GpuEntry> gpus;
  std::map<std::string, std::string> labels;
  double heartbeat_age_s = 0;
  std::int64_t registered = 0;  // unix seconds
  std::string isolation;        // as its node_register said
  std::string users;            // as its node_register said
  static constexpr auto fields() {
    return std::tuple{field("id", &NodeEntry::id),
                      field("host", &NodeEntry::host),
                      field("address", &NodeEntry::address),
                      field("state", &NodeEntry::state),
                      field("cpus", &NodeEntry::cpus),
                      field("cpus_free", &NodeEntry::cpus_free),
                      field("memory", &NodeEntry::memory),
                      field("gpus", &NodeEntry::gpus),
                      field("labels", &NodeEntry::labels),
                      field("heartbeat_age_s", &NodeEntry::heartbeat_age_s),
                      field("registered", &NodeEntry::registered),
                      field("isolation", &NodeEntry::isolation),
                      field("users", &NodeEntry::users)};
  }
};

struct BundleEntry {
  std::string node;
  std::vector<int> gpus;
  int cpus = 0;
  static constexpr auto fields() {
    return std::tuple{field("node", &BundleEntry::node), field("gpus", &BundleEntry::gpus),
                      field("cpus", &BundleEntry::cpus)};
  }
};

struct ReservationEntry {
  std::string run, job, owner;
  std::int64_t since = 0;
  std::vector<BundleEntry> bundles;
  static constexpr auto fields() {
    return std::tuple{field("run", &ReservationEntry::run), field("job", &ReservationEntry::job),
                      field("owner", &ReservationEntry::owner),
                      field("since", &ReservationEntry::since),
                      field("bundles", &ReservationEntry::bundles)};
  }
};

// head -> client, id = the query's.
struct NodesInfo {
  static constexpr MsgType kType = MsgType::nodes_info;
  std::string head;  // the head's endpoint
  std::vector<NodeEntry> nodes;
  std::vector<ReservationEntry> reservations;
  static constexpr auto fields() {
    return std::tuple{field("head", &NodesInfo::head), field("nodes", &NodesInfo::nodes),
                      field("reservations", &NodesInfo::reservations)};
  }
};

// What one group of a job asks the head for.
struct GroupDemandEntry {
  std::string name;
  int workers = 0;
  int gpus_per_worker = 0;
  std::string strategy;  // "pack" | "spread" | "strict_pack" | "strict_spread"
  std::map<std::string, std::string> labels;
  std::int64_t memory = 0;  // each worker's memory limit in bytes (0 none)
  static constexpr auto fields() {
    return std::tuple{field("name", &GroupDemandEntry::name),
                      field("workers", &GroupDemandEntry::workers),
                      field("gpus_per_worker", &GroupDemandEntry::gpus_per_worker),
                      field("strategy", &GroupDemandEntry::strategy),
                      field("labels", &GroupDemandEntry::labels),
                      field("memory", &GroupDemandEntry::memory)};
  }
};

// driver -> head, id = the request.
struct Reserve {
  static constexpr MsgType kType = MsgType::reserve;
  std::string run, job, owner;
  bool dry_run = false;  // only plan (twinkle topology)
  std::vector<GroupDemandEntry> groups;
  std::optional<std::int64_t> job_id;  // a submitted job's driver (TWINKLE_JOB_ID)
  static constexpr auto fields() {
    return std::tuple{field("run", &Reserve::run),       field("job", &Reserve::job),
                      field("owner", &Reserve::owner),   field("dry_run", &Reserve::dry_run),
                      field("groups", &Reserve::groups), field("job_id", &Reserve::job_id)};
  }
};

struct SlotEntry {
  std::string node;
  std::vector<int> gpus;
  static constexpr auto fields() {
    return std::tuple{field("node", &SlotEntry::node), field("gpus", &SlotEntry::gpus)};
  }
};

struct NodeAddress {
  std::string node, host, address;
  static constexpr auto fields() {
    return std::tuple{field("node", &NodeAddress::node), field("host", &NodeAddress::host),
                      field("address", &NodeAddress::address)};
  }
};

// head -> driver, id = the request.
struct Reservation {
  static constexpr MsgType kType = MsgType::reservation;
  bool ok = false;
  std::string kind;                            // not ok: "infeasible" | "busy"
  std::string message;                         // not ok: why
  std::string holders;                         // busy: who holds the devices
  std::vector<std::vector<SlotEntry>> groups;  // ok: per group, per worker
  std::vector<NodeAddress> nodes;              // ok: the nodes of the slots
  static constexpr auto fields() {
    return std::tuple{
        field("ok", &Reservation::ok),           field("kind", &Reservation::kind),
        field("message", &Reservation::message), field("holders", &Reservation::holders),
        field("groups", &Reservation::groups),   field("nodes", &Reservation::nodes)};
  }
};

// driver -> head, id = the request: room for workers of run `run` whose node is DEAD, on other
// live nodes (never one of `exclude`); `groups` as in a reservation, each with only the workers
// to move, whose ranks `ranks` lists (per group). Answered with a Reservation whose groups give
// the new slots; the run holds them.
struct Relocate {
  static constexpr MsgType kType = MsgType::relocate;
  std::string run;
  std::vector<GroupDemandEntry> groups;
  std::vector<std::vector<int>> ranks;
  std::vector<std::string> exclude;
  static constexpr auto fields() {
    return std::tuple{field("run", &Relocate::run), field("groups", &Relocate::groups),
                      field("ranks", &Relocate::ranks), field("exclude", &Relocate::exclude)};
  }
};

// driver -> head: the run ended.
struct Release {
  static constexpr MsgType kType = MsgType::release;
  std::string run;
  std::optional<std::string> outcome;  // "succeeded" | "failed" | "stopped"; none: not known
  int restarts = 0;                    // its groups' restarts in all (as in `lease`)
  static constexpr auto fields() {
    return std::tuple{field("run", &Release::run), field("outcome", &Release::outcome),
                      field("restarts", &Release::restarts)};
  }
};

// driver -> head, every heartbeat interval: the run's driver is alive.
struct Lease {
  static constexpr MsgType kType = MsgType::lease;
  std::string run;
  int restarts = 0;  // the run's group restarts so far (max_restarts)
  static constexpr auto fields() {
    return std::tuple{field("run", &Lease::run), field("restarts", &Lease::restarts)};
  }
};

struct LaunchWorker {
  std::string name;
  std::vector<std::string> env;  // "KEY=VALUE"
  std::int64_t memory = 0;       // its memory limit in bytes (0 none)
  static constexpr auto fields() {
    return std::tuple{field("name", &LaunchWorker::name), field("env", &LaunchWorker::env),
                      field("memory", &LaunchWorker::memory)};
  }
};

// The run's worker key pair and the driver's public key (CURVE).
struct RunKeys {
  std::string public_key, secret_key, server_key;
  static constexpr auto fields() {
    return std::tuple{field("public", &RunKeys::public_key), field("secret", &RunKeys::secret_key),
                      field("server", &RunKeys::server_key)};
  }
};

// driver -> agent (through the head).
struct Launch {
  static constexpr MsgType kType = MsgType::launch;
  std::string run, node, job, owner;
  // The member the run is for: set by the head from the run's reservation (what a driver says
  // here is replaced); a node with --run-as starts the workers as that member's account.
  std::string user;
  std::string sha256;    // the plugin's
  std::string endpoint;  // the driver's socket
  std::vector<int> gpus;
  int cpus = 0;
  std::vector<LaunchWorker> workers;
  std::optional<RunKeys> keys;  // when the cluster uses keys
  // Replacements of workers of a run the node runs already (a group's restart): their former
  // processes have exited.
  bool restart = false;
  static constexpr auto fields() {
    return std::tuple{field("run", &Launch::run),           field("node", &Launch::node),
                      field("job", &Launch::job),           field("owner", &Launch::owner),
                      field("user", &Launch::user),         field("sha256", &Launch::sha256),
                      field("endpoint", &Launch::endpoint), field("gpus", &Launch::gpus),
                      field("cpus", &Launch::cpus),         field("workers", &Launch::workers),
                      field("keys", &Launch::keys),         field("restart", &Launch::restart)};
  }
};

// agent -> driver.
struct Launched {
  static constexpr MsgType kType = MsgType::launched;
  std::string run, node;
  std::optional<std::string> error;  // none: started
  static constexpr auto fields() {
    return std::tuple{field("run", &Launched::run), field("node", &Launched::node),
                      field("error", &Launched::error)};
  }
};

// agent -> driver: send the plugin with this sha256.
struct NeedPlugin {
  static constexpr MsgType kType = MsgType::need_plugin;
  std::string run, node, sha256;
  static constexpr auto fields() {
    return std::tuple{field("run", &NeedPlugin::run), field("node", &NeedPlugin::node),
                      field("sha256", &NeedPlugin::sha256)};
  }
};

// driver -> agent.
struct PluginBytes {
  static constexpr MsgType kType = MsgType::plugin;
  std::string run, node, sha256;
  Tensor bytes;  // u8
  static constexpr auto fields() {
    return std::tuple{field("run", &PluginBytes::run), field("node", &PluginBytes::node),
                      field("sha256", &PluginBytes::sha256), field("bytes", &PluginBytes::bytes)};
  }
};

// driver -> agent: stop the run's workers on the node (answered with `stopped`), or, with
// `workers`, kill only those now (a group's restart; their exits come as `worker_exit`).
struct StopJob {
  static constexpr MsgType kType = MsgType::stop_job;
  std::string run, node;
  std::int64_t grace_ms = 0;
  std::vector<std::string> workers;
  static constexpr auto fields() {
    return std::tuple{field("run", &StopJob::run), field("node", &StopJob::node),
                      field("grace_ms", &StopJob::grace_ms), field("workers", &StopJob::workers)};
  }
};

// agent -> driver: the run's workers on the node are stopped.
struct Stopped {
  static constexpr MsgType kType = MsgType::stopped;
  std::string run, node;
  std::vector<std::string> signalled;  // those that had to be killed
  static constexpr auto fields() {
    return std::tuple{field("run", &Stopped::run), field("node", &Stopped::node),
                      field("signalled", &Stopped::signalled)};
  }
};

// agent -> driver.
struct WorkerExit {
  static constexpr MsgType kType = MsgType::worker_exit;
  std::string run, node, name;
  int pid = 0;
  int exit_code = 0;
  int signal = 0;
  std::string text;                      // "exited with code 3"
  std::vector<std::string> stderr_tail;  // its last stderr lines
  static constexpr auto fields() {
    return std::tuple{field("run", &WorkerExit::run),
                      field("node", &WorkerExit::node),
                      field("name", &WorkerExit::name),
                      field("pid", &WorkerExit::pid),
                      field("exit_code", &WorkerExit::exit_code),
                      field("signal", &WorkerExit::signal),
                      field("text", &WorkerExit::text),
                      field("stderr", &WorkerExit::stderr_tail)};
  }
};

// agent -> driver: a line a worker wrote.
struct Output {
  static constexpr MsgType kType = MsgType::output;
  std::string run, name;
  bool is_stderr = false;
  std::string line;
  static constexpr auto fields() {
    return std::tuple{field("run", &Output::run), field("name", &Output::name),
                      field("stderr", &Output::is_stderr), field("line", &Output::line)};
  }
};

// head -> driver: a node of its run is gone.
struct NodeDead {
  static constexpr MsgType kType = MsgType::node_dead;
  std::string node, host, address, reason;
  static constexpr auto fields() {
    return std::tuple{field("node", &NodeDead::node), field("host", &NodeDead::host),
                      field("address", &NodeDead::address), field("reason", &NodeDead::reason)};
  }
};

// head -> agent: the run's driver is gone (its lease expired) or the run was released.
struct KillJob {
  static constexpr MsgType kType = MsgType::kill_job;
  std::string run;
  static constexpr auto fields() { return std::tuple{field("run", &KillJob::run)}; }
};

// agent -> head: it is stopping.
struct NodeLeave {
  static constexpr MsgType kType = MsgType::node_leave;
  std::string node, reason;
  static constexpr auto fields() {
    return std::tuple{field("node", &NodeLeave::node), field("reason", &NodeLeave::reason)};
  }
};

// ----- the job service ----------------------------------------------------------------------
// A client asks, the head answers with the request's id. Who asks is the name of the key the
// connection authenticated with (the allow-list's); `user` fields count only on a cluster
// without keys, which is one machine's.

// client -> head: does the head hold the working directory archive with this sha256?
struct UploadCheck {
  static constexpr MsgType kType = MsgType::upload_check;
  std::string sha256;
  std::int64_t size = 0;  // bytes
  static constexpr auto fields() {
    return std::tuple{field("sha256", &UploadCheck::sha256), field("size", &UploadCheck::size)};
  }
};

// client -> head: the next piece of that archive, in order from offset 0.
struct UploadPart {
  static constexpr MsgType kType = MsgType::upload_part;
  std::string sha256;
  std::int64_t offset = 0;
  Bytes bytes;
  bool last = false;
  static constexpr auto fields() {
    return std::tuple{field("sha256", &UploadPart::sha256), field("offset", &UploadPart::offset),
                      field("bytes", &UploadPart::bytes), field("last", &UploadPart::last)};
  }
};

// head -> client: what it holds of the archive.
struct UploadState {
  static constexpr MsgType kType = MsgType::upload_state;
  bool have = false;          // all of it, checked
  std::int64_t received = 0;  // bytes so far
  std::optional<std::string> error;
  static constexpr auto fields() {
    return std::tuple{field("have", &UploadState::have), field("received", &UploadState::received),
                      field("error", &UploadState::error)};
  }
};

// A job that must end first: "ok" (succeeded), "notok" (failed or stopped) or "any".
struct AfterEntry {
  std::int64_t job = 0;
  std::string condition;
  static constexpr auto fields() {
    return std::tuple{field("job", &AfterEntry::job), field("condition", &AfterEntry::condition)};
  }
};

// client -> head: queue a job whose working directory the head holds.
struct Submit {
  static constexpr MsgType kType = MsgType::submit;
  std::string name;
  std::string job_file;                // inside the working directory, relative
  std::string sha256;                  // the working directory's archive
  std::vector<std::string> overrides;  // "SECTION.KEY=VALUE"
  int max_retries = 0;
  std::optional<AfterEntry> after;
  int priority = 0;  // within the submitter's team
  std::string user;  // clusters without keys only
  std::string from;  // the client's host
  static constexpr auto fields() {
    return std::tuple{field("name", &Submit::name),
                      field("job_file", &Submit::job_file),
                      field("sha256", &Submit::sha256),
                      field("overrides", &Submit::overrides),
                      field("max_retries", &Submit::max_retries),
                      field("after", &Submit::after),
                      field("priority", &Submit::priority),
                      field("user", &Submit::user),
                      field("from", &Submit::from)};
  }
};

// head -> client: the answer to submit and job_stop.
struct JobAnswer {
  static constexpr MsgType kType = MsgType::job_answer;
  std::int64_t job = 0;
  std::string text;
  std::optional<std::string> error;
  static constexpr auto fields() {
    return std::tuple{field("job", &JobAnswer::job), field("text", &JobAnswer::text),
                      field("error", &JobAnswer::error)};
  }
};

// client -> head.
struct JobsQuery {
  static constexpr MsgType kType = MsgType::jobs_query;
  std::optional<std::int64_t> job;  // one job, in full
  bool all = false;                 // history too, not only active and recent jobs
  std::string user, state;          // filters ("" none)
  static constexpr auto fields() {
    return std::tuple{field("job", &JobsQuery::job), field("all", &JobsQuery::all),
                      field("user", &JobsQuery::user), field("state", &JobsQuery::state)};
  }
};

// Where one rank of a job ran.
struct RankPlace {
  std::string group;
  int rank = 0;
  std::string node;
  std::vector<int> gpus;
  static constexpr auto fields() {
    return std::tuple{field("group", &RankPlace::group), field("rank", &RankPlace::rank),
                      field("node", &RankPlace::node), field("gpus", &RankPlace::gpus)};
  }
};

// One submit, stop or retry of a job, as the head recorded it.
struct AuditEntry {
  std::int64_t time = 0;  // unix seconds
  std::string user, action, from, detail;
  static constexpr auto fields() {
    return std::tuple{field("time", &AuditEntry::time), field("user", &AuditEntry::user),
                      field("action", &AuditEntry::action), field("from", &AuditEntry::from),
                      field("detail", &AuditEntry::detail)};
  }
};

struct JobEntry {
  std::int64_t id = 0;
  std::string name, user;
  std::string kind;  // "submitted" | "interactive"
  // QUEUED RUNNING PREEMPTED SUCCEEDED FAILED STOPPED DROPPED (interactive: ENDED)
  std::string state;
  std::string reason;                                  // why it waits, or how it ended
  std::int64_t submitted = 0, started = 0, ended = 0;  // unix seconds, 0 not yet
  int retries = 0, max_retries = 0;
  std::optional<int> exit_code;
  int gpus = 0, cpus = 0, nodes = 0;
  double gpu_seconds = 0;
  std::string run;  // the run id of its driver's latest attempt
  std::string from, stopped_by, job_file;
  std::vector<std::string> overrides;
  std::optional<AfterEntry> after;
  std::string team;
  int priority = 0;
  bool preemptible = true;
  int preemptions = 0;
  std::int64_t preempted_by = 0;  // the job it was last preempted for (0 none)
  int restarts = 0;               // its groups' restarts after a lost worker (max_restarts)
  // jobs_query with `job` only:
  std::vector<RankPlace> placement;
  std::vector<std::string> summary;  // the last lines of its log
  std::vector<AuditEntry> audit;
  std::optional<std::string> job_text;  // its job file (submitted jobs), for the topology
  std::optional<std::string> sha256;    // its working directory's archive, while the head has it
  std::string driver_node;  // a submitted job's driver ran on this node ("": the head's machine)
  static constexpr auto fields() {
    return std::tuple{field("id", &JobEntry::id),
                      field("name", &JobEntry::name),
                      field("user", &JobEntry::user),
                      field("kind", &JobEntry::kind),
                      field("state", &JobEntry::state),
                      field("reason", &JobEntry::reason),
                      field("submitted", &JobEntry::submitted),
                      field("started", &JobEntry::started),
                      field("ended", &JobEntry::ended),
                      field("retries", &JobEntry::retries),
                      field("max_retries", &JobEntry::max_retries),
                      field("exit_code", &JobEntry::exit_code),
                      field("gpus", &JobEntry::gpus),
                      field("cpus", &JobEntry::cpus),
                      field("nodes", &JobEntry::nodes),
                      field("gpu_seconds", &JobEntry::gpu_seconds),
                      field("run", &JobEntry::run),
                      field("from", &JobEntry::from),
                      field("stopped_by", &JobEntry::stopped_by),
                      field("job_file", &JobEntry::job_file),
                      field("overrides", &JobEntry::overrides),
                      field("after", &JobEntry::after),
                      field("team", &JobEntry::team),
                      field("priority", &JobEntry::priority),
                      field("preemptible", &JobEntry::preemptible),
                      field("preemptions", &JobEntry::preemptions),
                      field("preempted_by", &JobEntry::preempted_by),
                      field("restarts", &JobEntry::restarts),
                      field("placement", &JobEntry::placement),
                      field("summary", &JobEntry::summary),
                      field("audit", &JobEntry::audit),
                      field("job_text", &JobEntry::job_text),
                      field("sha256", &JobEntry::sha256),
                      field("driver_node", &JobEntry::driver_node)};
  }
};

// head -> client.
struct JobsInfo {
  static constexpr MsgType kType = MsgType::jobs_info;
  std::vector<JobEntry> jobs;
  std::optional<std::string> error;
  static constexpr auto fields() {
    return std::tuple{field("jobs", &JobsInfo::jobs), field("error", &JobsInfo::error)};
  }
};

// client -> head: a job's log from `offset` (bytes into the whole log), filtered.
struct LogsQuery {
  static constexpr MsgType kType = MsgType::logs_query;
  std::int64_t job = 0;
  std::int64_t offset = 0;
  std::string rank;     // "GROUP:N": only that rank's lines
  bool driver = false;  // only the driver's own lines
  std::string grep;     // ECMAScript regular expression
  int tail = 0;         // only the last N matching lines (offset 0 only)
  static constexpr auto fields() {
    return std::tuple{field("job", &LogsQuery::job),   field("offset", &LogsQuery::offset),
                      field("rank", &LogsQuery::rank), field("driver", &LogsQuery::driver),
                      field("grep", &LogsQuery::grep), field("tail", &LogsQuery::tail)};
  }
};

// head -> client: the matching lines of the next piece, and where the next query starts.
struct LogsChunk {
  static constexpr MsgType kType = MsgType::logs_chunk;
  std::string text;
  std::int64_t offset = 0;
  bool more = false;   // more is there now: ask again at once
  bool ended = false;  // the job has ended: nothing more will come
  std::optional<std::string> error;
  static constexpr auto fields() {
    return std::tuple{field("text", &LogsChunk::text), field("offset", &LogsChunk::offset),
                      field("more", &LogsChunk::more), field("ended", &LogsChunk::ended),
                      field("error", &LogsChunk::error)};
  }
};

// client -> head: stop a job (queued: dropped from the queue; running: the graceful path, or at
// once with `now`).
struct JobStop {
  static constexpr MsgType kType = MsgType::job_stop;
  std::int64_t job = 0;
  bool now = false;
  std::string user;  // clusters without keys only
  std::string from;
  static constexpr auto fields() {
    return std::tuple{field("job", &JobStop::job), field("now", &JobStop::now),
                      field("user", &JobStop::user), field("from", &JobStop::from)};
  }
};

// client -> head: a STOPPED or FAILED job back in the queue, to resume from its newest
// checkpoint (answered with job_answer).
struct JobResume {
  static constexpr MsgType kType = MsgType::job_resume;
  std::int64_t job = 0;
  std::string user;  // clusters without keys only
  std::string from;
  static constexpr auto fields() {
    return std::tuple{field("job", &JobResume::job), field("user", &JobResume::user),
                      field("from", &JobResume::from)};
  }
};

// client -> head: a one-time link that logs the caller in to the head's dashboard.
struct DashboardLink {
  static constexpr MsgType kType = MsgType::dashboard_link;
  std::string user;  // clusters without keys only
  static constexpr auto fields() { return std::tuple{field("user", &DashboardLink::user)}; }
};

// head -> client: the link (single use, valid for a minute), or why there is none.
struct DashboardGrant {
  static constexpr MsgType kType = MsgType::dashboard_grant;
  std::string url;
  std::optional<std::string> error;
  static constexpr auto fields() {
    return std::tuple{field("url", &DashboardGrant::url), field("error", &DashboardGrant::error)};
  }
};

// client -> head: each team's quota, use and share; with `reload`, the quotas file is read again
// first (an admin's).
struct QuotasQuery {
  static constexpr MsgType kType = MsgType::quotas_query;
  bool reload = false;
  std::string user;  // clusters without keys only
  std::string from;
  static constexpr auto fields() {
    return std::tuple{field("reload", &QuotasQuery::reload), field("user", &QuotasQuery::user),
                      field("from", &QuotasQuery::from)};
  }
};

// One team: its quota (no gpus or cpus: no limit), what it holds now, what of that is borrowed,
// its share of the past (decayed GPU- and CPU-seconds) and its jobs.
struct TeamEntry {
  std::string name;
  bool listed = true;  // in the quotas file (else the default team's numbers)
  std::optional<int> gpus, cpus;
  int borrow_gpus = 0, borrow_cpus = 0;
  double weight = 1;
  int max_priority = 0;
  int used_gpus = 0, used_cpus = 0;
  int borrowed_gpus = 0, borrowed_cpus = 0;
  double gpu_seconds = 0, cpu_seconds = 0;
  int running = 0, waiting = 0;
  std::vector<std::string> members;  // the allow-list's names in this team
  static constexpr auto fields() {
    return std::tuple{field("name", &TeamEntry::name),
                      field("listed", &TeamEntry::listed),
                      field("gpus", &TeamEntry::gpus),
                      field("cpus", &TeamEntry::cpus),
                      field("borrow_gpus", &TeamEntry::borrow_gpus),
                      field("borrow_cpus", &TeamEntry::borrow_cpus),
                      field("weight", &TeamEntry::weight),
                      field("max_priority", &TeamEntry::max_priority),
                      field("used_gpus", &TeamEntry::used_gpus),
                      field("used_cpus", &TeamEntry::used_cpus),
                      field("borrowed_gpus", &TeamEntry::borrowed_gpus),
                      field("borrowed_cpus", &TeamEntry::borrowed_cpus),
                      field("gpu_seconds", &TeamEntry::gpu_seconds),
                      field("cpu_seconds", &TeamEntry::cpu_seconds),
                      field("running", &TeamEntry::running),
                      field("waiting", &TeamEntry::waiting),
                      field("members", &TeamEntry::members)};
  }
};

// head -> client.
struct QuotasInfo {
  static constexpr MsgType kType = MsgType::quotas_info;
  std::string file;  // the quotas file ("" none)
  double half_life_s = 0;
  std::vector<TeamEntry> teams;
  std::string text;  // what a reload did
  std::optional<std::string> error;
  static constexpr auto fields() {
    return std::tuple{field("file", &QuotasInfo::file),
                      field("half_life_s", &QuotasInfo::half_life_s),
                      field("teams", &QuotasInfo::teams), field("text", &QuotasInfo::text),
                      field("error", &QuotasInfo::error)};
  }
};

// ----- a submitted job's driver on a node (docs/ARCHITECTURE.md, Drivers on nodes) ----------

// head -> agent: run job `job`'s driver here (its supervisor, detached, as on the head).
struct DriverStart {
  static constexpr MsgType kType = MsgType::driver_start;
  std::int64_t job = 0;
  std::string name, user;         // user: the member it runs for, which --run-as maps to an account
  std::string sha256;             // its working directory's archive
  std::int64_t size = 0;          // the archive's bytes
  std::string job_file;           // inside the working directory
  std::vector<std::string> sets;  // the driver's --set SECTION.KEY=VALUE, in order
  int max_retries = 0;
  bool resume_on_retry = false;
  std::int64_t log_cap = 0;
  double stop_grace_s = 0;
  std::optional<RunKeys> keys;  // the driver's own key pair and the head's public key
  // This start of the job's driver: every message about it carries it, and one of another
  // start (an earlier one on this node) is not taken for it.
  std::int64_t token = 0;
  static constexpr auto fields() {
    return std::tuple{field("job", &DriverStart::job),
                      field("token", &DriverStart::token),
                      field("name", &DriverStart::name),
                      field("user", &DriverStart::user),
                      field("sha256", &DriverStart::sha256),
                      field("size", &DriverStart::size),
                      field("job_file", &DriverStart::job_file),
                      field("sets", &DriverStart::sets),
                      field("max_retries", &DriverStart::max_retries),
                      field("resume_on_retry", &DriverStart::resume_on_retry),
                      field("log_cap", &DriverStart::log_cap),
                      field("stop_grace_s", &DriverStart::stop_grace_s),
                      field("keys", &DriverStart::keys)};
  }
};

// agent -> head: the next piece of job `job`'s working directory archive, from `offset`.
struct NeedArchive {
  static constexpr MsgType kType = MsgType::need_archive;
  std::int64_t job = 0;
  std::string sha256;
  std::int64_t offset = 0;
  std::int64_t token = 0;  // the start's (driver_start)
  static constexpr auto fields() {
    return std::tuple{field("job", &NeedArchive::job), field("token", &NeedArchive::token),
                      field("sha256", &NeedArchive::sha256), field("offset", &NeedArchive::offset)};
  }
};

// head -> agent.
struct ArchivePart {
  static constexpr MsgType kType = MsgType::archive_part;
  std::int64_t job = 0;
  std::string sha256;
  std::int64_t offset = 0;
  Bytes bytes;
  bool last = false;
  std::optional<std::string> error;  // the head cannot send it (the job is gone)
  std::int64_t token = 0;            // the start's (driver_start)
  static constexpr auto fields() {
    return std::tuple{field("job", &ArchivePart::job),       field("token", &ArchivePart::token),
                      field("sha256", &ArchivePart::sha256), field("offset", &ArchivePart::offset),
                      field("bytes", &ArchivePart::bytes),   field("last", &ArchivePart::last),
                      field("error", &ArchivePart::error)};
  }
};

// agent -> head, while it keeps a job's driver: its log from `offset` (bytes into the log the
// supervisor writes on the node), how it goes, and at last how it ended.
struct DriverStatus {
  static constexpr MsgType kType = MsgType::driver_status;
  std::int64_t job = 0;
  std::int64_t offset = 0;
  Bytes log;
  int attempt = -1;                  // the supervisor's attempt (0 first; -1 not started yet)
  std::optional<int> exit;           // its exit file: the driver's last exit status
  int retries = 0;                   // with exit
  bool lost = false;                 // its supervisor ended without an exit file
  std::optional<std::string> error;  // it could not be started here
  std::int64_t token = 0;            // the start's (driver_start)
  static constexpr auto fields() {
    return std::tuple{
        field("job", &DriverStatus::job),         field("token", &DriverStatus::token),
        field("offset", &DriverStatus::offset),   field("log", &DriverStatus::log),
        field("attempt", &DriverStatus::attempt), field("exit", &DriverStatus::exit),
        field("retries", &DriverStatus::retries), field("lost", &DriverStatus::lost),
        field("error", &DriverStatus::error)};
  }
};

// head -> agent: the log the head holds up to `log_end` (in the node's offsets); `signal` the
// supervisor is to get (SIGTERM: stop; SIGUSR2: kill now; 0 none); `done`: the head recorded the
// job's end (or the job is not this node's), so the agent forgets it (killing what is left).
struct DriverAck {
  static constexpr MsgType kType = MsgType::driver_ack;
  std::int64_t job = 0;
  std::int64_t log_end = 0;
  int signal = 0;
  bool done = false;
  std::int64_t token = 0;  // the start's (driver_start)
  static constexpr auto fields() {
    return std::tuple{field("job", &DriverAck::job), field("token", &DriverAck::token),
                      field("log_end", &DriverAck::log_end), field("signal", &DriverAck::signal),
                      field("done", &DriverAck::done)};
  }
};

using Cluster =
    std::variant<NodeRegister, NodeWelcome, Heartbeat, Reregister, NodesQuery, NodesInfo, Reserve,
                 Reservation, Release, Lease, Launch, Launched, NeedPlugin, PluginBytes, StopJob,
                 Stopped, WorkerExit, Output, NodeDead, KillJob, NodeLeave, UploadCheck, UploadPart,
                 UploadState, Submit, JobAnswer, JobsQuery, JobsInfo, LogsQuery, LogsChunk, JobStop,
                 DashboardLink, DashboardGrant, QuotasQuery, QuotasInfo, DriverStart, NeedArchive,
                 ArchivePart, DriverStatus, DriverAck, JobResume, Relocate>;

// A message's fields as a Value map of the same names (payloads decoded; a ValueError when one does
// not decode): for `twinkle nodes --json`, for logs and for tests.
Value to_value(const NodesInfo& info);
Value to_value(const JobEntry& job);
Value to_value(const QuotasInfo& info);
Value to_value(const Control& body);

// Every message type with its fields, one line each: "call: instance u64, method str, ...".
// What docs/ARCHITECTURE.md lists (a test keeps the two the same).
std::vector<std::string> describe_messages();

}  // namespace proto

// A decoded message: its id (the call, instance or request it belongs to; 0 for none) and body.
template <class Body>
struct Envelope {
  std::uint64_t id = 0;
  Body body;
  MsgType type() const {
    return std::visit([](const auto& b) { return std::decay_t<decltype(b)>::kType; }, body);
  }
  template <class T>
  T* get() {
    return std::get_if<T>(&body);
  }
  template <class T>
  const T* get() const {
    return std::get_if<T>(&body);
  }
};
using Message = Envelope<proto::Control>;
using ClusterMessage = Envelope<proto::Cluster>;

// The one policy for messages that do not decode, come from strangers or do not fit where they
// arrive: dropped and counted, never fatal, never an "internal error"; logged at most once a
// second (with the count of those not logged). Thread-compatible: one per receiving loop.
class DropLog {
 public:
  using Sink = std::function<void(const std::string& line)>;
  // `where` names the receiver in each line ("the control socket"); `sink` gets the lines
  // (default: stderr with a "twinkle: " prefix).
  explicit DropLog(std::string where, Sink sink = {});
  void drop(const std::string& why);
  std::uint64_t count() const { return count_; }

 private:
  std::string where_;
  Sink sink_;
  std::uint64_t count_ = 0;
  std::uint64_t unlogged_ = 0;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace twinkle::transport
