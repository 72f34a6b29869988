// The Twinkle plugin SDK: what plugin authors write against. Header-only; a plugin includes this
// and links nothing of Twinkle's. Everything here turns C++ into the C ABI of <twinkle/plugin.h>.
//
//   struct Model {
//     explicit Model(twinkle::Context& ctx);
//     twinkle::Value train_step(twinkle::Context& ctx, const twinkle::Value& batch);
//   };
//   TWINKLE_CLASS(Model, twinkle::execute::all);
//   TWINKLE_METHOD(Model, train_step, twinkle::dispatch::slice_dp, twinkle::collect::mean);
//   TWINKLE_DRIVER(main, twinkle::Driver& d) {
//     auto model = d.create<Model>("model");
//     auto loss = model.call("train_step", batch);   // a LazyCollect, at once
//     d.log("loss {}", loss.get()["loss"].as<double>());
//   }
//   TWINKLE_PLUGIN("digits", "1.0.0");
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <source_location>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "twinkle/plugin.h"
#include "twinkle/value.hpp"

namespace twinkle {

// A remote call failed: a worker raised, died or timed out. The message starts with
// "[twinkle driver caller: FILE:LINE]" and names class.method, group, rank, host and pid.
class RemoteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A call or constructor failed because a worker of its group was lost and the group restarts
// ([[group]] max_restarts): the message names the worker, how it was lost and the ranks where the
// call may have run. Calls made after it wait for the group to be back; its instances are made
// again with the same handles and, with recover = "checkpoint", the newest checkpoint's state.
class WorkerLost : public RemoteError {
 public:
  using RemoteError::RemoteError;
};

namespace detail {
// Throws WorkerLost for a host error that carries TWK_WORKER_LOST_TAG, RemoteError otherwise.
[[noreturn]] inline void throw_remote(const std::string& prefix, const std::string& error) {
  constexpr std::string_view tag = TWK_WORKER_LOST_TAG;
  if (std::string_view(error).substr(0, tag.size()) == tag)
    throw WorkerLost(prefix + error.substr(tag.size()));
  throw RemoteError(prefix + error);
}
}  // namespace detail

// The metadata of a remote method (twinkle-plugin(7), DISPATCH, EXECUTE, COLLECT).
namespace dispatch {
struct Spec {
  std::int32_t kind;
  const char* fn = nullptr;
};
inline constexpr Spec all{TWK_DISPATCH_ALL};
inline constexpr Spec slice{TWK_DISPATCH_SLICE};
inline constexpr Spec slice_dp{TWK_DISPATCH_SLICE_DP};
// A function registered with TWINKLE_DISPATCHER(name, ...).
constexpr Spec custom(const char* name) { return {TWK_DISPATCH_CUSTOM, name}; }
}  // namespace dispatch

namespace execute {
struct Spec {
  std::int32_t kind;
};
inline constexpr Spec all{TWK_EXECUTE_ALL};
inline constexpr Spec first{TWK_EXECUTE_FIRST};
inline constexpr Spec peer{TWK_EXECUTE_PEER};
}  // namespace execute

namespace collect {
struct Spec {
  std::int32_t kind;
  const char* fn = nullptr;
};
inline constexpr Spec none{TWK_COLLECT_NONE};
inline constexpr Spec mean{TWK_COLLECT_MEAN};
inline constexpr Spec sum{TWK_COLLECT_SUM};
inline constexpr Spec first{TWK_COLLECT_FIRST};
inline constexpr Spec last_pp{TWK_COLLECT_LAST_PP};
inline constexpr Spec flatten{TWK_COLLECT_FLATTEN};
// A function registered with TWINKLE_COLLECTOR(name, ...).
constexpr Spec custom(const char* name) { return {TWK_COLLECT_CUSTOM, name}; }
}  // namespace collect

// A per-call timeout for TWINKLE_METHOD, in seconds.
// A method whose calls may run again: when a worker of its group is lost before every answer
// came and the group restarts, the call is sent again (in submission order) once the group is
// back, up to `times` times, and its LazyCollect gets the result of that run. For methods that
// give the same result when run twice (sampling from fixed weights, evaluating); a call of a
// method without it fails with WorkerLost.
struct retry {
  int times = 1;
};

struct timeout {
  double seconds;
};

namespace detail {

// "{}" placeholders replaced by the arguments in order (values via repr()).
inline void format_into(std::ostringstream& out, std::string_view fmt) { out << fmt; }
template <class A, class... R>
void format_into(std::ostringstream& out, std::string_view fmt, A&& a, R&&... rest) {
  auto at = fmt.find("{}");
  if (at == std::string_view::npos) {
    out << fmt;
    return;
  }
  out << fmt.substr(0, at);
  if constexpr (std::is_same_v<std::decay_t<A>, Value>) {
    out << (a.is_string() ? a.template as<std::string>() : a.repr());
  } else {
    out << a;
  }
  format_into(out, fmt.substr(at + 2), std::forward<R>(rest)...);
}

template <class... A>
std::string format(std::string_view fmt, A&&... args) {
  std::ostringstream out;
  format_into(out, fmt, std::forward<A>(args)...);
  return out.str();
}

// "train.cpp" of "../src/train.cpp": call sites are reported by file name.
inline std::string base_name(const char* path) {
  std::string_view p(path ? path : "?");
  auto slash = p.find_last_of('/');
  return std::string(slash == std::string_view::npos ? p : p.substr(slash + 1));
}

// The one place that writes the call site into an error: "[twinkle driver caller: FILE:LINE] "
// (or "worker caller" for a call a worker method made to another group). The host's messages
// never carry it; every error of call(), create() and get() gets it here, so an error that went
// through a worker names both call sites: the driver's and the worker's.
inline std::string caller_prefix(const std::source_location& where, bool worker = false) {
  return std::string(worker ? "[twinkle worker caller: " : "[twinkle driver caller: ") +
         base_name(where.file_name()) + ":" + std::to_string(where.line()) + "] ";
}

// The key of a handle passed as an argument (Handle::ref, Context::handle).
inline constexpr const char* kHandleKey = "twinkle.instance";

inline void set_error(twk_sink_v1* sink, const char* message) {
  if (sink && sink->set_error) sink->set_error(sink->target, message);
}

inline void emit(twk_sink_v1* sink, const Value& v) {
  EncodedValue e = encode(v);
  if (sink && sink->set_value) sink->set_value(sink->target, e.view());
}

// Runs `f`, turning every exception into TWK_ERROR plus a message: nothing crosses the ABI.
template <class F>
std::int32_t guard(twk_sink_v1* err, F&& f) noexcept {
  try {
    f();
    return TWK_OK;
  } catch (const std::exception& e) {
    set_error(err, e.what());
  } catch (...) {
    set_error(err, "unknown exception (not derived from std::exception)");
  }
  return TWK_ERROR;
}

// Collects what a host function writes to a sink.
struct SinkTarget {
  std::optional<Value> value;
  std::string error;
  bool failed = false;

