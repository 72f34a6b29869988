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
// Straight from the bytes into the struct (twinkle/msgpack_reader.hpp): no msgpack objects in
// between.

using detail::Item;
using detail::Reader;

[[noreturn]] void wrong(const Item& it, const char* want) {
  throw ProtocolError(fmt::format("expected {}, got {}", want, it.kind_name()));
}

struct In {
  const std::vector<Tensor>& tensors;
};

void unpack(Reader& r, std::string& s, In&) {
  const Item it = r.next();
  if (it.kind != Item::str) wrong(it, "a string");
  s.assign(it.data, it.size);
}
void unpack(Reader& r, bool& b, In&) {
  const Item it = r.next();
  if (it.kind != Item::boolean) wrong(it, "a bool");
  b = it.flag;
}
template <class I>
requires(std::is_integral_v<I> && !std::is_same_v<I, bool>) void unpack(Reader& r, I& v, In&) {
  const Item it = r.next();
  if (it.kind != Item::integer) wrong(it, "an integer");
  if (!it.flag) {
    if (it.u > static_cast<std::uint64_t>(std::numeric_limits<I>::max()))
      throw ProtocolError(fmt::format("integer {} is out of range", it.u));
    v = static_cast<I>(it.u);
  } else if constexpr (std::is_unsigned_v<I>) {
    throw ProtocolError(fmt::format("integer {} is negative", it.i));
  } else {
    if (it.i < static_cast<std::int64_t>(std::numeric_limits<I>::min()))
      throw ProtocolError(fmt::format("integer {} is out of range", it.i));
    v = static_cast<I>(it.i);
  }
}
void unpack(Reader& r, double& d, In&) {
  const Item it = r.next();
  switch (it.kind) {
    case Item::float32:
    case Item::float64: d = it.f; break;
    case Item::integer: d = it.flag ? static_cast<double>(it.i) : static_cast<double>(it.u); break;
    default: wrong(it, "a number");
  }
}
void unpack(Reader& r, Bytes& b, In&) {
  const Item it = r.next();
  if (it.kind != Item::bin) wrong(it, "bytes");
  const auto* p = reinterpret_cast<const std::uint8_t*>(it.data);
  b.data.assign(p, p + it.size);
}
void unpack(Reader& r, Tensor& t, In& in) {
  const Item it = r.next();
  if (it.kind != Item::ext || it.ext_type != TWK_MSGPACK_EXT_TENSOR || it.size != 4)
    wrong(it, "a tensor");
  const auto* p = reinterpret_cast<const unsigned char*>(it.data);
  const std::uint32_t index = (std::uint32_t(p[0]) << 24) | (std::uint32_t(p[1]) << 16) |
                              (std::uint32_t(p[2]) << 8) | std::uint32_t(p[3]);
  if (index >= in.tensors.size())
    throw ProtocolError(
        fmt::format("refers to tensor {} of the message's {}", index, in.tensors.size()));
  t = in.tensors[index];
}
// Any value, inline: the rare field of this type is decoded as a user value is.
void unpack(Reader& r, Value& v, In& in) {
  const char* start = r.position();
  r.skip();
  try {
    v = twinkle::decode(start, static_cast<std::size_t>(r.position() - start), in.tensors);
  } catch (const ValueError& e) {
    throw ProtocolError(e.what());
  }
}
void unpack(Reader& r, EncodedValue& e, In& in) {
  const Item list = r.next();
  if (list.kind != Item::array || list.size != 3)
    wrong(list, "a value as [bytes, first tensor, tensor count]");
  const Item bytes = r.next();
  if (bytes.kind != Item::bin) wrong(bytes, "a value as [bytes, first tensor, tensor count]");
  std::uint64_t first = 0, count = 0;
  unpack(r, first, in);
  unpack(r, count, in);
  if (first > in.tensors.size() || count > in.tensors.size() - first)
    throw ProtocolError(fmt::format("a value refers to tensors {} to {} of the message's {}", first,
                                    first + count, in.tensors.size()));
  e.msgpack.assign(bytes.data, bytes.size);
  e.tensors.assign(in.tensors.begin() + static_cast<std::ptrdiff_t>(first),
                   in.tensors.begin() + static_cast<std::ptrdiff_t>(first + count));
}
void unpack(Reader& r, std::map<std::string, std::string>& m, In& in) {
  const Item map = r.next();
  if (map.kind != Item::map) wrong(map, "a map of strings");
  m.clear();
  for (std::uint32_t i = 0; i < map.size; ++i) {
    std::string k, v;
    unpack(r, k, in);
    unpack(r, v, in);
    m.insert_or_assign(std::move(k), std::move(v));
  }
}
template <class T>
void unpack(Reader& r, std::vector<T>& list, In& in);
template <Struct S>
void unpack(Reader& r, S& s, In& in);

