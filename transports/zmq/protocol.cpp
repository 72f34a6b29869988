#include "transports/zmq/protocol.hpp"

#include <bit>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>

#include <fmt/format.h>

#include "transports/zmq/codec.hpp"

namespace twinkle::transport {

const char* to_string(MsgType t) {
  switch (t) {
    case MsgType::hello: return "hello";
    case MsgType::welcome: return "welcome";
    case MsgType::create: return "create";
    case MsgType::created: return "created";
    case MsgType::call: return "call";
    case MsgType::reply: return "reply";
    case MsgType::shutdown: return "shutdown";
    case MsgType::kv_set: return "kv_set";
    case MsgType::kv_get: return "kv_get";
    case MsgType::kv_value: return "kv_value";
    case MsgType::comm_join: return "comm_join";
    case MsgType::peer_lost: return "peer_lost";
    case MsgType::probe: return "probe";
    case MsgType::save: return "save";
    case MsgType::saved: return "saved";
    case MsgType::regroup: return "regroup";
    case MsgType::recover: return "recover";
    case MsgType::recovered: return "recovered";
    case MsgType::state_pull: return "state_pull";
    case MsgType::state: return "state";
    case MsgType::peers_replaced: return "peers_replaced";
    case MsgType::made: return "made";
    case MsgType::node_register: return "node_register";
    case MsgType::node_welcome: return "node_welcome";
    case MsgType::heartbeat: return "heartbeat";
    case MsgType::reregister: return "reregister";
    case MsgType::nodes_query: return "nodes_query";
    case MsgType::nodes_info: return "nodes_info";
    case MsgType::reserve: return "reserve";
    case MsgType::reservation: return "reservation";
    case MsgType::release: return "release";
    case MsgType::lease: return "lease";
    case MsgType::launch: return "launch";
    case MsgType::launched: return "launched";
    case MsgType::need_plugin: return "need_plugin";
    case MsgType::plugin: return "plugin";
    case MsgType::stop_job: return "stop_job";
    case MsgType::stopped: return "stopped";
    case MsgType::worker_exit: return "worker_exit";
    case MsgType::output: return "output";
    case MsgType::node_dead: return "node_dead";
    case MsgType::kill_job: return "kill_job";
    case MsgType::node_leave: return "node_leave";
    case MsgType::upload_check: return "upload_check";
    case MsgType::upload_part: return "upload_part";
    case MsgType::upload_state: return "upload_state";
    case MsgType::submit: return "submit";
    case MsgType::job_answer: return "job_answer";
    case MsgType::jobs_query: return "jobs_query";
    case MsgType::jobs_info: return "jobs_info";
    case MsgType::logs_query: return "logs_query";
    case MsgType::logs_chunk: return "logs_chunk";
    case MsgType::job_stop: return "job_stop";
    case MsgType::dashboard_link: return "dashboard_link";
    case MsgType::dashboard_grant: return "dashboard_grant";
    case MsgType::quotas_query: return "quotas_query";
    case MsgType::quotas_info: return "quotas_info";
    case MsgType::driver_start: return "driver_start";
    case MsgType::need_archive: return "need_archive";
    case MsgType::archive_part: return "archive_part";
    case MsgType::driver_status: return "driver_status";
    case MsgType::driver_ack: return "driver_ack";
    case MsgType::job_resume: return "job_resume";
    case MsgType::relocate: return "relocate";
  }
  return "unknown";
}

DropLog::DropLog(std::string where, Sink sink) : where_(std::move(where)), sink_(std::move(sink)) {
  if (!sink_) {
    sink_ = [](const std::string& line) {
      std::fprintf(stderr, "twinkle: %s\n", line.c_str());
      std::fflush(stderr);
    };
  }
}

void DropLog::drop(const std::string& why) {
  ++count_;
  const auto now = std::chrono::steady_clock::now();
  if (last_.time_since_epoch().count() != 0 && now - last_ < std::chrono::seconds(1)) {
    ++unlogged_;
    return;
  }
  if (unlogged_ > 0) sink_(fmt::format("dropped {} more message(s) on {}", unlogged_, where_));
  sink_(fmt::format("dropped a message on {}: {}", where_, why));
  unlogged_ = 0;
  last_ = now;
}

namespace {

using detail::Packer;

template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};
template <class T>
concept Struct = requires {
  T::fields();
};

// ----- encoding -----------------------------------------------------------------------------

struct Out {
  msgpack::sbuffer& buf;
  Packer pk;
  std::vector<Tensor>& tensors;
};

void pack(Out& o, std::string_view s) {
  o.pk.pack_str(static_cast<std::uint32_t>(s.size()));
  o.pk.pack_str_body(s.data(), static_cast<std::uint32_t>(s.size()));
}
void pack(Out& o, const std::string& s) { pack(o, std::string_view(s)); }
void pack(Out& o, bool b) { b ? o.pk.pack_true() : o.pk.pack_false(); }
void pack(Out& o, int v) { o.pk.pack_int64(v); }
void pack(Out& o, std::int64_t v) { o.pk.pack_int64(v); }
void pack(Out& o, std::uint64_t v) { o.pk.pack_uint64(v); }
void pack(Out& o, double d) {
  // Always a float64, also for integral values (msgpack-cxx would write 3.0 as an integer).
  const auto bits = std::bit_cast<std::uint64_t>(d);
  char raw[9] = {static_cast<char>(0xcb)};
  for (int i = 0; i < 8; ++i) raw[1 + i] = static_cast<char>(bits >> (56 - 8 * i));
  o.buf.write(raw, sizeof raw);
}
void pack(Out& o, const Bytes& b) {
  o.pk.pack_bin(static_cast<std::uint32_t>(b.data.size()));
  o.pk.pack_bin_body(reinterpret_cast<const char*>(b.data.data()),
                     static_cast<std::uint32_t>(b.data.size()));
}
void pack_tensor_ref(Out& o, std::uint32_t index) {
  const char payload[4] = {static_cast<char>(index >> 24), static_cast<char>(index >> 16),
                           static_cast<char>(index >> 8), static_cast<char>(index)};
  o.pk.pack_ext(4, TWK_MSGPACK_EXT_TENSOR);
  o.pk.pack_ext_body(payload, 4);
}
void pack(Out& o, const Tensor& t) {
  pack_tensor_ref(o, static_cast<std::uint32_t>(o.tensors.size()));
  o.tensors.push_back(t);
}
void pack(Out& o, const Value& v) { twinkle::detail::pack_value(o.buf, o.pk, v, o.tensors); }
// A user value keeps its own msgpack bytes (with tensor indices of its own): [bytes, first
// tensor of the message, tensor count].
void pack(Out& o, const EncodedValue& e) {
  o.pk.pack_array(3);
  o.pk.pack_bin(static_cast<std::uint32_t>(e.msgpack.size()));
  o.pk.pack_bin_body(e.msgpack.data(), static_cast<std::uint32_t>(e.msgpack.size()));
  o.pk.pack_uint64(o.tensors.size());
  o.pk.pack_uint64(e.tensors.size());
  o.tensors.insert(o.tensors.end(), e.tensors.begin(), e.tensors.end());
}
void pack(Out& o, const std::map<std::string, std::string>& m) {
  o.pk.pack_map(static_cast<std::uint32_t>(m.size()));
  for (const auto& [k, v] : m) {
    pack(o, k);
    pack(o, v);
  }
}
template <class T>
void pack(Out& o, const std::vector<T>& list);
template <Struct S>
void pack(Out& o, const S& s);

template <class T>
void pack(Out& o, const std::vector<T>& list) {
  o.pk.pack_array(static_cast<std::uint32_t>(list.size()));
  for (const auto& item : list) pack(o, item);
}

template <Struct S>
void pack(Out& o, const S& s) {
  constexpr auto fields = S::fields();
  std::uint32_t n = 0;
  std::apply(
      [&](const auto&... f) {
        ((n +=
          [&] {
            if constexpr (is_optional<std::decay_t<decltype(s.*(f.member))>>::value)
              return (s.*(f.member)).has_value() ? 1u : 0u;
            else
              return 1u;
          }()),
         ...);
      },
      fields);
  o.pk.pack_map(n);
  std::apply(
      [&](const auto&... f) {
        (
            [&] {
              const auto& v = s.*(f.member);
              if constexpr (is_optional<std::decay_t<decltype(v)>>::value) {
                if (!v) return;
                pack(o, std::string_view(f.name));
                pack(o, *v);
              } else {
                pack(o, std::string_view(f.name));
                pack(o, v);
              }
            }(),
            ...);
      },
      fields);
}
// ----- decoding -----------------------------------------------------------------------------

const char* kind_of(const msgpack::object& o) {
  switch (o.type) {
    case msgpack::type::NIL: return "nil";
    case msgpack::type::BOOLEAN: return "a bool";
    case msgpack::type::POSITIVE_INTEGER:
    case msgpack::type::NEGATIVE_INTEGER: return "an integer";
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return "a float";
    case msgpack::type::STR: return "a string";
    case msgpack::type::BIN: return "bytes";
    case msgpack::type::ARRAY: return "a list";
    case msgpack::type::MAP: return "a map";
    case msgpack::type::EXT: return "an extension";
  }
  return "something unknown";
}

[[noreturn]] void wrong(const msgpack::object& o, const char* want) {
  throw ProtocolError(fmt::format("expected {}, got {}", want, kind_of(o)));
}

struct In {
  const std::vector<Tensor>& tensors;
};

void unpack(const msgpack::object& o, std::string& s, In&) {
  if (o.type != msgpack::type::STR) wrong(o, "a string");
  s.assign(o.via.str.ptr, o.via.str.size);
}
void unpack(const msgpack::object& o, bool& b, In&) {
  if (o.type != msgpack::type::BOOLEAN) wrong(o, "a bool");
  b = o.via.boolean;
}
template <class I>
requires(std::is_integral_v<I> && !std::is_same_v<I, bool>) void unpack(const msgpack::object& o,
                                                                        I& v, In&) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) {
    if (o.via.u64 > static_cast<std::uint64_t>(std::numeric_limits<I>::max()))
      throw ProtocolError(fmt::format("integer {} is out of range", o.via.u64));
    v = static_cast<I>(o.via.u64);
  } else if (o.type == msgpack::type::NEGATIVE_INTEGER) {
    if constexpr (std::is_unsigned_v<I>) {
      throw ProtocolError(fmt::format("integer {} is negative", o.via.i64));
    } else {
      if (o.via.i64 < static_cast<std::int64_t>(std::numeric_limits<I>::min()))
        throw ProtocolError(fmt::format("integer {} is out of range", o.via.i64));
      v = static_cast<I>(o.via.i64);
    }
  } else {
    wrong(o, "an integer");
  }
}
void unpack(const msgpack::object& o, double& d, In&) {
  switch (o.type) {
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: d = o.via.f64; break;
    case msgpack::type::POSITIVE_INTEGER: d = static_cast<double>(o.via.u64); break;
    case msgpack::type::NEGATIVE_INTEGER: d = static_cast<double>(o.via.i64); break;
    default: wrong(o, "a number");
  }
}
void unpack(const msgpack::object& o, Bytes& b, In&) {
  if (o.type != msgpack::type::BIN) wrong(o, "bytes");
  const auto* p = reinterpret_cast<const std::uint8_t*>(o.via.bin.ptr);
  b.data.assign(p, p + o.via.bin.size);
}
std::uint32_t tensor_index(const msgpack::object& o, const In& in) {
  if (o.type != msgpack::type::EXT || o.via.ext.type() != TWK_MSGPACK_EXT_TENSOR ||
      o.via.ext.size != 4)
    wrong(o, "a tensor");
  const auto* p = reinterpret_cast<const unsigned char*>(o.via.ext.data());
  const std::uint32_t index = (std::uint32_t(p[0]) << 24) | (std::uint32_t(p[1]) << 16) |
                              (std::uint32_t(p[2]) << 8) | std::uint32_t(p[3]);
  if (index >= in.tensors.size())
    throw ProtocolError(
        fmt::format("refers to tensor {} of the message's {}", index, in.tensors.size()));
  return index;
}
void unpack(const msgpack::object& o, Tensor& t, In& in) { t = in.tensors[tensor_index(o, in)]; }
void unpack(const msgpack::object& o, Value& v, In& in) {
  try {
    v = twinkle::detail::unpack_value(o, in.tensors, 0);
  } catch (const ValueError& e) {
    throw ProtocolError(e.what());
  }
}
void unpack(const msgpack::object& o, EncodedValue& e, In& in) {
  if (o.type != msgpack::type::ARRAY || o.via.array.size != 3 ||
      o.via.array.ptr[0].type != msgpack::type::BIN)
    wrong(o, "a value as [bytes, first tensor, tensor count]");
  const msgpack::object& bytes = o.via.array.ptr[0];
  std::uint64_t first = 0, count = 0;
  unpack(o.via.array.ptr[1], first, in);
  unpack(o.via.array.ptr[2], count, in);
  if (first > in.tensors.size() || count > in.tensors.size() - first)
    throw ProtocolError(fmt::format("a value refers to tensors {} to {} of the message's {}", first,
                                    first + count, in.tensors.size()));
  e.msgpack.assign(bytes.via.bin.ptr, bytes.via.bin.size);
  e.tensors.assign(in.tensors.begin() + static_cast<std::ptrdiff_t>(first),
                   in.tensors.begin() + static_cast<std::ptrdiff_t>(first + count));
}
void unpack(const msgpack::object& o, std::map<std::string, std::string>& m, In& in) {
  if (o.type != msgpack::type::MAP) wrong(o, "a map of strings");
  m.clear();
  for (std::uint32_t i = 0; i < o.via.map.size; ++i) {
    std::string k, v;
    unpack(o.via.map.ptr[i].key, k, in);
    unpack(o.via.map.ptr[i].val, v, in);
    m.insert_or_assign(std::move(k), std::move(v));
  }
}
template <class T>
void unpack(const msgpack::object& o, std::vector<T>& list, In& in);
template <Struct S>
void unpack(const msgpack::object& o, S& s, In& in);