  twk_sink_v1 sink() {
    return twk_sink_v1{
        this,
        [](void* t, const twk_value_v1* v) { static_cast<SinkTarget*>(t)->value = decode(*v); },
        [](void* t, const char* m) {
          auto* s = static_cast<SinkTarget*>(t);
          s->failed = true;
          s->error = m ? m : "";
        }};
  }
};

}  // namespace detail

// A device mesh as the host describes it: named dims, per-rank coordinates, data ranks.
class Mesh {
 public:
  Mesh() = default;
  explicit Mesh(const twk_mesh_v1* m) : m_(m) {}

  bool valid() const { return m_ != nullptr; }
  int world_size() const { return m_ ? m_->world_size : 1; }
  int data_world() const { return m_ ? m_->data_world : 1; }
  int ep() const { return m_ ? m_->ep : 1; }
  std::vector<std::string> dims() const {
    std::vector<std::string> out;
    for (std::uint32_t i = 0; m_ && i < m_->ndims; ++i) out.emplace_back(m_->dim_names[i]);
    return out;
  }
  // Size of a dimension ("ep" included); 1 for one the mesh does not have.
  int size(std::string_view dim) const {
    if (dim == "ep") return ep();
    int i = index_of(dim);
    return i < 0 ? 1 : m_->dim_sizes[i];
  }
  // `rank`'s coordinate along `dim`; 0 for a dimension the mesh does not have.
  int coord(int rank, std::string_view dim) const {
    check(rank);
    if (dim == "ep") return data_rank(rank) % ep();
    int i = index_of(dim);
    return i < 0 ? 0 : m_->coords[static_cast<std::size_t>(rank) * m_->ndims + i];
  }
  int data_rank(int rank) const {
    check(rank);
    return m_ ? m_->data_ranks[rank] : 0;
  }

 private:
  int index_of(std::string_view dim) const {
    for (std::uint32_t i = 0; m_ && i < m_->ndims; ++i) {
      if (dim == m_->dim_names[i]) return static_cast<int>(i);
    }
    return -1;
  }
  void check(int rank) const {
    if (rank < 0 || rank >= world_size()) {
      throw ValueError("rank " + std::to_string(rank) + " is outside the mesh of " +
                       std::to_string(world_size()));
    }
  }
  const twk_mesh_v1* m_ = nullptr;
};

// A collective failed: a peer died or hung, a buffer was wrong, or no backend serves the device.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class ReduceOp : std::int32_t {
  sum = TWK_REDUCE_SUM,
  mean = TWK_REDUCE_MEAN,
  max = TWK_REDUCE_MAX,
  min = TWK_REDUCE_MIN,
};

// The communicator of a group (dim "") or of one of its mesh sub-groups ("dp", "tp", "pp", ...).
// Every member must make the same collective calls in the same order. Host memory for cpu
// groups, device memory for cuda groups. Blocking; throws CollectiveError.
class Communicator {
 public:
  Communicator(const twk_host_v1* host, void* host_ctx, std::string dim)
      : host_(host), host_ctx_(host_ctx), dim_(std::move(dim)) {}

  // This worker's rank in the communicator and its size.
  int rank() const { return info().first; }
  int size() const { return info().second; }
  const std::string& dim() const { return dim_; }

