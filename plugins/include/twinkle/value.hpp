// twinkle::Value and twinkle::Tensor: the values that cross between the driver and the workers,
// and their encoding (msgpack for the structure, tensor payloads as separate buffers).
// Header-only; part of the plugin SDK and used by the host as well.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <ostream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <msgpack.hpp>

#include "twinkle/msgpack_reader.hpp"
#include "twinkle/plugin.h"

namespace twinkle {

// A value is used the wrong way: wrong kind for as<T>(), a missing key, an index out of range.
class ValueError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class DType : std::int32_t {
  f32 = TWK_DTYPE_F32,
  f64 = TWK_DTYPE_F64,
  i32 = TWK_DTYPE_I32,
  i64 = TWK_DTYPE_I64,
  u8 = TWK_DTYPE_U8,
  i8 = TWK_DTYPE_I8,
  f16 = TWK_DTYPE_F16,
  bf16 = TWK_DTYPE_BF16,
  boolean = TWK_DTYPE_BOOL,
};

inline std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::f64:
    case DType::i64: return 8;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f16:
    case DType::bf16: return 2;
    case DType::u8:
    case DType::i8:
    case DType::boolean: return 1;
  }
  throw ValueError("unknown dtype " + std::to_string(static_cast<int>(d)));
}

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
    case DType::i8: return "int8";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::boolean: return "bool";
  }
  return "unknown";
}

inline bool dtype_known(std::int32_t d) { return d >= TWK_DTYPE_F32 && d <= TWK_DTYPE_BOOL; }

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>)
    return DType::f32;
  else if constexpr (std::is_same_v<T, double>)
    return DType::f64;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return DType::i32;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return DType::i64;
  else if constexpr (std::is_same_v<T, std::uint8_t>)
    return DType::u8;
  else if constexpr (std::is_same_v<T, std::int8_t>)
    return DType::i8;
  else if constexpr (std::is_same_v<T, bool>)
    return DType::boolean;
  else
    static_assert(!sizeof(T), "no twinkle dtype for this element type");
}

// A dense row-major tensor. Copies share the storage (like a shared_ptr); slice() along dim 0
// shares it too. Use clone() for an independent copy.
class Tensor {
 public:
  Tensor() = default;

  // A zero-filled tensor.
  Tensor(DType dtype, std::vector<std::int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    nbytes_ = static_cast<std::size_t>(numel()) * dtype_size(dtype_);
    auto buf = std::shared_ptr<std::byte[]>(new std::byte[std::max<std::size_t>(nbytes_, 1)]());
    data_ = buf.get();
    owner_ = std::move(buf);
  }

  // A tensor holding `values`; shape defaults to {values.size()}.
  template <class T>
  static Tensor from(const std::vector<T>& values, std::vector<std::int64_t> shape = {}) {
    if (shape.empty()) shape = {static_cast<std::int64_t>(values.size())};
    Tensor t(dtype_of<T>(), std::move(shape));
    if (static_cast<std::size_t>(t.numel()) != values.size()) {
      throw ValueError("Tensor::from: shape holds " + std::to_string(t.numel()) + " elements, " +
                       std::to_string(values.size()) + " given");
    }
    if constexpr (std::is_same_v<T, bool>) {
      for (std::size_t i = 0; i < values.size(); ++i) t.data_[i] = std::byte(values[i] ? 1 : 0);
    } else {
      std::memcpy(t.data_, values.data(), t.nbytes_);
    }
    return t;
  }

  // A tensor over memory that `owner` keeps alive. Not copied.
  static Tensor view(DType dtype, std::vector<std::int64_t> shape, void* data, std::size_t nbytes,
                     std::shared_ptr<const void> owner) {
    Tensor t;
    t.dtype_ = dtype;
    t.shape_ = std::move(shape);
    if (static_cast<std::size_t>(t.numel()) * dtype_size(dtype) != nbytes) {
      throw ValueError("tensor of shape " + t.shape_text() + " and dtype " + dtype_name(dtype) +
                       " needs " + std::to_string(t.numel() * dtype_size(dtype)) +
                       " bytes, buffer has " + std::to_string(nbytes));
    }
    t.data_ = static_cast<std::byte*>(data);
    t.nbytes_ = nbytes;
    t.owner_ = std::move(owner);
    return t;
  }