template <class T>
void unpack(const msgpack::object& o, std::vector<T>& list, In& in) {
  if (o.type != msgpack::type::ARRAY) wrong(o, "a list");
  list.clear();
  list.resize(o.via.array.size);
  for (std::uint32_t i = 0; i < o.via.array.size; ++i) {
    try {
      unpack(o.via.array.ptr[i], list[i], in);
    } catch (const ProtocolError& e) {
      throw ProtocolError(fmt::format("[{}]{}{}", i, e.what()[0] == '[' ? "" : ": ", e.what()));
    }
  }
}

const msgpack::object* find_key(const msgpack::object& map, std::string_view key) {
  for (std::uint32_t i = 0; i < map.via.map.size; ++i) {
    const auto& k = map.via.map.ptr[i].key;
    if (k.type == msgpack::type::STR && std::string_view(k.via.str.ptr, k.via.str.size) == key)
      return &map.via.map.ptr[i].val;
  }
  return nullptr;
}

template <Struct S>
void unpack(const msgpack::object& o, S& s, In& in) {
  if (o.type != msgpack::type::MAP) wrong(o, "a map of fields");
  std::apply(
      [&](const auto&... f) {
        (
            [&] {
              auto& v = s.*(f.member);
              const msgpack::object* item = find_key(o, f.name);
              using V = std::decay_t<decltype(v)>;
              if (!item) {
                if constexpr (is_optional<V>::value) {
                  v.reset();
                  return;
                } else {
                  throw ProtocolError(fmt::format("missing field \"{}\"", f.name));
                }
              }
              try {
                if constexpr (is_optional<V>::value) {
                  v.emplace();
                  unpack(*item, *v, in);
                } else {
                  unpack(*item, v, in);
                }
              } catch (const ProtocolError& e) {
                throw ProtocolError(
                    fmt::format("{}{}{}", f.name, e.what()[0] == '[' ? "" : ": ", e.what()));
              }
            }(),
            ...);
      },
      S::fields());
}