  void all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op = ReduceOp::sum) const {
    detail::SinkTarget t;
    twk_sink_v1 sink = t.sink();
    check(need(host_->all_reduce)(host_ctx_, dim_.c_str(), data, count,
                                  static_cast<std::int32_t>(dtype), static_cast<std::int32_t>(op),
                                  &sink),
          t, "all_reduce");
  }
  template <class T>
  void all_reduce(std::span<T> data, ReduceOp op = ReduceOp::sum) const {
    all_reduce(data.data(), data.size(), dtype_of<std::remove_const_t<T>>(), op);
  }
  void all_reduce(Tensor& t, ReduceOp op = ReduceOp::sum) const {
    all_reduce(t.mutable_data(), static_cast<std::size_t>(t.numel()), t.dtype(), op);
  }

  void broadcast(void* data, std::size_t count, DType dtype, int root = 0) const {
    detail::SinkTarget t;
    twk_sink_v1 sink = t.sink();
    check(need(host_->broadcast)(host_ctx_, dim_.c_str(), data, count,
                                 static_cast<std::int32_t>(dtype), root, &sink),
          t, "broadcast");
  }
  template <class T>
  void broadcast(std::span<T> data, int root = 0) const {
    broadcast(data.data(), data.size(), dtype_of<T>(), root);
  }
  void broadcast(Tensor& t, int root = 0) const {
    broadcast(t.mutable_data(), static_cast<std::size_t>(t.numel()), t.dtype(), root);
  }

  // out holds in.size() x size() elements, rank r's part at r x in.size().
  void all_gather(const void* in, void* out, std::size_t count, DType dtype) const {
    detail::SinkTarget t;
    twk_sink_v1 sink = t.sink();
    check(need(host_->all_gather)(host_ctx_, dim_.c_str(), in, out, count,
                                  static_cast<std::int32_t>(dtype), &sink),
          t, "all_gather");
  }
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) const {
    if (out.size() != in.size() * static_cast<std::size_t>(size())) {
      throw CollectiveError("all_gather: out has " + std::to_string(out.size()) +
                            " elements, needs " +
                            std::to_string(in.size() * static_cast<std::size_t>(size())));
    }
    all_gather(in.data(), out.data(), in.size(), dtype_of<T>());
  }
  // The tensors of all ranks concatenated along dim 0.
  Tensor all_gather(const Tensor& in) const {
    std::vector<std::int64_t> shape = in.shape();
    if (shape.empty()) shape = {1};
    shape[0] *= size();
    Tensor out(in.dtype(), shape);
    all_gather(in.data(), out.mutable_data(), static_cast<std::size_t>(in.numel()), in.dtype());
    return out;
  }

  // in holds out.size() x size() elements; out receives the reduction of part rank().
  void reduce_scatter(const void* in, void* out, std::size_t count, DType dtype,
                      ReduceOp op = ReduceOp::sum) const {
    detail::SinkTarget t;
    twk_sink_v1 sink = t.sink();
    check(need(host_->reduce_scatter)(host_ctx_, dim_.c_str(), in, out, count,
                                      static_cast<std::int32_t>(dtype),
                                      static_cast<std::int32_t>(op), &sink),
          t, "reduce_scatter");
  }
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::sum) const {
    if (in.size() != out.size() * static_cast<std::size_t>(size())) {
      throw CollectiveError("reduce_scatter: in has " + std::to_string(in.size()) +
                            " elements, needs " +
                            std::to_string(out.size() * static_cast<std::size_t>(size())));
    }
    reduce_scatter(in.data(), out.data(), out.size(), dtype_of<T>(), op);
  }

  void barrier() const {
    detail::SinkTarget t;
    twk_sink_v1 sink = t.sink();
    check(need(host_->barrier)(host_ctx_, dim_.c_str(), &sink), t, "barrier");
  }

 private:
  template <class Fn>
  Fn need(Fn fn) const {
    if (!host_ || host_->size < offsetof(twk_host_v1, barrier) + sizeof(void*) || !fn) {
      throw CollectiveError("collectives are available in workers only (not in the driver entry)");
    }
    return fn;
  }
  void check(std::int32_t rc, const detail::SinkTarget& t, const char* op) const {
    if (rc != TWK_OK) throw CollectiveError(std::string(op) + ": " + t.error);
  }
  std::pair<int, int> info() const {
    if (!cached_) {
      detail::SinkTarget t;
      twk_sink_v1 sink = t.sink();
      std::int32_t r = 0, n = 0;
      check(need(host_->comm_info)(host_ctx_, dim_.c_str(), &r, &n, &sink), t, "communicator");
      cached_ = {r, n};
    }
    return *cached_;
  }

  const twk_host_v1* host_;
  void* host_ctx_;
  std::string dim_;
  mutable std::optional<std::pair<int, int>> cached_;
};

class Handle;
struct GroupRef;

// Where a constructor or method runs: rank, group, mesh, job args, log. Valid for the duration of
// the call it is passed to; do not keep it.
class Context {
 public:
  Context(const twk_host_v1* host, const twk_context_v1* ctx)
      : host_(host), ctx_(ctx), mesh_(ctx->mesh) {}

  int rank() const { return ctx_->rank; }
  int world_size() const { return ctx_->world_size; }
  int local_rank() const { return ctx_->local_rank; }
  int local_world_size() const { return ctx_->local_world_size; }
  std::string_view job() const { return ctx_->job ? ctx_->job : ""; }
  std::string_view group() const { return ctx_->group ? ctx_->group : ""; }
  std::string_view device() const { return ctx_->device ? ctx_->device : "cpu"; }
  const Mesh& mesh() const { return mesh_; }
  // This rank's coordinate and the size along a mesh dimension ("dp", "tp", "ep", ...).
  int rank_in(std::string_view dim) const { return mesh_.coord(rank(), dim); }
  int size_of(std::string_view dim) const { return mesh_.size(dim); }
  int data_rank() const { return mesh_.data_rank(rank()); }
  int data_world() const { return mesh_.data_world(); }

  // The job's [args].
  const Value& args() const {
    if (!args_) args_ = ctx_->args ? decode(*ctx_->args) : Value::map();
    return *args_;
  }

  // "{}" placeholders, e.g. ctx.log("step {} loss {}", step, loss).
  template <class... A>
  void log(std::string_view fmt, A&&... args) const {
    log_at(TWK_LOG_INFO, detail::format(fmt, std::forward<A>(args)...));
  }
  void log_at(std::int32_t level, const std::string& message) const {
    if (host_ && host_->log) host_->log(ctx_->host_ctx, level, message.c_str());
  }

  // The group's communicator (dim "") or a mesh sub-group's ("dp", "tp", "pp", "ep", ...).
  Communicator comm(std::string_view dim = "") const {
    return Communicator(host_, ctx_->host_ctx, std::string(dim));
  }

