// twinkle/torch.hpp without workers: views alias memory both ways, every dtype round-trips, what
// cannot alias is copied, what has no twinkle dtype is refused by name. The collectives on
// at::Tensors run in workers: tests/integration/torch.sh.
#include <twinkle/torch.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

namespace tt = twinkle::torch;
using twinkle::DType;
using twinkle::Tensor;

TEST_CASE("a twinkle::Tensor viewed as an at::Tensor shares its memory") {
  Tensor t = Tensor::from<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  at::Tensor a = tt::view(t);
  CHECK(a.data_ptr() == static_cast<const void*>(t.data()));
  CHECK(a.sizes().vec() == std::vector<std::int64_t>{2, 3});
  CHECK(a.scalar_type() == at::kFloat);
  a.mul_(2);  // through torch: twinkle sees it
  CHECK(t.to_vector<float>() == std::vector<float>{2, 4, 6, 8, 10, 12});
  t.mutable_span<float>()[5] = -1;  // through twinkle: torch sees it
  CHECK(a[1][2].item<float>() == -1);
}

TEST_CASE("a view keeps the memory alive after the twinkle::Tensor is gone") {
  at::Tensor a;
  {
    Tensor t = Tensor::from<std::int64_t>({7, 8, 9});
    a = tt::view(t);
  }
  CHECK(a.sum().item<std::int64_t>() == 24);
  CHECK(a[2].item<std::int64_t>() == 9);
}

TEST_CASE("a contiguous CPU at::Tensor becomes a twinkle::Tensor without a copy") {
  at::Tensor a = at::arange(12, at::kDouble).view({3, 4});
  REQUIRE(tt::is_alias(a));
  Tensor t = tt::from(a);
  CHECK(static_cast<const void*>(t.data()) == a.data_ptr());
  CHECK(t.dtype() == DType::f64);
  CHECK(t.shape() == std::vector<std::int64_t>{3, 4});
  a.add_(1);
  CHECK(t.span<double>()[11] == 12.0);
  // The twinkle::Tensor keeps the storage: the at::Tensor may go.
  a = at::Tensor();
  CHECK(t.span<double>()[0] == 1.0);
}

TEST_CASE("a non-contiguous at::Tensor is copied, in the order torch reads it") {
  at::Tensor a = at::arange(6, at::kInt).view({2, 3});
  at::Tensor transposed = a.t();
  REQUIRE_FALSE(tt::is_alias(transposed));
  Tensor t = tt::from(transposed);
  CHECK(static_cast<const void*>(t.data()) != a.data_ptr());
  CHECK(t.shape() == std::vector<std::int64_t>{3, 2});
  CHECK(t.to_vector<std::int32_t>() == std::vector<std::int32_t>{0, 3, 1, 4, 2, 5});
  // A copy: later writes to the source do not reach it.
  a.fill_(9);
  CHECK(t.span<std::int32_t>()[0] == 0);
}

TEST_CASE("a tensor that requires grad crosses as its values") {
  at::Tensor w = at::ones({4}, at::kFloat).set_requires_grad(true);
  Tensor t = tt::from(w);
  CHECK(t.to_vector<float>() == std::vector<float>{1, 1, 1, 1});
  CHECK(static_cast<const void*>(t.data()) == w.data_ptr());
}

TEST_CASE("every twinkle dtype round-trips through torch") {
  const DType all[] = {DType::f32, DType::f64, DType::f16, DType::bf16,   DType::i8,
                       DType::u8,  DType::i32, DType::i64, DType::boolean};
  for (DType d : all) {
    INFO(twinkle::dtype_name(d));
    CHECK(tt::twinkle_dtype(tt::scalar_type(d)) == d);
    Tensor t(d, {2, 2});
    // Distinct bytes in every element, valid for every dtype (bool: 0 or 1).
    auto* bytes = t.mutable_data();
    for (std::size_t i = 0; i < t.nbytes(); ++i)
      bytes[i] = std::byte(d == DType::boolean ? i % 2 : (i * 37 + 11) % 251);
    at::Tensor a = tt::view(t);
    CHECK(a.scalar_type() == tt::scalar_type(d));
    CHECK(a.element_size() == static_cast<std::int64_t>(twinkle::dtype_size(d)));
    Tensor back = tt::from(a);
    CHECK(back.data() == t.data());  // view, then alias: still the same memory
    CHECK(back.shape() == t.shape());
    CHECK(back.dtype() == d);
    // A copy in torch's order of the transposed elements, for every dtype.
    Tensor copied = tt::from(a.t());
    CHECK(copied.dtype() == d);
    CHECK(copied.data() != t.data());
    CHECK(at::equal(tt::view(copied), a.t()));
  }
}

TEST_CASE("0-dimensional tensors keep their shape") {
  at::Tensor s = at::scalar_tensor(2.5, at::kFloat);
  Tensor t = tt::from(s);
  CHECK(t.ndim() == 0);
  CHECK(t.span<float>()[0] == 2.5f);
  CHECK(tt::view(t).dim() == 0);
}

TEST_CASE("a torch dtype twinkle cannot carry is refused by name, with the fix") {
  at::Tensor s = at::zeros({3}, at::kShort);
  try {
    (void)tt::from(s);
    FAIL("no error for int16");
  } catch (const twinkle::ValueError& e) {
    const std::string m = e.what();
    CHECK_THAT(m, Catch::Contains("Short"));
    CHECK_THAT(m, Catch::Contains(".to(torch::kFloat)"));
  }
  CHECK_THROWS_AS(tt::from(at::zeros({2}, at::kComplexFloat)), twinkle::ValueError);
  CHECK_THROWS_AS(tt::view(Tensor()), twinkle::ValueError);
  CHECK_THROWS_AS(tt::from(at::Tensor()), twinkle::ValueError);
}

TEST_CASE("collectives outside a worker say so") {
  // A host table without collectives, as the driver's.
  twk_host_v1 host{};
  host.size = sizeof host;
  twinkle::Communicator none(&host, nullptr, "dp");
  at::Tensor a = at::ones({2});
  CHECK_THROWS_WITH(tt::all_reduce(none, a), Catch::Contains("workers only"));
  // A parameter's gradient (a const handle) is passed as it is.
  at::Tensor w = at::ones({2}, at::kFloat).set_requires_grad(true);
  w.sum().backward();
  CHECK_THROWS_WITH(tt::all_reduce(none, w.grad()), Catch::Contains("workers only"));
}