// ----- as values ---------------------------------------------------------------------------

Value as_value(const std::string& s) { return Value(s); }
Value as_value(bool b) { return Value(b); }
Value as_value(int v) { return Value(v); }
Value as_value(std::int64_t v) { return Value(v); }
Value as_value(std::uint64_t v) { return Value(static_cast<std::int64_t>(v)); }
Value as_value(double d) { return Value(d); }
Value as_value(const Bytes& b) { return Value(b); }
Value as_value(const Value& v) { return v; }
Value as_value(const EncodedValue& e) { return decode(e); }
Value as_value(const std::map<std::string, std::string>& m) {
  Value out = Value::map();
  for (const auto& [k, v] : m) out[k] = v;
  return out;
}
template <class T>
Value as_value(const std::vector<T>& list);
template <Struct S>
Value as_value(const S& s);
template <class T>
Value as_value(const std::vector<T>& list) {
  Value out = Value::list();
  for (const auto& x : list) out.push_back(as_value(x));
  return out;
}
template <Struct S>
Value as_value(const S& s) {
  Value out = Value::map();
  std::apply(
      [&](const auto&... f) {
        (
            [&] {
              const auto& v = s.*(f.member);
              if constexpr (is_optional<std::decay_t<decltype(v)>>::value) {
                if (v) out[f.name] = as_value(*v);
              } else {
                out[f.name] = as_value(v);
              }
            }(),
            ...);
      },
      S::fields());
  return out;
}