  // Calls between groups (twinkle-plugin(7), CALLS BETWEEN GROUPS). Constructs `cls` on the workers
  // of another group (a class with execute = peer: only on this rank's peer block of it) and waits
  // until all are built; its handle calls them straight from this worker.
  template <class... A>
  Handle create(std::string_view cls, GroupRef group, A&&... args) const;
  template <class Cls, class... A>
  Handle create(GroupRef group, A&&... args) const;
  // The handle of an instance made elsewhere, passed to this method as an argument
  // (`handle.ref()` where it was made).
  Handle handle(const Value& ref,
                std::source_location where = std::source_location::current()) const;

  const twk_host_v1* host() const { return host_; }
  const twk_context_v1* raw() const { return ctx_; }

 private:
  const twk_host_v1* host_;
  const twk_context_v1* ctx_;
  Mesh mesh_;
  mutable std::optional<Value> args_;
};

// The result of a remote call, available at once; get() blocks until the workers answered and
// their results were collected, and throws RemoteError if the call failed. Move-only.
class LazyCollect {
 public:
  LazyCollect(const twk_host_v1* host, void* host_ctx, std::uint64_t future,
              std::source_location where = std::source_location::current(), bool worker = false)
      : host_(host), host_ctx_(host_ctx), future_(future), where_(where), worker_(worker) {}
  LazyCollect(LazyCollect&& o) noexcept { *this = std::move(o); }
  LazyCollect& operator=(LazyCollect&& o) noexcept {
    if (this != &o) {
      drop();
      host_ = o.host_;
      host_ctx_ = o.host_ctx_;
      future_ = std::exchange(o.future_, 0);
      where_ = o.where_;
      worker_ = o.worker_;
      result_ = std::move(o.result_);
      error_ = std::move(o.error_);
    }
    return *this;
  }
  LazyCollect(const LazyCollect&) = delete;
  LazyCollect& operator=(const LazyCollect&) = delete;
  ~LazyCollect() { drop(); }

  // On a temporary (`for (auto& r : h.call(...).get())`), the result is moved out, so that it
  // outlives the LazyCollect.
  Value get() && { return std::move(const_cast<Value&>(resolve())); }
  const Value& get() & { return resolve(); }
  const Value& operator()() { return get(); }
  const Value* operator->() { return &get(); }
  const Value& operator[](std::string_view key) { return get()[key]; }
  template <class I>
  requires std::is_integral_v<I>
  const Value& operator[](I i) { return get()[i]; }
  std::size_t size() { return get().size(); }
  Value::List::const_iterator begin() { return get().begin(); }
  Value::List::const_iterator end() { return get().end(); }

 private:
  const Value& resolve() {
    if (future_) {
      detail::SinkTarget t;
      twk_sink_v1 sink = t.sink();
      std::uint64_t f = std::exchange(future_, 0);
      if (host_->wait(host_ctx_, f, &sink) != TWK_OK || t.failed) {
        error_ = t.error.empty() ? "remote call failed" : t.error;
      } else {
        result_ = t.value ? std::move(*t.value) : Value();
      }
    }
    if (error_) detail::throw_remote(detail::caller_prefix(where_, worker_), *error_);
    return *result_;
  }
  void drop() noexcept {
    if (future_ && host_ && host_->release) host_->release(host_ctx_, future_);
    future_ = 0;
  }
  const twk_host_v1* host_ = nullptr;
  void* host_ctx_ = nullptr;
  std::uint64_t future_ = 0;
  std::source_location where_;  // the call() that started it
  bool worker_ = false;         // started by a worker method, not the driver
  std::optional<Value> result_;
  std::optional<std::string> error_;
};

// A method name plus the call site that names it, captured where call() is written.
struct MethodRef {
  std::string_view name;
  std::source_location where;
  MethodRef(const char* n, std::source_location w = std::source_location::current())
      : name(n), where(w) {}
  MethodRef(std::string_view n, std::source_location w = std::source_location::current())
      : name(n), where(w) {}
  MethodRef(const std::string& n, std::source_location w = std::source_location::current())
      : name(n), where(w) {}
};

// One instance of a class on every worker of a group (or on a peer block of it). Copyable: a copy
// calls the same instance.
class Handle {
 public:
  Handle(const twk_host_v1* host, void* host_ctx, std::uint64_t id, std::string cls,
         std::string group = "", bool worker = false)
      : host_(host),
        host_ctx_(host_ctx),
        id_(id),
        cls_(std::move(cls)),
        group_(std::move(group)),
        worker_(worker) {}

  // Starts the method on the group's workers and returns at once.
  template <class... A>
  LazyCollect call(MethodRef method, A&&... args) const {
    EncodedValue e = encode(Value::list({Value(std::forward<A>(args))...}));
    detail::SinkTarget t;
    twk_sink_v1 sink = t.sink();
    std::uint64_t future = 0;
    const std::string name(method.name);
    if (!host_->call) {
      throw RemoteError(detail::caller_prefix(method.where, worker_) +
                        "this twinkle runs calls from driver entries only; upgrade it for calls "
                        "between groups");
    }
    if (host_->call(host_ctx_, id_, name.c_str(), e.view(), method.where.file_name(),
                    method.where.line(), &future, &sink) != TWK_OK) {
      detail::throw_remote(detail::caller_prefix(method.where, worker_), t.error);
    }
    return LazyCollect(host_, host_ctx_, future, method.where, worker_);
  }

  // What to pass as an argument so that a worker method can call this instance
  // (ctx.handle(ref) there): a map {"twinkle.instance": id, "class": ..., "group": ...}.
  Value ref() const {
    return Value::map(
        {{detail::kHandleKey, static_cast<std::int64_t>(id_)}, {"class", cls_}, {"group", group_}});
  }
  operator Value() const { return ref(); }