  // A view over a shared-memory file: `fd` (kept open by `owner`) holds the data at `fd_offset`.
  // The host uses this to pass large tensors between processes without copying them.
  static Tensor view_fd(DType dtype, std::vector<std::int64_t> shape, void* data,
                        std::size_t nbytes, std::shared_ptr<const void> owner, int fd,
                        std::size_t fd_offset) {
    Tensor t = view(dtype, std::move(shape), data, nbytes, std::move(owner));
    t.fd_ = fd;
    t.fd_offset_ = fd_offset;
    return t;
  }
  // The shared-memory file holding the data, or -1; and the data's offset in it.
  int shm_fd() const { return fd_; }
  std::size_t shm_offset() const { return fd_offset_; }

  bool defined() const { return owner_ != nullptr; }
  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::size_t ndim() const { return shape_.size(); }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape_) n *= s;
    return n;
  }
  std::size_t nbytes() const { return nbytes_; }
  const std::byte* data() const { return data_; }
  std::byte* mutable_data() { return data_; }

  // Typed views; the element type must match dtype().
  template <class T>
  std::span<const T> span() const {
    check_type<T>();
    return {reinterpret_cast<const T*>(data_), static_cast<std::size_t>(numel())};
  }
  template <class T>
  std::span<T> mutable_span() {
    check_type<T>();
    return {reinterpret_cast<T*>(data_), static_cast<std::size_t>(numel())};
  }
  template <class T>
  std::vector<T> to_vector() const {
    auto s = span<T>();
    return {s.begin(), s.end()};
  }

  // Rows [begin, end) along dim 0, sharing storage.
  Tensor slice(std::int64_t begin, std::int64_t end) const {
    if (shape_.empty()) throw ValueError("cannot slice a 0-dimensional tensor");
    if (begin < 0 || end < begin || end > shape_[0]) {
      throw ValueError("slice [" + std::to_string(begin) + ", " + std::to_string(end) +
                       ") is outside dim 0 of size " + std::to_string(shape_[0]));
    }
    Tensor t = *this;
    const std::size_t row = shape_[0] ? nbytes_ / static_cast<std::size_t>(shape_[0]) : 0;
    t.shape_[0] = end - begin;
    t.data_ = data_ + row * static_cast<std::size_t>(begin);
    t.nbytes_ = row * static_cast<std::size_t>(end - begin);
    t.fd_offset_ = fd_offset_ + row * static_cast<std::size_t>(begin);
    return t;
  }

  Tensor clone() const {
    Tensor t(dtype_, shape_);
    if (nbytes_) std::memcpy(t.data_, data_, nbytes_);
    return t;
  }

  // Concatenation along dim 0; dtypes and trailing dims must agree.
  static Tensor concat(const std::vector<Tensor>& parts) {
    if (parts.empty()) throw ValueError("cannot concatenate zero tensors");
    std::vector<std::int64_t> shape = parts[0].shape_;
    if (shape.empty()) throw ValueError("cannot concatenate 0-dimensional tensors");
    shape[0] = 0;
    for (const auto& p : parts) {
      if (p.dtype_ != parts[0].dtype_ || p.ndim() != parts[0].ndim() ||
          !std::equal(p.shape_.begin() + 1, p.shape_.end(), parts[0].shape_.begin() + 1)) {
        throw ValueError("cannot concatenate tensors of " + parts[0].describe() + " and " +
                         p.describe());
      }
      shape[0] += p.shape_[0];
    }
    Tensor t(parts[0].dtype_, shape);
    std::size_t at = 0;
    for (const auto& p : parts) {
      if (p.nbytes_) std::memcpy(t.data_ + at, p.data_, p.nbytes_);
      at += p.nbytes_;
    }
    return t;
  }

  std::string shape_text() const {
    std::string s = "[";
    for (std::size_t i = 0; i < shape_.size(); ++i)
      s += (i ? ", " : "") + std::to_string(shape_[i]);
    return s + "]";
  }
  std::string describe() const { return std::string(dtype_name(dtype_)) + shape_text(); }

  // Same dtype, shape and bytes.
  bool equals(const Tensor& o) const {
    return dtype_ == o.dtype_ && shape_ == o.shape_ && nbytes_ == o.nbytes_ &&
           (nbytes_ == 0 || std::memcmp(data_, o.data_, nbytes_) == 0);
  }
  bool operator==(const Tensor& o) const { return equals(o); }

 private:
  template <class T>
  void check_type() const {
    if (dtype_of<T>() != dtype_) {
      throw ValueError(std::string("tensor holds ") + dtype_name(dtype_) + ", not " +
                       dtype_name(dtype_of<T>()));
    }
  }

  DType dtype_ = DType::f32;
  std::vector<std::int64_t> shape_;
  std::byte* data_ = nullptr;
  std::size_t nbytes_ = 0;
  std::shared_ptr<const void> owner_;
  int fd_ = -1;
  std::size_t fd_offset_ = 0;
};