// ----- descriptions -------------------------------------------------------------------------

template <class T>
std::string type_name() {
  if constexpr (std::is_same_v<T, std::string>)
    return "str";
  else if constexpr (std::is_same_v<T, bool>)
    return "bool";
  else if constexpr (std::is_same_v<T, int>)
    return "i32";
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return "i64";
  else if constexpr (std::is_same_v<T, std::uint64_t>)
    return "u64";
  else if constexpr (std::is_same_v<T, double>)
    return "f64";
  else if constexpr (std::is_same_v<T, Bytes>)
    return "bytes";
  else if constexpr (std::is_same_v<T, Tensor>)
    return "tensor";
  else if constexpr (std::is_same_v<T, Value>)
    return "value";
  else if constexpr (std::is_same_v<T, EncodedValue>)
    return "payload";
  else if constexpr (std::is_same_v<T, std::map<std::string, std::string>>)
    return "{str: str}";
  else if constexpr (is_vector<T>::value)
    return "[" + type_name<typename T::value_type>() + "]";
  else if constexpr (is_optional<T>::value)
    return type_name<typename T::value_type>() + "?";
  else
    return "{" +
           std::apply(
               [](const auto&... f) {
                 std::string out;
                 ((out += (out.empty() ? "" : ", ") + std::string(f.name) + " " +
                          type_name<std::decay_t<decltype(std::declval<T>().*(f.member))>>()),
                  ...);
                 return out;
               },
               T::fields()) +
           "}";
}