  const std::string& class_name() const { return cls_; }
  const std::string& group() const { return group_; }

 private:
  const twk_host_v1* host_;
  void* host_ctx_;
  std::uint64_t id_;
  std::string cls_;
  std::string group_;
  bool worker_;
};

namespace detail {
template <class Cls>
struct ClassName;  // specialised by TWINKLE_CLASS
}  // namespace detail

// A group name plus the call site that names it, captured where create() is written.
struct GroupRef {
  std::string_view name;
  std::source_location where;
  GroupRef(const char* n, std::source_location w = std::source_location::current())
      : name(n), where(w) {}
  GroupRef(std::string_view n, std::source_location w = std::source_location::current())
      : name(n), where(w) {}
  GroupRef(const std::string& n, std::source_location w = std::source_location::current())
      : name(n), where(w) {}
};

// One group's part of a communicator across groups: `ranks` are worker indices in the group
// (empty: all of its workers).
struct CommMember {
  std::string group;
  std::vector<int> ranks = {};
};

// What a driver entry gets: create class instances on groups, the job's args, log.
class Driver {
 public:
  Driver(const twk_host_v1* host, const twk_context_v1* ctx) : host_(host), ctx_(ctx) {}

  // Constructs `cls` on every worker of `group` and waits until all are built; extra arguments go
  // to its constructor as a list. Throws RemoteError if a constructor fails.
  template <class... A>
  Handle create(std::string_view cls, GroupRef group, A&&... args) const {
    EncodedValue e = encode(Value::list({Value(std::forward<A>(args))...}));
    detail::SinkTarget t;
    twk_sink_v1 sink = t.sink();
    std::uint64_t id = 0;
    const std::string c(cls), g(group.name);
    if (host_->create(ctx_->host_ctx, c.c_str(), g.c_str(), e.view(), &id, &sink) != TWK_OK)
      detail::throw_remote(detail::caller_prefix(group.where), t.error);
    return Handle(host_, ctx_->host_ctx, id, c, g);
  }
  template <class Cls, class... A>
  Handle create(GroupRef group, A&&... args) const {
    return create(detail::ClassName<Cls>::value, group, std::forward<A>(args)...);
  }

  // Declares the communicator `name` across groups (e.g. weight sync from the trainer's rank 0 to
  // every sampler worker): its members, in rank order, reach it in their methods as
  // ctx.comm(name). The backend fits the devices (shared memory or Gloo for cpu, NCCL for cuda).
  // The first collective on it waits up to `timeout_s` (0: the job's timeout_s) for every member
  // and fails naming those that never joined.
  void communicator(std::string_view name, const std::vector<CommMember>& members,
                    double timeout_s = 0,
                    std::source_location where = std::source_location::current()) const {
    if (host_->size < offsetof(twk_host_v1, comm_create) + sizeof(void*) || !host_->comm_create) {
      throw RemoteError(detail::caller_prefix(where) +
                        "this twinkle is older than the SDK: it has no communicators across "
                        "groups");
    }
    Value list = Value::list();
    for (const auto& m : members) {
      Value ranks = Value::list();
      for (int r : m.ranks) ranks.push_back(r);
      list.push_back(Value::list({Value(m.group), ranks}));
    }
    EncodedValue e = encode(list);
    detail::SinkTarget t;
    twk_sink_v1 sink = t.sink();
    const std::string n(name);
    if (host_->comm_create(ctx_->host_ctx, n.c_str(), e.view(), timeout_s, &sink) != TWK_OK)
      throw RemoteError(detail::caller_prefix(where) + t.error);
  }

  // Checkpoints (twinkle-plugin(7), STATE AND CHECKPOINTS): every instance whose class declares
  // TWINKLE_STATE saves its state, each worker writes its part in parallel, and the checkpoint
  // of `step` (with `meta`, a value without tensors) is published whole or not at all. Returns
  // false when the job has no [job] checkpoint_dir (nothing was saved); throws RemoteError when a
  // worker could not save or write its part (the newest complete checkpoint stays as it was).
  bool checkpoint(std::int64_t step, const Value& meta = Value::map(),
                  std::source_location where = std::source_location::current()) const {
    if (!has_state_calls()) {
      throw RemoteError(detail::caller_prefix(where) +
                        "this twinkle is older than the SDK: it has no checkpoints");
    }
    EncodedValue e = encode(meta);
    detail::SinkTarget t;
    twk_sink_v1 sink = t.sink();
    std::int32_t saved = 0;
    if (host_->checkpoint(ctx_->host_ctx, step, e.view(), &saved, &sink) != TWK_OK)
      detail::throw_remote(detail::caller_prefix(where), t.error);
    return saved != 0;
  }

  // The checkpoint this run resumed from (`twinkle run --resume`, [job] resume = "auto"): its
  // step and meta; the instances already have their state back. Empty when the run started
  // fresh.
  struct Resumed {
    std::int64_t step = 0;
    Value meta;
  };
  std::optional<Resumed> resumed() const {
    if (!has_state_calls()) return std::nullopt;
    detail::SinkTarget t;
    twk_sink_v1 sink = t.sink();
    if (host_->resumed(ctx_->host_ctx, &sink) != TWK_OK) throw RemoteError(t.error);
    if (!t.value || t.value->is_null()) return std::nullopt;
    return Resumed{(*t.value)["step"].as<std::int64_t>(), (*t.value)["meta"]};
  }

  // True once the run was asked to stop (SIGTERM or SIGUSR1 to `twinkle run`, e.g. a Slurm
  // preemption, in a job with a checkpoint_dir): checkpoint and return within [job]
  // stop_grace_s; the run then exits with 75 and `twinkle run --resume` continues it.
  bool stop_requested() const { return has_state_calls() && host_->stop_requested(ctx_->host_ctx); }