// Raw bytes (msgpack bin), as opposed to text.
struct Bytes {
  std::vector<std::uint8_t> data;
  bool operator==(const Bytes&) const = default;
};

// A dynamically typed value: null, bool, int, double, string, bytes, list, map (string keys) or
// tensor. Cheap to move; copying a list or map copies its elements (tensors share storage).
class Value {
 public:
  using List = std::vector<Value>;
  using Map = std::map<std::string, Value, std::less<>>;
  enum class Kind { null, boolean, integer, floating, string, bytes, list, map, tensor };

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : v_(b) {}
  template <class I>
  requires(std::is_integral_v<I> && !std::is_same_v<I, bool>) Value(I i)
      : v_(static_cast<std::int64_t>(i)) {}
  Value(double d) : v_(d) {}
  Value(float f) : v_(static_cast<double>(f)) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(std::string_view s) : v_(std::string(s)) {}
  Value(Bytes b) : v_(std::move(b)) {}
  Value(List l) : v_(std::move(l)) {}
  Value(Map m) : v_(std::move(m)) {}
  Value(Tensor t) : v_(std::move(t)) {}
  template <class T>
  requires(!std::is_same_v<T, Value> && !std::is_same_v<T, char>) Value(const std::vector<T>& items)
      : v_(List(items.begin(), items.end())) {}

  static Value list(std::initializer_list<Value> items = {}) { return Value(List(items)); }
  static Value map(std::initializer_list<std::pair<const std::string, Value>> items = {}) {
    return Value(Map(items.begin(), items.end()));
  }

  Kind kind() const { return static_cast<Kind>(v_.index()); }
  const char* kind_name() const {
    static const char* kNames[] = {"null",  "bool", "int", "double", "string",
                                   "bytes", "list", "map", "tensor"};
    return kNames[v_.index()];
  }
  bool is_null() const { return kind() == Kind::null; }
  bool is_bool() const { return kind() == Kind::boolean; }
  bool is_int() const { return kind() == Kind::integer; }
  bool is_double() const { return kind() == Kind::floating; }
  bool is_number() const { return is_int() || is_double(); }
  bool is_string() const { return kind() == Kind::string; }
  bool is_bytes() const { return kind() == Kind::bytes; }
  bool is_list() const { return kind() == Kind::list; }
  bool is_map() const { return kind() == Kind::map; }
  bool is_tensor() const { return kind() == Kind::tensor; }

