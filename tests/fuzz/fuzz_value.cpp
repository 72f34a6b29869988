// libFuzzer target: the value decoder (msgpack bytes -> twinkle::Value, twinkle/value.hpp).
// Any input must decode or raise ValueError; what decodes encodes back to the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "twinkle/value.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<twinkle::Tensor> tensors = {
      twinkle::Tensor::from(std::vector<float>{1.0f, 2.0f}),
      twinkle::Tensor::from(std::vector<std::int64_t>{3}, {1, 1})};
  twinkle::Value v;
  try {
    v = twinkle::decode(data, size, tensors);
  } catch (const twinkle::ValueError&) {
    return 0;
  }
  // Compared as bytes, so that NaN counts as equal to itself.
  twinkle::EncodedValue e = twinkle::encode(v);
  twinkle::EncodedValue again =
      twinkle::encode(twinkle::decode(e.msgpack.data(), e.msgpack.size(), e.tensors));
  if (again.msgpack != e.msgpack) std::abort();
  (void)v.repr();
  return 0;
}
