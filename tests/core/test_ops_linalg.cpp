#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

TEST_CASE("matmul forward values") {
  Tensor a = from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = from_vector({7, 8, 9, 10, 11, 12}, {3, 2});
  check_close(matmul(a, b), {58, 64, 139, 154}, 0, 0, "2-d");
  check_close(matmul(a.t(), a), {17, 22, 27, 22, 29, 36, 27, 36, 45}, 0, 0, "transposed view");
  check_close(matmul(from_vector({1, 2, 3}, {3}), b), {58, 64}, 0, 0, "1-d @ 2-d");
  CHECK(matmul(from_vector({1, 2, 3}, {3}), from_vector({1, 2, 3}, {3})).item() == 14);
}

TEST_CASE("matmul gradcheck: 2-d, batched, broadcast batch, 1-d, non-contiguous") {
  auto f = [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); };
  gradcheck("matmul 2-d", f, {input({3, 4}), input({4, 5}, -1, 1, 2)});
  gradcheck("matmul batched", f, {input({2, 3, 4}), input({2, 4, 5}, -1, 1, 2)});
  gradcheck("matmul broadcast batch", f, {input({2, 1, 3, 4}), input({3, 4, 2}, -1, 1, 2)});
  gradcheck("matmul (..., K) @ (K, N)", f, {input({2, 3, 4}), input({4, 2}, -1, 1, 2)});
  gradcheck("matmul 1-d", f, {input({4}), input({4, 3}, -1, 1, 2)});
  Tensor wt = input({5, 4}, -1, 1, 2).detach().t();  // a leaf with transposed strides
  wt.requires_grad_(true);
  gradcheck("matmul non-contiguous", f, {non_contiguous(input({3, 4})), wt});
}

TEST_CASE("linear gradcheck and errors") {
  auto f = [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); };
  gradcheck("linear", f, {input({2, 3, 4}), input({5, 4}, -1, 1, 2), input({5}, -1, 1, 3)});
  check_throws_with([] { matmul(zeros({4, 3}), zeros({5, 2})); }, "[matmul] inner dimensions differ: (4, 3) @ (5, 2)");
  check_throws_with([] { linear(zeros({2, 3}), zeros({4, 5})); }, "[linear]");
}

TEST_CASE("matmul in 16-bit accumulates in f32") {
  Tensor a = ones({1, 4096}, {.dtype = DType::bf16});
  Tensor b = full({4096, 1}, 1.0 / 64, {.dtype = DType::bf16});
  CHECK(matmul(a, b).item() == 64.0);
}