  // Conversions: bool, integers, floating point (ints widen), std::string, Bytes, List, Map,
  // Tensor, Value, and std::vector<T> from a list (or a 1-d tensor of matching type).
  template <class T>
  T as() const {
    if constexpr (std::is_same_v<T, Value>) {
      return *this;
    } else if constexpr (std::is_same_v<T, bool>) {
      return get<bool>("bool");
    } else if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(get<std::int64_t>("int"));
    } else if constexpr (std::is_floating_point_v<T>) {
      if (is_int()) return static_cast<T>(std::get<std::int64_t>(v_));
      return static_cast<T>(get<double>("double"));
    } else if constexpr (std::is_same_v<T, std::string>) {
      return get<std::string>("string");
    } else if constexpr (std::is_same_v<T, Bytes>) {
      return get<Bytes>("bytes");
    } else if constexpr (std::is_same_v<T, List>) {
      return get<List>("list");
    } else if constexpr (std::is_same_v<T, Map>) {
      return get<Map>("map");
    } else if constexpr (std::is_same_v<T, Tensor>) {
      return get<Tensor>("tensor");
    } else if constexpr (is_vector<T>::value) {
      using E = typename T::value_type;
      if constexpr (std::is_arithmetic_v<E>) {
        if (is_tensor()) {
          const Tensor& t = std::get<Tensor>(v_);
          if (t.dtype() == dtype_of<E>()) return t.to_vector<E>();
        }
      }
      T out;
      for (const auto& item : get<List>("list")) out.push_back(item.as<E>());
      return out;
    } else {
      static_assert(!sizeof(T), "Value::as<T>: unsupported type");
    }
  }

  const List& list_items() const { return get<List>("list"); }
  List& list_items() { return get_mut<List>("list"); }
  const Map& map_items() const { return get<Map>("map"); }
  Map& map_items() { return get_mut<Map>("map"); }
  const Tensor& tensor() const { return get<Tensor>("tensor"); }

  // Map access. The const form throws for a missing key; the non-const form makes a null value
  // into a map and inserts the key.
  const Value& operator[](std::string_view key) const {
    const Map& m = get<Map>("map");
    auto it = m.find(key);
    if (it == m.end()) throw ValueError("map has no key \"" + std::string(key) + "\"");
    return it->second;
  }
  Value& operator[](std::string_view key) {
    if (is_null()) v_ = Map{};
    Map& m = get_mut<Map>("map");
    auto it = m.find(key);
    if (it == m.end()) it = m.emplace(std::string(key), Value()).first;
    return it->second;
  }
  bool contains(std::string_view key) const { return is_map() && map_items().count(key) > 0; }

  // List access.
  template <class I>
  requires std::is_integral_v<I>
  const Value& operator[](I index) const {
    const List& l = get<List>("list");
    if (index < 0 || static_cast<std::size_t>(index) >= l.size()) {
      throw ValueError("index " + std::to_string(index) + " is outside a list of " +
                       std::to_string(l.size()));
    }
    return l[static_cast<std::size_t>(index)];
  }
  template <class I>
  requires std::is_integral_v<I> Value& operator[](I index) {
    return const_cast<Value&>(std::as_const(*this)[index]);
  }
  void push_back(Value v) {
    if (is_null()) v_ = List{};
    get_mut<List>("list").push_back(std::move(v));
  }

  // Items of a list or map, rows of a tensor, characters of a string or bytes; 0 for null.
  std::size_t size() const {
    switch (kind()) {
      case Kind::list: return std::get<List>(v_).size();
      case Kind::map: return std::get<Map>(v_).size();
      case Kind::string: return std::get<std::string>(v_).size();
      case Kind::bytes: return std::get<Bytes>(v_).data.size();
      case Kind::tensor: {
        const Tensor& t = std::get<Tensor>(v_);
        return t.ndim() ? static_cast<std::size_t>(t.shape()[0]) : 1;
      }
      default: return 0;
    }
  }

  List::const_iterator begin() const { return list_items().begin(); }
  List::const_iterator end() const { return list_items().end(); }

  // Structural equality; tensors compare dtype, shape and bytes; 1 == 1.0 is false.
  bool operator==(const Value& o) const {
    if (kind() != o.kind()) return false;
    if (is_tensor()) return tensor().equals(o.tensor());
    return v_ == o.v_;
  }

  // A short human-readable form for logs and error messages.
  std::string repr(std::size_t max_items = 8) const {
    switch (kind()) {
      case Kind::null: return "null";
      case Kind::boolean: return std::get<bool>(v_) ? "true" : "false";
      case Kind::integer: return std::to_string(std::get<std::int64_t>(v_));
      case Kind::floating: {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.6g", std::get<double>(v_));
        return buf;
      }
      case Kind::string: return "\"" + std::get<std::string>(v_) + "\"";
      case Kind::bytes: return "bytes[" + std::to_string(size()) + "]";
      case Kind::tensor: return "tensor " + tensor().describe();
      case Kind::list: {
        std::string s = "[";
        const auto& l = std::get<List>(v_);
        for (std::size_t i = 0; i < l.size() && i < max_items; ++i)
          s += (i ? ", " : "") + l[i].repr(max_items);
        if (l.size() > max_items) s += ", ... (" + std::to_string(l.size()) + " items)";
        return s + "]";
      }
      case Kind::map: {
        std::string s = "{";
        std::size_t i = 0;
        for (const auto& [k, v] : std::get<Map>(v_)) {
          if (i == max_items) {
            s += ", ...";
            break;
          }
          s += (i++ ? ", " : "") + k + ": " + v.repr(max_items);
        }
        return s + "}";
      }
    }
    return "?";
  }

 private:
  template <class T>
  struct is_vector : std::false_type {};
  template <class E, class A>
  struct is_vector<std::vector<E, A>> : std::true_type {};

  template <class T>
  const T& get(const char* want) const {
    if (auto p = std::get_if<T>(&v_)) return *p;
    throw ValueError(std::string("value is ") + kind_name() + ", not " + want);
  }
  template <class T>
  T& get_mut(const char* want) {
    if (auto p = std::get_if<T>(&v_)) return *p;
    throw ValueError(std::string("value is ") + kind_name() + ", not " + want);
  }

  std::variant<std::monostate, bool, std::int64_t, double, std::string, Bytes, List, Map, Tensor>
      v_;
};

