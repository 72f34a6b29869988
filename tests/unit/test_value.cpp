#include <catch2/catch.hpp>

#include <limits>
#include <utility>

#include "twinkle/value.hpp"

using twinkle::Tensor;
using twinkle::Value;
using twinkle::ValueError;

namespace {
Value round_trip(const Value& v) {
  auto e = twinkle::encode(v);
  return twinkle::decode(*e.view());
}
}  // namespace

TEST_CASE("scalars, strings, bytes, lists and maps round-trip", "[value]") {
  for (const Value& v :
       {Value(), Value(true), Value(false), Value(0), Value(-7),
        Value(std::numeric_limits<int64_t>::max()), Value(std::numeric_limits<int64_t>::min()),
        Value(2.5), Value(-0.0), Value("text"), Value(""), Value(twinkle::Bytes{{0, 1, 255}}),
        Value::list(), Value::map(),
        Value::list({1, "two", 3.0, Value(), Value::list({Value::map({{"k", 1}})})})}) {
    INFO(v.repr());
    CHECK(round_trip(v) == v);
  }
}

TEST_CASE("tensors travel as separate buffers, bit-exact", "[value]") {
  auto f32 = Tensor::from(std::vector<float>{1.5f, -2.25f, 3e-38f, 3e38f}, {2, 2});
  auto i64 = Tensor::from(std::vector<int64_t>{1, -1, std::numeric_limits<int64_t>::max()});
  auto u8 = Tensor::from(std::vector<uint8_t>{0, 128, 255});
  Tensor bf16(twinkle::DType::bf16, {3, 1});
  bf16.mutable_data()[5] = std::byte{0x7f};
  Value v = Value::map({{"a", f32}, {"b", Value::list({i64, u8})}, {"c", bf16}});
  auto e = twinkle::encode(v);
  REQUIRE(e.tensors.size() == 4);
  // The structure holds references, not the payloads.
  CHECK(e.msgpack.size() < 64);
  Value back = twinkle::decode(*e.view());
  CHECK(back == v);
  CHECK(back["a"].tensor().shape() == std::vector<int64_t>{2, 2});
  CHECK(back["a"].tensor().span<float>()[3] == 3e38f);
  CHECK(back["b"][0].tensor().to_vector<int64_t>()[2] == std::numeric_limits<int64_t>::max());
  CHECK(back["c"].tensor().dtype() == twinkle::DType::bf16);
  // decode() of a borrowed value copies the payload.
  CHECK(back["a"].tensor().data() != f32.data());
}

TEST_CASE("retain/release shares tensor memory without a copy", "[value]") {
  auto t = Tensor::from(std::vector<double>{1, 2, 3});
  auto e = twinkle::encode(Value(t));
  twk_value_v1 v = *e.view();
  int refs = 0;
  v.owner = &refs;
  v.retain = [](void* o) { ++*static_cast<int*>(o); };
  v.release = [](void* o) { --*static_cast<int*>(o); };
  {
    Value back = twinkle::decode(v);
    CHECK(refs == 1);
    CHECK(back.tensor().data() == t.data());
  }
  CHECK(refs == 0);
}

TEST_CASE("slices share storage; concat joins along dim 0", "[value]") {
  auto t = Tensor::from(std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}, {4, 2});
  auto s = t.slice(1, 3);
  CHECK(s.shape() == std::vector<int64_t>{2, 2});
  CHECK(s.data() == t.data() + 8);
  CHECK(s.to_vector<int32_t>() == std::vector<int32_t>{2, 3, 4, 5});
  auto joined = Tensor::concat({t.slice(0, 1), t.slice(3, 4)});
  CHECK(joined.to_vector<int32_t>() == std::vector<int32_t>{0, 1, 6, 7});
  CHECK_THROWS_WITH(t.slice(2, 5), "slice [2, 5) is outside dim 0 of size 4");
  CHECK_THROWS_WITH(Tensor::concat({t, Tensor::from(std::vector<float>{1, 2}, {1, 2})}),
                    "cannot concatenate tensors of int32[4, 2] and float32[1, 2]");
}

TEST_CASE("access and conversion", "[value]") {
  Value v = Value::map({{"loss", 0.5}, {"n", 3}, {"ids", Value::list({4, 5})}, {"name", "x"}});
  CHECK(v["loss"].as<double>() == 0.5);
  CHECK(v["n"].as<double>() == 3.0);  // ints widen
  CHECK(v["ids"][1].as<int>() == 5);
  CHECK(v["ids"].as<std::vector<int>>() == std::vector<int>{4, 5});
  CHECK(v.size() == 4);
  CHECK(v.contains("ids"));
  CHECK_FALSE(v.contains("nope"));
  CHECK_THROWS_WITH(std::as_const(v)["nope"], "map has no key \"nope\"");
  CHECK_THROWS_WITH(v["name"].as<int>(), "value is string, not int");
  CHECK_THROWS_WITH(v["ids"][2], "index 2 is outside a list of 2");
  CHECK_THROWS_AS(v["loss"].as<std::string>(), ValueError);
  Value m;
  m["a"]["b"] = 1;
  m["list"].push_back(2);
  CHECK(m["a"]["b"].as<int>() == 1);
  CHECK(m["list"].size() == 1);
  CHECK(Value(1) != Value(1.0));
  CHECK(Value::list({1, 2}).repr() == "[1, 2]");
}

TEST_CASE("malformed encodings are errors, not crashes", "[value]") {
  CHECK_THROWS_AS(twinkle::decode("\x92\x01", 2, {}), ValueError);  // truncated array
  CHECK_THROWS_WITH(twinkle::decode("\x01\x02", 2, {}), Catch::Contains("trailing bytes"));
  CHECK_THROWS_WITH(twinkle::decode("\xd6\x01\x00\x00\x00\x05", 6, {}),
                    "value refers to tensor 5 of 0");
  CHECK_THROWS_WITH(twinkle::decode("\x81\x01\x02", 3, {}), "map keys must be strings");
  twk_tensor_v1 bad{99, 0, nullptr, nullptr, 0};
  twk_value_v1 v{reinterpret_cast<const uint8_t*>("\xc0"), 1, &bad, 1, nullptr, nullptr, nullptr};
  CHECK_THROWS_WITH(twinkle::decode(v), "tensor 0 has unknown dtype 99");
  twk_tensor_v1 short_buf{TWK_DTYPE_F32, 1, nullptr, nullptr, 0};
  int64_t shape = 4;
  short_buf.shape = &shape;
  float data[2] = {};
  short_buf.data = data;
  short_buf.nbytes = sizeof data;
  twk_value_v1 v2{
      reinterpret_cast<const uint8_t*>("\xc0"), 1, &short_buf, 1, nullptr, nullptr, nullptr};
  CHECK_THROWS_WITH(twinkle::decode(v2),
                    "tensor of shape [4] and dtype float32 needs 16 bytes, buffer has 8");
}