  std::string_view job() const { return ctx_->job ? ctx_->job : ""; }
  // The folder of the job file: relative paths in [args] are meant from there.
  std::string job_dir() const {
    if (ctx_->size < offsetof(twk_context_v1, job_dir) + sizeof(char*) || !ctx_->job_dir)
      return ".";
    return ctx_->job_dir;
  }
  // `path` as written in the job file, resolved against job_dir() when relative.
  std::string job_path(std::string_view path) const {
    if (!path.empty() && path.front() == '/') return std::string(path);
    return job_dir() + "/" + std::string(path);
  }
  const Value& args() const {
    if (!args_) args_ = ctx_->args ? decode(*ctx_->args) : Value::map();
    return *args_;
  }
  template <class... A>
  void log(std::string_view fmt, A&&... args) const {
    std::string m = detail::format(fmt, std::forward<A>(args)...);
    if (host_->log) host_->log(ctx_->host_ctx, TWK_LOG_INFO, m.c_str());
  }

 private:
  const twk_host_v1* host_;
  const twk_context_v1* ctx_;
  mutable std::optional<Value> args_;

  bool has_state_calls() const {
    return host_->size >= offsetof(twk_host_v1, stop_requested) + sizeof(void*) &&
           host_->checkpoint && host_->resumed && host_->stop_requested;
  }
};

template <class... A>
Handle Context::create(std::string_view cls, GroupRef group, A&&... args) const {
  if (host_->size < offsetof(twk_host_v1, attach) + sizeof(void*) || !host_->create) {
    throw RemoteError(detail::caller_prefix(group.where, true) +
                      "this twinkle runs calls from driver entries only; upgrade it for calls "
                      "between groups");
  }
  EncodedValue e = encode(Value::list({Value(std::forward<A>(args))...}));
  detail::SinkTarget t;
  twk_sink_v1 sink = t.sink();
  std::uint64_t id = 0;
  const std::string c(cls), g(group.name);
  if (host_->create(ctx_->host_ctx, c.c_str(), g.c_str(), e.view(), &id, &sink) != TWK_OK)
    detail::throw_remote(detail::caller_prefix(group.where, true), t.error);
  return Handle(host_, ctx_->host_ctx, id, c, g, true);
}

template <class Cls, class... A>
Handle Context::create(GroupRef group, A&&... args) const {
  return create(detail::ClassName<Cls>::value, group, std::forward<A>(args)...);
}

inline Handle Context::handle(const Value& ref, std::source_location where) const {
  const std::string prefix = detail::caller_prefix(where, true);
  if (!ref.is_map() || !ref.contains(detail::kHandleKey) || !ref.contains("class") ||
      !ref.contains("group")) {
    throw RemoteError(prefix +
                      "ctx.handle: the argument is not a handle; pass handle.ref() (or the "
                      "handle itself) where the instance was made");
  }
  if (host_->size < offsetof(twk_host_v1, attach) + sizeof(void*) || !host_->attach) {
    throw RemoteError(prefix +
                      "this twinkle runs calls from driver entries only; upgrade it for calls "
                      "between groups");
  }
  const auto id = static_cast<std::uint64_t>(ref[detail::kHandleKey].as<std::int64_t>());
  const std::string cls = ref["class"].as<std::string>(), group = ref["group"].as<std::string>();
  detail::SinkTarget t;
  twk_sink_v1 sink = t.sink();
  if (host_->attach(ctx_->host_ctx, cls.c_str(), group.c_str(), id, &sink) != TWK_OK)
    throw RemoteError(prefix + t.error);
  return Handle(host_, ctx_->host_ctx, id, cls, group, true);
}

namespace detail {

struct MethodEntry {
  std::string name;
  dispatch::Spec dispatch{TWK_DISPATCH_ALL};
  collect::Spec collect{TWK_COLLECT_NONE};
  std::int32_t execute = TWK_EXECUTE_CLASS;
  double timeout_s = 0;
  twk_invoke_fn invoke = nullptr;
  std::int32_t retries = 0;
};

struct ClassEntry {
  std::string name;
  std::int32_t execute = TWK_EXECUTE_ALL;
  twk_construct_fn construct = nullptr;
  twk_destruct_fn destruct = nullptr;
  twk_save_fn save = nullptr;
  twk_load_fn load = nullptr;
  std::vector<MethodEntry> methods;
};

// Everything the registration macros declare, turned into the C tables on first request.
struct Registry {
  std::vector<ClassEntry> classes;
  std::vector<twk_driver_v1> drivers;
  std::vector<twk_dispatcher_v1> dispatchers;
  std::vector<twk_collector_v1> collectors;
  std::vector<std::string> names;  // keeps driver/dispatcher/collector names alive

  std::vector<twk_class_v1> c_classes;
  std::vector<std::vector<twk_method_v1>> c_methods;
  twk_plugin_v1 table{};
  bool built = false;

  ClassEntry& class_named(const std::string& name) {
    for (auto& c : classes) {
      if (c.name == name) return c;
    }
    classes.emplace_back().name = name;
    return classes.back();
  }