inline std::ostream& operator<<(std::ostream& out, const Value& v) { return out << v.repr(); }

// A Value in its boundary form: msgpack bytes plus the tensors it refers to. Owns (shares) what
// view() points into; the view stays valid while this object lives and is not modified.
class EncodedValue {
 public:
  std::string msgpack;
  std::vector<Tensor> tensors;

  // The C view of this value, for passing across the ABI.
  const twk_value_v1* view() {
    descs_.resize(tensors.size());
    shapes_.resize(tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      shapes_[i] = tensors[i].shape();
      descs_[i] = twk_tensor_v1{static_cast<std::int32_t>(tensors[i].dtype()),
                                static_cast<std::int32_t>(shapes_[i].size()), shapes_[i].data(),
                                tensors[i].data(), tensors[i].nbytes()};
    }
    view_ = twk_value_v1{reinterpret_cast<const std::uint8_t*>(msgpack.data()),
                         msgpack.size(),
                         descs_.data(),
                         static_cast<std::uint32_t>(descs_.size()),
                         nullptr,
                         nullptr,
                         nullptr};
    return &view_;
  }

 private:
  std::vector<twk_tensor_v1> descs_;
  std::vector<std::vector<std::int64_t>> shapes_;
  twk_value_v1 view_{};
};

// How deep lists and maps may nest in a value that is encoded or decoded: deeper ones are
// rejected with a ValueError instead of overflowing the stack.
inline constexpr int kMaxValueDepth = 256;

