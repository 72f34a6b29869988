#include "core/runtime/host_abi.hpp"

#include "twinkle/errors.hpp"

#include <cstdio>
#include <exception>
#include <string_view>

#include <fmt/format.h>

namespace twinkle::core {

twk_sink_v1 SinkCapture::sink() {
  return {this,
          [](void* t, const twk_value_v1* v) {
            auto* self = static_cast<SinkCapture*>(t);
            self->value = self->adopt ? self->adopt(*v) : decode(*v);
          },
          [](void* t, const char* m) { static_cast<SinkCapture*>(t)->error = m ? m : ""; }};
}

twk_sink_v1 EncodedSinkCapture::sink() {
  return {this,
          [](void* t, const twk_value_v1* v) {
            auto* self = static_cast<EncodedSinkCapture*>(t);
            self->value = self->adopt ? self->adopt(*v) : copy_encoded(*v);
          },
          [](void* t, const char* m) { static_cast<EncodedSinkCapture*>(t)->error = m ? m : ""; }};
}

MeshAbi::MeshAbi(const DeviceMesh& mesh) {
  for (const auto& d : mesh.dims()) {
    names_.push_back(d.name);
    sizes_.push_back(d.size);
  }
  for (const auto& n : names_) name_ptrs_.push_back(n.c_str());
  for (int r = 0; r < mesh.world_size(); ++r) {
    for (int c : mesh.coords(r)) coords_.push_back(c);
    data_ranks_.push_back(mesh.data_rank(r));
  }
  view_ = twk_mesh_v1{sizeof(twk_mesh_v1), static_cast<std::uint32_t>(names_.size()),
                      name_ptrs_.data(),   sizes_.data(),
                      mesh.ep(),           mesh.world_size(),
                      mesh.data_world(),   coords_.data(),
                      data_ranks_.data()};
}

bool HostOps::checkpoint(std::int64_t, const Value&) {
  throw Error(
      "checkpoint: only the driver entry checkpoints (twinkle::Driver::checkpoint); a worker's "
      "state is saved through its class's TWINKLE_STATE");
}

Value HostOps::resumed() {
  throw Error("resumed: only the driver entry asks (twinkle::Driver::resumed)");
}

namespace {

std::int32_t fail(twk_sink_v1* sink, const char* message) {
  if (sink && sink->set_error) sink->set_error(sink->target, message);
  return TWK_ERROR;
}

// Runs `f`, turning an exception into TWK_ERROR with its message.
template <class F>
std::int32_t guarded(twk_sink_v1* sink, F&& f) {
  try {
    f();
    return TWK_OK;
  } catch (const std::exception& e) {
    return fail(sink, e.what());
  } catch (...) {
    return fail(sink, "unknown error");
  }
}

HostOps& ops(void* c) { return *static_cast<HostOps*>(c); }

// "train.cpp:42" for a call site (the file without its folders). A loop of calls comes from one
// site: the last one is kept (for each thread that calls), and made again only for another file
// or line.
const std::string& call_site(const char* file, std::uint32_t line) {
  struct Last {
    std::string file;  // as the plugin gave it
    std::uint32_t line = 0;
    std::string site;
  };
  thread_local Last last;
  const std::string_view given = file ? file : "?";
  if (line == last.line && !last.site.empty() && given == last.file) return last.site;
  std::string_view f = given;
  if (const auto slash = f.rfind('/'); slash != std::string_view::npos) f.remove_prefix(slash + 1);
  last.file = given;
  last.line = line;
  last.site = f;
  last.site += ':';
  last.site += std::to_string(line);
  return last.site;
}

}  // namespace

twk_host_v1 host_table() {
  twk_host_v1 h{};
  h.size = sizeof h;
  h.abi_version = TWK_ABI_VERSION;
  h.log = [](void* c, std::int32_t level, const char* m) {
    try {
      ops(c).log(level, m ? m : "");
    } catch (...) {
      // Logging never fails the plugin.
    }
  };
  h.create = [](void* c, const char* cls, const char* group, const twk_value_v1* args,
                std::uint64_t* handle, twk_sink_v1* err) {
    return guarded(err, [&] {
      if (!args) throw Error("create: no arguments (a null value)");
      *handle = ops(c).create(cls ? cls : "", group ? group : "", *args);
    });
  };
  h.call = [](void* c, std::uint64_t instance, const char* method, const twk_value_v1* args,
              const char* file, std::uint32_t line, std::uint64_t* future, twk_sink_v1* err) {
    return guarded(err, [&] {
      if (!args) throw Error("call: no arguments (a null value)");
      *future = ops(c).call(instance, method ? method : "", *args, call_site(file, line));
    });
  };
  h.wait = [](void* c, std::uint64_t future, twk_sink_v1* out) {
    return guarded(out, [&] {
      EncodedValue e = ops(c).wait(future);
      if (out && out->set_value) out->set_value(out->target, e.view());
    });
  };
  h.release = [](void* c, std::uint64_t future) { ops(c).release(future); };
  h.comm_create = [](void* c, const char* name, const twk_value_v1* members, double timeout_s,
                     twk_sink_v1* err) {
    return guarded(err, [&] {
      ops(c).comm_create(name ? name : "", members ? decode(*members) : Value::list(), timeout_s);
    });
  };
  h.attach = [](void* c, const char* cls, const char* group, std::uint64_t instance,
                twk_sink_v1* err) {
    return guarded(err, [&] { ops(c).attach(cls ? cls : "", group ? group : "", instance); });
  };
  h.checkpoint = [](void* c, std::int64_t step, const twk_value_v1* meta, std::int32_t* saved,
                    twk_sink_v1* err) {
    return guarded(err, [&] {
      const bool s = ops(c).checkpoint(step, meta ? decode(*meta) : Value::map());
      if (saved) *saved = s ? 1 : 0;
    });
  };
  h.resumed = [](void* c, twk_sink_v1* out) {
    return guarded(out, [&] {
      EncodedValue e = encode(ops(c).resumed());
      if (out && out->set_value) out->set_value(out->target, e.view());
    });
  };
  h.stop_requested = [](void* c) -> std::int32_t {
    try {
      return ops(c).stop_requested() ? 1 : 0;
    } catch (...) {
      return 0;
    }
  };
  return h;
}

}  // namespace twinkle::core