  const twk_plugin_v1* build(const char* name, const char* version) {
    if (built) return &table;
    c_methods.resize(classes.size());
    for (std::size_t i = 0; i < classes.size(); ++i) {
      for (const auto& m : classes[i].methods) {
        c_methods[i].push_back(twk_method_v1{sizeof(twk_method_v1), m.name.c_str(), m.dispatch.kind,
                                             m.execute, m.collect.kind, m.timeout_s, m.dispatch.fn,
                                             m.collect.fn, m.invoke, m.retries});
      }
      const auto& c = classes[i];
      c_classes.push_back(twk_class_v1{
          sizeof(twk_class_v1), c.name.c_str(), c.execute, c.construct, c.destruct,
          c_methods[i].data(), static_cast<std::uint32_t>(c_methods[i].size()), c.save, c.load});
    }
    table = twk_plugin_v1{TWK_ABI_VERSION,
                          sizeof(twk_plugin_v1),
                          name,
                          version,
                          c_classes.data(),
                          static_cast<std::uint32_t>(c_classes.size()),
                          drivers.data(),
                          static_cast<std::uint32_t>(drivers.size()),
                          dispatchers.data(),
                          static_cast<std::uint32_t>(dispatchers.size()),
                          collectors.data(),
                          static_cast<std::uint32_t>(collectors.size())};
    built = true;
    return &table;
  }
};

inline Registry& registry() {
  static Registry r;
  return r;
}

template <class T>
struct member_fn;
template <class C, class R, class... A>
struct member_fn<R (C::*)(Context&, A...)> {
  using ret = R;
  static constexpr std::size_t arity = sizeof...(A);
  using args = std::tuple<std::decay_t<A>...>;
};
template <class C, class R, class... A>
struct member_fn<R (C::*)(Context&, A...) const> : member_fn<R (C::*)(Context&, A...)> {};

template <class Cls, auto M, std::size_t... I>
Value call_member(Cls& obj, Context& ctx, const Value& args, std::index_sequence<I...>) {
  using traits = member_fn<decltype(M)>;
  using R = typename traits::ret;
  if constexpr (std::is_void_v<R>) {
    (obj.*M)(ctx, args[I].template as<std::tuple_element_t<I, typename traits::args>>()...);
    return Value();
  } else {
    return Value(
        (obj.*M)(ctx, args[I].template as<std::tuple_element_t<I, typename traits::args>>()...));
  }
}

template <class Cls, auto M>
std::int32_t invoke(void* self, const twk_host_v1* host, const twk_context_v1* ctx,
                    const twk_value_v1* args, twk_sink_v1* out) {
  return guard(out, [&] {
    using traits = member_fn<decltype(M)>;
    Context c(host, ctx);
    Value list = decode(*args);
    if (!list.is_list() || list.size() != traits::arity) {
      throw ValueError("takes " + std::to_string(traits::arity) + " argument(s), got " +
                       std::to_string(list.is_list() ? list.size() : 1));
    }
    emit(out, call_member<Cls, M>(*static_cast<Cls*>(self), c, list,
                                  std::make_index_sequence<traits::arity>{}));
  });
}

template <class Cls>
std::int32_t construct(const twk_host_v1* host, const twk_context_v1* ctx, const twk_value_v1* args,
                       void** self, twk_sink_v1* err) {
  return guard(err, [&] {
    Context c(host, ctx);
    Value a = args ? decode(*args) : Value::list();
    std::unique_ptr<Cls> obj;
    if constexpr (std::is_constructible_v<Cls, Context&, const Value&>) {
      obj = std::make_unique<Cls>(c, a);
    } else if constexpr (std::is_constructible_v<Cls, Context&>) {
      obj = std::make_unique<Cls>(c);
    } else {
      obj = std::make_unique<Cls>();
    }
    *self = obj.release();
  });
}

template <class Cls>
void destruct(void* self) {
  std::unique_ptr<Cls> owned(static_cast<Cls*>(self));
}

struct ClassRegistrar {
  ClassRegistrar(const char* name, execute::Spec e, twk_construct_fn c, twk_destruct_fn d) {
    auto& r = registry();
    ClassEntry* entry = &r.class_named(name);
    if (entry->construct) {  // declared twice: keep both so that the loader reports it
      entry = &r.classes.emplace_back();
      entry->name = name;
    }
    entry->execute = e.kind;
    entry->construct = c;
    entry->destruct = d;
  }
};

template <class Cls, auto Save>
std::int32_t save_state(void* self, const twk_host_v1* host, const twk_context_v1* ctx,
                        twk_sink_v1* out) {
  return guard(out, [&] {
    Context c(host, ctx);
    emit(out, Value((static_cast<Cls*>(self)->*Save)(c)));
  });
}

template <class Cls, auto Load>
std::int32_t load_state(void* self, const twk_host_v1* host, const twk_context_v1* ctx,
                        const twk_value_v1* state, twk_sink_v1* err) {
  return guard(err, [&] {
    Context c(host, ctx);
    (static_cast<Cls*>(self)->*Load)(c, decode(*state));
  });
}

struct StateRegistrar {
  StateRegistrar(const char* cls, twk_save_fn s, twk_load_fn l) {
    ClassEntry& entry = registry().class_named(cls);
    entry.save = s;
    entry.load = l;
  }
};

inline void apply_option(MethodEntry& m, execute::Spec e) { m.execute = e.kind; }
inline void apply_option(MethodEntry& m, timeout t) { m.timeout_s = t.seconds; }
inline void apply_option(MethodEntry& m, retry r) { m.retries = r.times; }

struct MethodRegistrar {
  template <class... Options>
  MethodRegistrar(const char* cls, const char* name, twk_invoke_fn fn, dispatch::Spec d,
                  collect::Spec c, Options... options) {
    MethodEntry m;
    m.name = name;
    m.dispatch = d;
    m.collect = c;
    m.invoke = fn;
    (apply_option(m, options), ...);
    registry().class_named(cls).methods.push_back(std::move(m));
  }
};

struct DriverRegistrar {
  DriverRegistrar(const char* name, twk_driver_fn fn) { registry().drivers.push_back({name, fn}); }
};
struct DispatcherRegistrar {
  DispatcherRegistrar(const char* name, twk_dispatch_fn fn) {
    registry().dispatchers.push_back({name, fn});
  }
};
struct CollectorRegistrar {
  CollectorRegistrar(const char* name, twk_collect_fn fn) {
    registry().collectors.push_back({name, fn});
  }
};

}  // namespace detail
}  // namespace twinkle