namespace detail {

inline void pack_value(msgpack::sbuffer& buf, msgpack::packer<msgpack::sbuffer>& pk, const Value& v,
                       std::vector<Tensor>& tensors, int depth = 0) {
  if (depth > kMaxValueDepth) {
    throw ValueError("value nests deeper than " + std::to_string(kMaxValueDepth) +
                     " levels of lists and maps");
  }
  switch (v.kind()) {
    case Value::Kind::null: pk.pack_nil(); break;
    case Value::Kind::boolean: v.as<bool>() ? pk.pack_true() : pk.pack_false(); break;
    case Value::Kind::integer: pk.pack_int64(v.as<std::int64_t>()); break;
    case Value::Kind::floating: {
      // Written by hand: msgpack-cxx packs integral doubles (3.0) as integers, which would come
      // back as another kind.
      const auto bits = std::bit_cast<std::uint64_t>(v.as<double>());
      char raw[9] = {static_cast<char>(0xcb)};
      for (int i = 0; i < 8; ++i) raw[1 + i] = static_cast<char>(bits >> (56 - 8 * i));
      buf.write(raw, sizeof raw);
      break;
    }
    case Value::Kind::string: {
      const auto& s = v.as<std::string>();
      pk.pack_str(static_cast<std::uint32_t>(s.size()));
      pk.pack_str_body(s.data(), static_cast<std::uint32_t>(s.size()));
      break;
    }
    case Value::Kind::bytes: {
      const auto b = v.as<Bytes>();
      pk.pack_bin(static_cast<std::uint32_t>(b.data.size()));
      pk.pack_bin_body(reinterpret_cast<const char*>(b.data.data()),
                       static_cast<std::uint32_t>(b.data.size()));
      break;
    }
    case Value::Kind::list:
      pk.pack_array(static_cast<std::uint32_t>(v.size()));
      for (const auto& item : v.list_items()) pack_value(buf, pk, item, tensors, depth + 1);
      break;
    case Value::Kind::map:
      pk.pack_map(static_cast<std::uint32_t>(v.size()));
      for (const auto& [k, item] : v.map_items()) {
        pk.pack_str(static_cast<std::uint32_t>(k.size()));
        pk.pack_str_body(k.data(), static_cast<std::uint32_t>(k.size()));
        pack_value(buf, pk, item, tensors, depth + 1);
      }
      break;
    case Value::Kind::tensor: {
      const auto index = static_cast<std::uint32_t>(tensors.size());
      tensors.push_back(v.tensor());
      const char payload[4] = {static_cast<char>(index >> 24), static_cast<char>(index >> 16),
                               static_cast<char>(index >> 8), static_cast<char>(index)};
      pk.pack_ext(4, TWK_MSGPACK_EXT_TENSOR);
      pk.pack_ext_body(payload, 4);
      break;
    }
  }
}

// The value at `r`, whose tensor extensions refer to `tensors`.
inline Value read_value(Reader& r, const std::vector<Tensor>& tensors, int depth) {
  if (depth > kMaxValueDepth) {
    throw ValueError("value nests deeper than " + std::to_string(kMaxValueDepth) +
                     " levels of lists and maps");
  }
  const Item it = r.next();
  switch (it.kind) {
    case Item::nil: return Value();
    case Item::boolean: return Value(it.flag);
    case Item::integer:
      if (it.flag) return Value(it.i);
      if (it.u > static_cast<std::uint64_t>(INT64_MAX)) throw ValueError("integer exceeds int64");
      return Value(static_cast<std::int64_t>(it.u));
    case Item::float32:
    case Item::float64: return Value(it.f);
    case Item::str: return Value(std::string(it.text()));
    case Item::bin: {
      Bytes b;
      const auto* p = reinterpret_cast<const std::uint8_t*>(it.data);
      b.data.assign(p, p + it.size);
      return Value(std::move(b));
    }
    case Item::array: {
      Value::List l;
      l.reserve(std::min<std::uint32_t>(it.size, 64));  // grown as the items come
      for (std::uint32_t i = 0; i < it.size; ++i) l.push_back(read_value(r, tensors, depth + 1));
      return Value(std::move(l));
    }
    case Item::map: {
      Value::Map m;
      for (std::uint32_t i = 0; i < it.size; ++i) {
        const Item key = r.next();
        if (key.kind != Item::str) throw ValueError("map keys must be strings");
        m.insert_or_assign(std::string(key.text()), read_value(r, tensors, depth + 1));
      }
      return Value(std::move(m));
    }
    case Item::ext: {
      if (it.ext_type != TWK_MSGPACK_EXT_TENSOR || it.size != 4)
        throw ValueError("unknown msgpack extension type " + std::to_string(it.ext_type));
      const auto* p = reinterpret_cast<const unsigned char*>(it.data);
      const std::uint32_t index = (std::uint32_t(p[0]) << 24) | (std::uint32_t(p[1]) << 16) |
                                  (std::uint32_t(p[2]) << 8) | std::uint32_t(p[3]);
      if (index >= tensors.size()) {
        throw ValueError("value refers to tensor " + std::to_string(index) + " of " +
                         std::to_string(tensors.size()));
      }
      return Value(tensors[index]);
    }
  }
  throw ValueError("malformed msgpack value");
}

}  // namespace detail