template <class Variant, std::size_t... I>
void describe_all(std::vector<std::string>& out, std::index_sequence<I...>) {
  (
      [&] {
        using T = std::variant_alternative_t<I, Variant>;
        const std::string fields = type_name<T>();
        out.push_back(
            fmt::format("{} ({}): {}", to_string(T::kType), static_cast<int>(T::kType),
                        fields == "{}" ? "no fields" : fields.substr(1, fields.size() - 2)));
      }(),
      ...);
}

template <class Variant, std::size_t... I>
Variant unpack_variant(MsgType t, const msgpack::object& body, In& in, std::index_sequence<I...>) {
  std::optional<Variant> out;
  (
      [&] {
        using T = std::variant_alternative_t<I, Variant>;
        if (out || T::kType != t) return;
        T m;
        unpack(body, m, in);
        out.emplace(std::move(m));
      }(),
      ...);
  if (!out) throw ProtocolError(fmt::format("a {} message is not expected here", to_string(t)));
  return std::move(*out);
}

template <class Variant, std::size_t... I>
bool has_type(MsgType t, std::index_sequence<I...>) {
  return ((std::variant_alternative_t<I, Variant>::kType == t) || ...);
}

}  // namespace

namespace proto {

Value to_value(const NodesInfo& info) { return as_value(info); }
Value to_value(const JobEntry& job) { return as_value(job); }

Value to_value(const QuotasInfo& info) { return as_value(info); }

Value to_value(const Control& body) {
  return std::visit([](const auto& m) { return as_value(m); }, body);
}

std::vector<std::string> describe_messages() {
  std::vector<std::string> out;
  describe_all<Control>(out, std::make_index_sequence<std::variant_size_v<Control>>());
  describe_all<Cluster>(out, std::make_index_sequence<std::variant_size_v<Cluster>>());
  return out;
}

}  // namespace proto

namespace detail {

void pack_body(msgpack::sbuffer& buf, const proto::Control& body, std::vector<Tensor>& tensors) {
  Out o{buf, Packer(buf), tensors};
  std::visit([&](const auto& m) { pack(o, m); }, body);
}

void pack_body(msgpack::sbuffer& buf, const proto::Cluster& body, std::vector<Tensor>& tensors) {
  Out o{buf, Packer(buf), tensors};
  std::visit([&](const auto& m) { pack(o, m); }, body);
}

bool is_control(MsgType t) {
  return has_type<proto::Control>(t,
                                  std::make_index_sequence<std::variant_size_v<proto::Control>>());
}

bool is_cluster(MsgType t) {
  return has_type<proto::Cluster>(t,
                                  std::make_index_sequence<std::variant_size_v<proto::Cluster>>());
}

proto::Control unpack_control(MsgType t, const msgpack::object& body,
                              const std::vector<Tensor>& tensors) {
  In in{tensors};
  return unpack_variant<proto::Control>(
      t, body, in, std::make_index_sequence<std::variant_size_v<proto::Control>>());
}

proto::Cluster unpack_cluster(MsgType t, const msgpack::object& body,
                              const std::vector<Tensor>& tensors) {
  In in{tensors};
  return unpack_variant<proto::Cluster>(
      t, body, in, std::make_index_sequence<std::variant_size_v<proto::Cluster>>());
}

}  // namespace detail

}  // namespace twinkle::transport