#define TWK_CAT_(a, b) a##b
#define TWK_CAT(a, b) TWK_CAT_(a, b)

// Declares a class whose instances live on the workers of a group.
#define TWINKLE_CLASS(Cls, execute_spec)                             \
  template <>                                                        \
  struct twinkle::detail::ClassName<Cls> {                           \
    static constexpr const char* value = #Cls;                       \
  };                                                                 \
  static ::twinkle::detail::ClassRegistrar TWK_CAT(twk_class_, Cls)( \
      #Cls, execute_spec, &::twinkle::detail::construct<Cls>, &::twinkle::detail::destruct<Cls>)

// Declares a remote method: TWINKLE_METHOD(Cls, method, dispatch, collect[, execute][, timeout]).
// The method's signature is R method(twinkle::Context&, A1, A2, ...) where each A converts from a
// Value with as<A>() and R converts to a Value (void gives null).
#define TWINKLE_METHOD(Cls, method, ...)                                                   \
  static ::twinkle::detail::MethodRegistrar TWK_CAT(TWK_CAT(twk_method_, Cls), _##method)( \
      #Cls, #method, &::twinkle::detail::invoke<Cls, &Cls::method>, __VA_ARGS__)

// Declares a class's state for checkpoints and recovery: TWINKLE_STATE(Cls, save, load) with
// `twinkle::Value Cls::save(twinkle::Context&)` (a map of tensors and numbers) and
// `void Cls::load(twinkle::Context&, const twinkle::Value&)`, which gets what save returned,
// right after the constructor ran. The runtime writes and reads the files.
#define TWINKLE_STATE(Cls, save, load)                               \
  static ::twinkle::detail::StateRegistrar TWK_CAT(twk_state_, Cls)( \
      #Cls, &::twinkle::detail::save_state<Cls, &Cls::save>,         \
      &::twinkle::detail::load_state<Cls, &Cls::load>)

// Declares a driver entry: TWINKLE_DRIVER(main, twinkle::Driver& d) { ... }
#define TWINKLE_DRIVER(name, param)                                                               \
  static void twk_driver_body_##name(param);                                                      \
  static std::int32_t twk_driver_entry_##name(const twk_host_v1* host, const twk_context_v1* ctx, \
                                              twk_sink_v1* err) {                                 \
    return ::twinkle::detail::guard(err, [&] {                                                    \
      ::twinkle::Driver driver(host, ctx);                                                        \
      twk_driver_body_##name(driver);                                                             \
    });                                                                                           \
  }                                                                                               \
  static ::twinkle::detail::DriverRegistrar twk_driver_reg_##name(#name,                          \
                                                                  &twk_driver_entry_##name);      \
  static void twk_driver_body_##name(param)

// Declares a custom dispatch: TWINKLE_DISPATCHER(name, int n, int index, const twinkle::Mesh& mesh,
// const twinkle::Value& args) { return args_for_worker_index; }
#define TWINKLE_DISPATCHER(name, n_param, index_param, mesh_param, args_param)                    \
  static ::twinkle::Value twk_dispatch_body_##name(n_param, index_param, mesh_param, args_param); \
  static std::int32_t twk_dispatch_entry_##name(std::int32_t n, std::int32_t i,                   \
                                                const twk_mesh_v1* m, const twk_value_v1* a,      \
                                                twk_sink_v1* out) {                               \
    return ::twinkle::detail::guard(out, [&] {                                                    \
      ::twinkle::detail::emit(                                                                    \
          out, twk_dispatch_body_##name(n, i, ::twinkle::Mesh(m), ::twinkle::decode(*a)));        \
    });                                                                                           \
  }                                                                                               \
  static ::twinkle::detail::DispatcherRegistrar twk_dispatch_reg_##name(                          \
      #name, &twk_dispatch_entry_##name);                                                         \
  static ::twinkle::Value twk_dispatch_body_##name(n_param, index_param, mesh_param, args_param)

// Declares a custom collect: TWINKLE_COLLECTOR(name, const std::vector<twinkle::Value>& results,
// const twinkle::Mesh& mesh) { return combined; }
#define TWINKLE_COLLECTOR(name, results_param, mesh_param)                                        \
  static ::twinkle::Value twk_collect_body_##name(results_param, mesh_param);                     \
  static std::int32_t twk_collect_entry_##name(const twk_value_v1* r, std::uint32_t n,            \
                                               const twk_mesh_v1* m, twk_sink_v1* out) {          \
    return ::twinkle::detail::guard(out, [&] {                                                    \
      std::vector<::twinkle::Value> results;                                                      \
      for (std::uint32_t i = 0; i < n; ++i) results.push_back(::twinkle::decode(r[i]));           \
      ::twinkle::detail::emit(out, twk_collect_body_##name(results, ::twinkle::Mesh(m)));         \
    });                                                                                           \
  }                                                                                               \
  static ::twinkle::detail::CollectorRegistrar twk_collect_reg_##name(#name,                      \
                                                                      &twk_collect_entry_##name); \
  static ::twinkle::Value twk_collect_body_##name(results_param, mesh_param)

// Names the plugin and exports its entry symbol. Exactly once per plugin.
#define TWINKLE_PLUGIN(name, version)                                                              \
  extern "C" __attribute__((visibility("default"))) const twk_plugin_v1* twinkle_plugin_v1(void) { \
    return ::twinkle::detail::registry().build(name, version);                                     \
  }                                                                                                \
  static_assert(true, "")
