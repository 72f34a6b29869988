#include "core/runtime/instances.hpp"

#include <atomic>
#include <exception>
#include <filesystem>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "core/runtime/host_abi.hpp"

namespace twinkle::core {

namespace proto = transport::proto;

struct SharedArgs {
  EncodedValue encoded;
  std::atomic<int> refs{1};
  static void retain(void* p) { ++static_cast<SharedArgs*>(p)->refs; }
  static void release(void* p) {
    auto* s = static_cast<SharedArgs*>(p);
    if (--s->refs == 0) delete s;
  }
};

Shared share(EncodedValue v) {
  auto* s = new SharedArgs;
  s->encoded = std::move(v);
  Shared out{{s, [](SharedArgs* p) { SharedArgs::release(p); }}, {}};
  out.view = *s->encoded.view();
  out.view.owner = s;
  out.view.retain = &SharedArgs::retain;
  out.view.release = &SharedArgs::release;
  return out;
}

void Instances::resume_from(std::int64_t step, std::optional<checkpoint::Part> part,
                            std::string error) {
  resume_step_ = step;
  resume_ = std::move(part);
  resume_error_ = std::move(error);
}

proto::Created Instances::create(proto::Create& m, std::uint64_t id, const std::string& from) {
  const plugins::ClassInfo* cls = plugin_.find_class(m.cls);
  if (!cls) return proto::Created{"the worker's plugin has no class " + m.cls};
  Shared args = share(std::move(m.args));
  twk_context_v1 ctx = context_();
  SinkCapture err;
  twk_sink_v1 sink = err.sink();
  void* self = nullptr;
  if (cls->construct(&host_, &ctx, &args.view, &self, &sink) != TWK_OK)
    return proto::Created{err.error.value_or("constructor failed")};
  // The state's key: who made it, the class, and how many of those it made here before, so
  // that the same driver code finds the same state again.
  const std::string maker = m.maker ? *m.maker : from.empty() ? "driver" : from;
  const std::string key =
      fmt::format("{}/{}/{}", maker, cls->name, made_[maker + "/" + cls->name]++);
  if (auto restored = restore(*cls, self, key)) {
    cls->destruct(self);
    return proto::Created{std::move(restored)};
  }
  instances_[id] = Instance{cls, self, key};
  order_.push_back(id);
  return proto::Created{};
}

// Loads the checkpoint's state into a new instance; the error when it failed.
std::optional<std::string> Instances::restore(const plugins::ClassInfo& cls, void* self,
                                              const std::string& key) {
  if (!cls.load || (!resume_ && resume_error_.empty())) return std::nullopt;
  const std::string what =
      fmt::format("restoring {}'s state from the checkpoint of step {}", cls.name, resume_step_);
  if (!resume_error_.empty()) return fmt::format("{}: {}", what, resume_error_);
  try {
    EncodedValue* state = resume_->state(key, cls.name);
    if (!state) return std::nullopt;  // made after that checkpoint: it starts fresh
    twk_context_v1 ctx = context_();
    SinkCapture err;
    twk_sink_v1 sink = err.sink();
    if (cls.load(self, &host_, &ctx, state->view(), &sink) != TWK_OK)
      return fmt::format("{}: {}", what, err.error.value_or("load failed without a message"));
  } catch (const std::exception& e) {
    return fmt::format("{}: {}", what, e.what());
  }
  return std::nullopt;
}

proto::Reply Instances::call(proto::Call& m, const Adopt& adopt) {
  auto it = instances_.find(m.instance);
  if (it == instances_.end()) return proto::Reply{"no such instance on this worker", {}};
  const plugins::MethodInfo* mi = it->second.cls->find_method(m.method);
  if (!mi)
    return proto::Reply{"class " + it->second.cls->name + " has no remote method " + m.method, {}};

  // Moved out of the message so that the arguments die with `args.hold` (below), before the
  // reply.
  Shared args = share(std::move(m.args));
  twk_context_v1 ctx = context_();
  EncodedSinkCapture out;
  out.adopt = adopt;
  twk_sink_v1 sink = out.sink();
  std::int32_t rc = mi->invoke(it->second.self, &host_, &ctx, &args.view, &sink);
  // Shared-memory arguments the plugin did not keep are released now, so that the reply can
  // tell the driver it may reuse them.
  args.hold.reset();
  if (rc != TWK_OK || out.error)
    return proto::Reply{out.error.value_or("the method failed without a message"), {}};
  if (!out.value) return proto::Reply{std::nullopt, encode(Value())};
  return proto::Reply{std::nullopt, std::move(*out.value)};
}

// Runs `inst`'s save(), handing the value it gives to `take` (which may throw) while the
// plugin's memory is valid: checkpoints and replacements alike. The error, if any.
template <class Take>
std::optional<std::string> Instances::save_one(const Instance& inst, Take&& take) {
  struct Target {
    std::remove_reference_t<Take>* take;
    std::optional<std::string> error;
  } t{&take, std::nullopt};
  twk_sink_v1 sink{
      &t,
      [](void* p, const twk_value_v1* v) {
        auto* t = static_cast<Target*>(p);
        try {
          (*t->take)(*v);
        } catch (const std::exception& e) {
          t->error = e.what();
        }
      },
      [](void* p, const char* msg) { static_cast<Target*>(p)->error = msg ? msg : ""; }};
  twk_context_v1 ctx = context_();
  if (inst.cls->save(inst.self, &host_, &ctx, &sink) != TWK_OK || t.error)
    return t.error.value_or("failed without a message");
  return std::nullopt;
}

proto::Saved Instances::save(const proto::Save& m) {
  std::vector<const Instance*> stateful;
  for (std::uint64_t id : order_) {
    const Instance& inst = instances_.at(id);
    if (inst.cls->save) stateful.push_back(&inst);
  }
  try {
    checkpoint::PartWriter part(std::filesystem::path(m.dir) / m.file,
                                static_cast<std::uint32_t>(stateful.size()), m.step);
    for (const Instance* inst : stateful) {
      auto error =
          save_one(*inst, [&](const twk_value_v1& v) { part.add(inst->key, inst->cls->name, v); });
      if (error) return proto::Saved{fmt::format("{}.save: {}", inst->cls->name, *error), "", 0, 0};
    }
    const auto written = part.finish();
    return proto::Saved{std::nullopt, written.sha256, written.bytes, stateful.size()};
  } catch (const std::exception& e) {
    return proto::Saved{e.what(), "", 0, 0};
  }
}

proto::State Instances::state(const std::string& worker, const Adopt& adopt) {
  proto::State out;
  for (std::uint64_t id : order_) {
    const Instance& inst = instances_.at(id);
    if (!inst.cls->save) continue;
    std::optional<EncodedValue> value;
    auto error = save_one(inst, [&](const twk_value_v1& v) { value = adopt(v); });
    if (error || !value) {
      out.error =
          fmt::format("{}.save on {}: {}", inst.cls->name, worker, error.value_or("gave no state"));
      out.entries.clear();
      return out;
    }
    out.entries.push_back(proto::StateEntry{inst.key, inst.cls->name, std::move(*value)});
  }
  return out;
}

Instances::Loaded Instances::load(std::vector<proto::StateEntry>& entries,
                                  const std::string& what) {
  Loaded out;
  for (auto& entry : entries) {
    const Instance* inst = nullptr;
    for (const auto& [iid, i] : instances_) {
      if (i.key == entry.key && i.cls->name == entry.cls) inst = &i;
    }
    if (!inst || !inst->cls->load) continue;  // made on the donor only: nothing to load
    for (const Tensor& t : entry.state.tensors) out.bytes += t.nbytes();
    // Shared: the plugin may keep the received tensors (in shared memory) without a copy.
    Shared state = share(std::move(entry.state));
    twk_context_v1 ctx = context_();
    SinkCapture err;
    twk_sink_v1 sink = err.sink();
    if (inst->cls->load(inst->self, &host_, &ctx, &state.view, &sink) != TWK_OK) {
      out.error = fmt::format("{}: {}.load: {}", what, entry.cls,
                              err.error.value_or("failed without a message"));
      return out;
    }
    ++out.instances;
  }
  return out;
}

std::string Instances::class_of(std::uint64_t id) const {
  auto it = instances_.find(id);
  return it == instances_.end() ? "?" : it->second.cls->name;
}

void Instances::clear() {
  for (auto& [id, inst] : instances_) inst.cls->destruct(inst.self);
  instances_.clear();
  order_.clear();
}

}  // namespace twinkle::core