template <class T>
void unpack(Reader& r, std::vector<T>& list, In& in) {
  const Item head = r.next();
  if (head.kind != Item::array) wrong(head, "a list");
  list.clear();
  // Grown as the items come: a count is only as good as the items that follow it.
  list.reserve(std::min<std::uint32_t>(head.size, 64));
  for (std::uint32_t i = 0; i < head.size; ++i) {
    try {
      unpack(r, list.emplace_back(), in);
    } catch (const ProtocolError& e) {
      throw ProtocolError(fmt::format("[{}]{}{}", i, e.what()[0] == '[' ? "" : ": ", e.what()));
    }
  }
}

// Field I of `s`, when `key` is its name and it was not seen before: decoded, and true.
template <std::size_t I, Struct S>
bool unpack_field(Reader& r, S& s, In& in, std::string_view key, std::uint64_t& seen) {
  constexpr auto f = std::get<I>(S::fields());
  if (key != f.name || (seen & (std::uint64_t{1} << I)) != 0) return false;
  seen |= std::uint64_t{1} << I;
  auto& v = s.*(f.member);
  try {
    if constexpr (is_optional<std::decay_t<decltype(v)>>::value) {
      unpack(r, v.emplace(), in);
    } else {
      unpack(r, v, in);
    }
  } catch (const ProtocolError& e) {
    throw ProtocolError(fmt::format("{}{}{}", f.name, e.what()[0] == '[' ? "" : ": ", e.what()));
  }
  return true;
}

// The fields in any order; a key that names no field is passed over, one given twice counts the
// first time.
template <Struct S>
void unpack(Reader& r, S& s, In& in) {
  const Item map = r.next();
  if (map.kind != Item::map) wrong(map, "a map of fields");
  constexpr std::size_t n = std::tuple_size_v<decltype(S::fields())>;
  static_assert(n <= 64, "a message struct has at most 64 fields");
  std::uint64_t seen = 0;
  for (std::uint32_t k = 0; k < map.size; ++k) {
    const Item key = r.next();
    const bool taken = key.kind == Item::str&& [&]<std::size_t... I>(std::index_sequence<I...>) {
      return (unpack_field<I>(r, s, in, key.text(), seen) || ...);
    }
    (std::make_index_sequence<n>());
    if (!taken) r.skip();
  }
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          if ((seen & (std::uint64_t{1} << I)) != 0) return;
          constexpr auto f = std::get<I>(S::fields());
          if constexpr (is_optional<std::decay_t<decltype(s.*(f.member))>>::value)
            (s.*(f.member)).reset();
          else
            throw ProtocolError(fmt::format("missing field \"{}\"", f.name));
        }(),
        ...);
  }
  (std::make_index_sequence<n>());
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

// Decoded in place: the struct is built in the variant that the message carries.
template <class Variant, std::size_t... I>
void unpack_variant(MsgType t, Reader& r, In& in, Variant& out, std::index_sequence<I...>) {
  const bool known = ([&] {
    using T = std::variant_alternative_t<I, Variant>;
    if (T::kType != t) return false;
    unpack(r, out.template emplace<I>(), in);
    return true;
  }() || ...);
  if (!known) throw ProtocolError(fmt::format("a {} message is not expected here", to_string(t)));
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

void unpack_body(MsgType t, Reader& r, const std::vector<Tensor>& tensors, proto::Control& out) {
  In in{tensors};
  unpack_variant(t, r, in, out, std::make_index_sequence<std::variant_size_v<proto::Control>>());
}

void unpack_body(MsgType t, Reader& r, const std::vector<Tensor>& tensors, proto::Cluster& out) {
  In in{tensors};
  unpack_variant(t, r, in, out, std::make_index_sequence<std::variant_size_v<proto::Cluster>>());
}

}  // namespace detail

}  // namespace twinkle::transport
