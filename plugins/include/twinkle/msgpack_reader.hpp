// A cursor over msgpack bytes: it reads one value's header at a time into an Item, without
// building msgpack objects and without allocating. Every read is bounded by the end of the bytes,
// and a list or map cannot claim more entries than bytes are left, so hostile input can neither
// read out of bounds nor make a decoder reserve more than the input's size. Used by the value
// decoder (value.hpp) and the wire protocol's (transports/zmq); header-only, part of the plugin
// SDK.
//
// Not msgpack-cxx's parser (it builds an object tree in a zone, two allocations a value for its
// stacks) nor msgpuck (its validator counts entries in an int and accepts the byte 0xc1).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>

namespace twinkle::detail {

// Bytes that are not msgpack: truncated, or the byte msgpack never uses.
class NotMsgpack : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Item {
  enum Kind : std::uint8_t { nil, boolean, integer, float32, float64, str, bin, array, map, ext };
  Kind kind = nil;
  bool flag = false;  // boolean: the value; integer: negative (then `i`, else `u`)
  std::int8_t ext_type = 0;
  std::uint32_t size = 0;  // str, bin, ext: payload bytes; array: items; map: pairs
  std::uint64_t u = 0;
  std::int64_t i = 0;
  double f = 0;
  const char* data = nullptr;  // str, bin, ext: the payload, in the reader's bytes

  std::string_view text() const { return {data, size}; }
  // "a string", "an integer": for messages that say what was found.
  const char* kind_name() const {
    switch (kind) {
      case nil: return "nil";
      case boolean: return "a bool";
      case integer: return "an integer";
      case float32:
      case float64: return "a float";
      case str: return "a string";
      case bin: return "bytes";
      case array: return "a list";
      case map: return "a map";
      case ext: return "an extension";
    }
    return "something unknown";
  }
};

class Reader {
 public:
  Reader(const char* data, std::size_t size) : begin_(data), p_(data), end_(data + size) {}

  bool done() const { return p_ == end_; }
  const char* position() const { return p_; }
  std::size_t offset() const { return static_cast<std::size_t>(p_ - begin_); }

  // The next value's header; for a string, bytes or an extension its payload too. The items of
  // a list (and the keys and values of a map) are the values that follow.
  Item next() {
    at_ = offset();
    const auto c = static_cast<std::uint8_t>(take(1)[0]);
    Item it;
    if (c <= 0x7f) return integer(c);
    if (c >= 0xe0) return negative(static_cast<std::int8_t>(c));
    if (c <= 0x8f) return entries(Item::map, c & 0x0f);
    if (c <= 0x9f) return entries(Item::array, c & 0x0f);
    if (c <= 0xbf) return payload(Item::str, c & 0x1f);
    switch (c) {
      case 0xc0: return it;
      case 0xc2:
      case 0xc3:
        it.kind = Item::boolean;
        it.flag = c == 0xc3;
        return it;
      case 0xc4: return payload(Item::bin, be(1));
      case 0xc5: return payload(Item::bin, be(2));
      case 0xc6: return payload(Item::bin, be(4));
      case 0xc7: return extension(be(1));
      case 0xc8: return extension(be(2));
      case 0xc9: return extension(be(4));
      case 0xca:
        it.kind = Item::float32;
        it.f = std::bit_cast<float>(static_cast<std::uint32_t>(be(4)));
        return it;
      case 0xcb:
        it.kind = Item::float64;
        it.f = std::bit_cast<double>(be(8));
        return it;
      case 0xcc: return integer(be(1));
      case 0xcd: return integer(be(2));
      case 0xce: return integer(be(4));
      case 0xcf: return integer(be(8));
      case 0xd0: return signed_integer(static_cast<std::int8_t>(be(1)));
      case 0xd1: return signed_integer(static_cast<std::int16_t>(be(2)));
      case 0xd2: return signed_integer(static_cast<std::int32_t>(be(4)));
      case 0xd3: return signed_integer(static_cast<std::int64_t>(be(8)));
      case 0xd4: return extension(1);
      case 0xd5: return extension(2);
      case 0xd6: return extension(4);
      case 0xd7: return extension(8);
      case 0xd8: return extension(16);
      case 0xd9: return payload(Item::str, be(1));
      case 0xda: return payload(Item::str, be(2));
      case 0xdb: return payload(Item::str, be(4));
      case 0xdc: return entries(Item::array, be(2));
      case 0xdd: return entries(Item::array, be(4));
      case 0xde: return entries(Item::map, be(2));
      case 0xdf: return entries(Item::map, be(4));
      default: break;
    }
    throw NotMsgpack("the byte 0xc1 at offset " + std::to_string(at_));
  }

  // Steps over one whole value, however deep, without recursion.
  void skip() {
    std::uint64_t pending = 1;
    while (pending > 0) {
      const Item it = next();
      --pending;
      if (it.kind == Item::array) pending += it.size;
      if (it.kind == Item::map) pending += 2 * std::uint64_t{it.size};
    }
  }

 private:
  std::size_t left() const { return static_cast<std::size_t>(end_ - p_); }

  const char* take(std::size_t n) {
    if (n > left()) throw NotMsgpack("truncated at offset " + std::to_string(offset()));
    const char* at = p_;
    p_ += n;
    return at;
  }
  std::uint64_t be(int n) {
    const auto* b = reinterpret_cast<const unsigned char*>(take(static_cast<std::size_t>(n)));
    std::uint64_t v = 0;
    for (int k = 0; k < n; ++k) v = (v << 8) | b[k];
    return v;
  }
  static Item integer(std::uint64_t v) {
    Item it;
    it.kind = Item::integer;
    it.u = v;
    return it;
  }
  static Item negative(std::int64_t v) {
    Item it;
    it.kind = Item::integer;
    it.flag = true;
    it.i = v;
    return it;
  }
  // As msgpack-cxx reads them: a signed encoding of a value >= 0 is a positive integer.
  static Item signed_integer(std::int64_t v) {
    return v >= 0 ? integer(static_cast<std::uint64_t>(v)) : negative(v);
  }
  Item payload(Item::Kind kind, std::uint64_t n) {
    Item it;
    it.kind = kind;
    it.size = static_cast<std::uint32_t>(n);
    it.data = take(n);
    return it;
  }
  Item extension(std::uint64_t n) {
    const auto type = static_cast<std::int8_t>(be(1));
    Item it = payload(Item::ext, n);
    it.ext_type = type;
    return it;
  }
  // Each entry takes at least one byte: a count beyond the bytes left is a lie.
  Item entries(Item::Kind kind, std::uint64_t n) {
    if ((kind == Item::map ? 2 * n : n) > left())
      throw NotMsgpack("a list or map of " + std::to_string(n) + " entries at offset " +
                       std::to_string(at_) + " runs past the end");
    Item it;
    it.kind = kind;
    it.size = static_cast<std::uint32_t>(n);
    return it;
  }

  const char* begin_;
  const char* p_;
  const char* end_;
  std::size_t at_ = 0;  // where the value next() reads starts
};

}  // namespace twinkle::detail