inline EncodedValue encode(const Value& v) {
  EncodedValue out;
  // Packed in the thread's own buffer, kept from one value to the next (not msgpack's 8 KiB to
  // start with: most values are small); one that grew past 64 KiB is let go.
  thread_local msgpack::sbuffer buf(128);
  buf.clear();
  msgpack::packer<msgpack::sbuffer> pk(buf);
  detail::pack_value(buf, pk, v, out.tensors);
  out.msgpack.assign(buf.data(), buf.size());
  if (buf.size() > 64 * 1024) buf = msgpack::sbuffer(128);
  return out;
}

// Decodes msgpack bytes whose tensor extensions refer to `tensors`. Throws ValueError on malformed
// input (truncated bytes, trailing bytes, a bad tensor index, nesting deeper than kMaxValueDepth).
// Read with a cursor (msgpack_reader.hpp): no msgpack objects, no allocation but the value's own.
inline Value decode(const void* data, std::size_t size, const std::vector<Tensor>& tensors) {
  detail::Reader r(static_cast<const char*>(data), size);
  Value v;
  try {
    v = detail::read_value(r, tensors, 0);
  } catch (const detail::NotMsgpack& e) {
    throw ValueError(std::string("malformed value: ") + e.what());
  }
  if (!r.done()) throw ValueError("malformed value: trailing bytes after the value");
  return v;
}

// Decodes a value in its boundary form.
inline Value decode(const EncodedValue& e) {
  return decode(e.msgpack.data(), e.msgpack.size(), e.tensors);
}

namespace detail {

// The tensors of a value received across the ABI: copied, unless the sender offers
// retain/release, in which case they are shared without a copy.
inline std::vector<Tensor> received_tensors(const twk_value_v1& v) {
  std::vector<Tensor> out;
  if (v.n_tensors == 0) return out;
  std::shared_ptr<const void> keep;
  if (v.retain && v.release && v.owner) {
    v.retain(v.owner);
    auto release = v.release;
    keep = std::shared_ptr<const void>(v.owner,
                                       [release](const void* o) { release(const_cast<void*>(o)); });
  }
  out.reserve(v.n_tensors);
  for (std::uint32_t i = 0; i < v.n_tensors; ++i) {
    const twk_tensor_v1& t = v.tensors[i];
    if (!dtype_known(t.dtype))
      throw ValueError("tensor " + std::to_string(i) + " has unknown dtype " +
                       std::to_string(t.dtype));
    if (t.ndim < 0 || (t.ndim > 0 && !t.shape))
      throw ValueError("tensor " + std::to_string(i) + " has a bad shape");
    std::vector<std::int64_t> shape(t.shape, t.shape + t.ndim);
    Tensor view =
        Tensor::view(static_cast<DType>(t.dtype), shape, const_cast<void*>(t.data), t.nbytes,
                     keep ? keep : std::shared_ptr<const void>(t.data, [](const void*) {}));
    out.push_back(keep ? view : view.clone());
  }
  return out;
}

}  // namespace detail

// A value received across the ABI in its boundary form, not decoded: the msgpack bytes copied,
// the tensors as received_tensors gives them.
inline EncodedValue copy_encoded(const twk_value_v1& v) {
  EncodedValue out;
  out.tensors = detail::received_tensors(v);
  out.msgpack.assign(reinterpret_cast<const char*>(v.msgpack), v.msgpack_size);
  return out;
}

// Decodes a value received across the ABI, straight from the sender's bytes.
inline Value decode(const twk_value_v1& v) {
  return decode(v.msgpack, v.msgpack_size, detail::received_tensors(v));
}

}  // namespace twinkle
