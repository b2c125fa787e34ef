// scaled_dot_product_attention: a hand-computed case, a loop-by-loop reference, gradchecks
// (causal and not, 3-d and 4-d, T != S, non-contiguous), dropout, and the error cases.
#include <cmath>
#include <limits>

#include "core/ops/dispatch.h"
#include "core/rng.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

// Attention by plain loops over (G, T, D) values, G = all leading dims together.
std::vector<double> loop_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                   double scale) {
  const int n = q.dim();
  const std::int64_t t = q.shape()[n - 2], s = k.shape()[n - 2], d = q.shape()[n - 1],
                     dv = v.shape()[n - 1];
  const std::int64_t groups = q.numel() / (t * d);
  const std::vector<double> qv = q.to_vector(), kv = k.to_vector(), vv = v.to_vector();
  std::vector<double> out(groups * t * dv, 0.0);
  for (std::int64_t g = 0; g < groups; ++g) {
    for (std::int64_t i = 0; i < t; ++i) {
      std::vector<double> w(s, 0.0);
      double total = 0.0;
      for (std::int64_t j = 0; j < s; ++j) {
        if (causal && j > i) continue;
        double dot = 0.0;
        for (std::int64_t c = 0; c < d; ++c)
          dot += qv[(g * t + i) * d + c] * kv[(g * s + j) * d + c];
        w[j] = std::exp(dot * scale);
        total += w[j];
      }
      for (std::int64_t j = 0; j < s; ++j)
        for (std::int64_t c = 0; c < dv; ++c)
          out[(g * t + i) * dv + c] += w[j] / total * vv[(g * s + j) * dv + c];
    }
  }
  return out;
}

}  // namespace

TEST_CASE("attention by hand: two tokens, identity queries and keys") {
  Tensor q = from_vector({1, 0, 0, 1}, {1, 2, 2}, {.dtype = DType::f64});  // (B, T, D)
  Tensor v = from_vector({1, 2, 3, 4}, {1, 2, 2}, {.dtype = DType::f64});
  // Scores [[1, 0], [0, 1]] with scale 1: the matching key gets weight a = e / (1 + e).
  const double a = std::exp(1.0) / (1.0 + std::exp(1.0));
  check_close(scaled_dot_product_attention(q, q, v, {.causal = false, .scale = 1.0}),
              {a * 1 + (1 - a) * 3, a * 2 + (1 - a) * 4, (1 - a) * 1 + a * 3, (1 - a) * 2 + a * 4},
              1e-12, 1e-12, "non-causal");
  // Causal: token 0 sees only itself.
  check_close(scaled_dot_product_attention(q, q, v, {.causal = true, .scale = 1.0}),
              {1, 2, (1 - a) * 1 + a * 3, (1 - a) * 2 + a * 4}, 1e-12, 1e-12, "causal");
  // The default scale is 1 / sqrt(D): scores 1 / sqrt(2).
  const double b = std::exp(1 / std::sqrt(2.0)) / (1.0 + std::exp(1 / std::sqrt(2.0)));
  check_close(scaled_dot_product_attention(q, q, v, {.causal = false}).select(1, 0),
              {b * 1 + (1 - b) * 3, b * 2 + (1 - b) * 4}, 1e-12, 1e-12, "default scale");
}

TEST_CASE("attention matches a loop reference: 4-d and 3-d, causal or not, T != S") {
  struct Case {
    Shape q, k, v;
  };
  for (const Case& c :
       {Case{{2, 3, 4, 5}, {2, 3, 4, 5}, {2, 3, 4, 6}}, Case{{2, 3, 5}, {2, 4, 5}, {2, 4, 2}},
        Case{{1, 2, 4, 3}, {1, 2, 2, 3}, {1, 2, 2, 3}}}) {
    Tensor q = input(c.q, -1, 1, 1).detach(), k = input(c.k, -1, 1, 2).detach(),
           v = input(c.v, -1, 1, 3).detach();
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.q.back()));
    for (bool causal : {false, true}) {
      Tensor out = scaled_dot_product_attention(q, k, v, {.causal = causal});
      Shape expected = c.q;
      expected.back() = c.v.back();
      CHECK(out.shape() == expected);
      check_close(out, loop_attention(q, k, v, causal, scale), 1e-12, 1e-12,
                  causal ? "causal" : "non-causal");
    }
    check_close(scaled_dot_product_attention(q, k, v, {.causal = false, .scale = 0.3}),
                loop_attention(q, k, v, false, 0.3), 1e-12, 1e-12, "explicit scale");
  }
}

TEST_CASE("attention gradcheck: causal and non-causal, 3-d and 4-d, non-contiguous heads") {
  using V = std::vector<Tensor>;
  for (bool causal : {false, true}) {
    auto f = [causal](const V& in) {
      return scaled_dot_product_attention(in[0], in[1], in[2], {.causal = causal});
    };
    gradcheck(causal ? "sdpa causal 4-d" : "sdpa 4-d", f,
              {input({1, 2, 3, 4}, -1, 1, 11), input({1, 2, 3, 4}, -1, 1, 12),
               input({1, 2, 3, 4}, -1, 1, 13)});
    gradcheck(
        causal ? "sdpa causal 3-d, T != S" : "sdpa 3-d, T != S", f,
        {input({2, 2, 3}, -1, 1, 14), input({2, 4, 3}, -1, 1, 15), input({2, 4, 2}, -1, 1, 16)});
  }
  // As in a transformer: (B, T, H, D) leaves viewed as (B, H, T, D).
  Tensor q = input({1, 3, 2, 4}, -1, 1, 17), k = input({1, 3, 2, 4}, -1, 1, 18),
         v = input({1, 3, 2, 4}, -1, 1, 19);
  gradcheck("sdpa transposed heads",
            [](const V& in) {
              return scaled_dot_product_attention(in[0].transpose(1, 2), in[1].transpose(1, 2),
                                                  in[2].transpose(1, 2));
            },
            {q, k, v});
}

TEST_CASE(
    "attention with dropout: p = 1 gives zeros, a fixed seed gives a fixed result and gradient") {
  Tensor q = input({1, 2, 3, 4}, -1, 1, 21), k = input({1, 2, 3, 4}, -1, 1, 22),
         v = input({1, 2, 3, 4}, -1, 1, 23);
  check_close(scaled_dot_product_attention(q, k, v, {.dropout_p = 1.0}),
              std::vector<double>(24, 0.0), 0, 0, "p = 1");
  manual_seed(4);
  Tensor a = scaled_dot_product_attention(q, k, v, {.dropout_p = 0.5});
  manual_seed(4);
  check_close(scaled_dot_product_attention(q, k, v, {.dropout_p = 0.5}), a, 0, 0, "same seed");
  CHECK(a.to_vector() != scaled_dot_product_attention(q, k, v, {.dropout_p = 0.0}).to_vector());
  gradcheck("sdpa dropout",
            [](const std::vector<Tensor>& in) {
              manual_seed(5);
              return scaled_dot_product_attention(in[0], in[1], in[2], {.dropout_p = 0.3});
            },
            {q, k, v});
}

TEST_CASE("attention errors") {
  Tensor x = zeros({2, 3, 4, 5});
  check_throws_with(
      [] {
        scaled_dot_product_attention(zeros({4, 5}), zeros({4, 5}), zeros({4, 5}));
      },
      "[scaled_dot_product_attention] expected q of shape (B, H, T, D) or (B, T, D), got (4, 5)");
  check_throws_with(
      [&] {
        scaled_dot_product_attention(x, zeros({2, 4, 5}), x);
      },
      "[scaled_dot_product_attention] q (2, 3, 4, 5), k (2, 4, 5) and v (2, 3, 4, 5) must have "
      "the same number of dims");
  check_throws_with(
      [&] {
        scaled_dot_product_attention(x, zeros({2, 3, 4, 6}), x);
      },
      "[scaled_dot_product_attention] q and k head dims differ: q (2, 3, 4, 5) has D = 5, "
      "k (2, 3, 4, 6) has D = 6");
  check_throws_with(
      [&] {
        scaled_dot_product_attention(x, zeros({2, 3, 6, 5}), x);
      },
      "[scaled_dot_product_attention] k and v lengths differ: k (2, 3, 6, 5) has 6 keys, "
      "v (2, 3, 4, 5) has 4");
  check_throws_with(
      [&] {
        scaled_dot_product_attention(x, zeros({2, 1, 4, 5}), x);
      },
      "[scaled_dot_product_attention] batch and head dims differ");
  check_throws_with(
      [&] {
        scaled_dot_product_attention(x, x, zeros({2, 3, 4, 5}, {.dtype = DType::f64}));
      },
      "[scaled_dot_product_attention] q, k and v dtypes differ: f32, f32, f64");
  check_throws_with([&] { scaled_dot_product_attention(x, x, x, {.dropout_p = 1.5}); },
                    "[scaled_dot_product_attention] dropout_p must be in [0, 1], got 1.5");
  check_throws_with(
      [] {
        Tensor i = zeros({1, 2, 3}, {.dtype = DType::i64});
        scaled_dot_product_attention(i, i, i);
      },
      "[scaled_dot_product_attention] expected a floating-point");
}

TEST_CASE("attention on the meta device: shapes only") {
  const TensorOptions meta{.device = kMeta};
  CHECK(scaled_dot_product_attention(empty({2, 4, 8, 16}, meta), empty({2, 4, 8, 16}, meta),
                                     empty({2, 4, 8, 16}, meta))
            .shape() == Shape{2, 4, 8, 16});
}

TEST_CASE("meta mirroring CUDA: the fused attention lays out out, dq, dk and dv as q, k and v lie") {
  // Note [Attention outputs where the inputs lie]: heads made as GPT makes them, (B, T, H, D) views
  // of one (B, T, 3C) projection transposed to (B, H, T, D), give an out whose transpose back is
  // dense (so the reshape to (B, T, C) is a view) and gradients that reach the (B, T, H, D) views
  // dense; heads given dense stay dense.
  MetaBackendGuard mirror(Backend::cuda);
  const std::int64_t B = 2, T = 8, H = 3, D = 16, C = H * D;
  for (DType dt : {DType::bf16, DType::f32}) {
    CAPTURE(std::string(dtype_name(dt)));
    const Tensor qkv = empty({B, T, 3 * C}, {.dtype = dt, .device = kMeta});
    std::vector<Tensor> bthd, heads;
    for (std::int64_t i = 0; i < 3; ++i) {
      // (B, T, H, D) views of the projection, strides (3CT, 3C, D, 1), as leaves.
      bthd.push_back(qkv.slice(2, i * C, (i + 1) * C).reshape({B, T, H, D}).detach().requires_grad_(true));
      heads.push_back(bthd.back().transpose(1, 2));
    }
    Tensor out = scaled_dot_product_attention(heads[0], heads[1], heads[2], {.causal = true});
    CHECK(out.shape() == Shape{B, H, T, D});
    CHECK(out.transpose(1, 2).is_contiguous());
    Tensor y = out.transpose(1, 2).reshape({B, T, C});
    CHECK(y.same_storage(out));  // a view, no copy
    const std::vector<Tensor> grads = grad({sum(y)}, {Tensor()}, bthd);
    for (std::size_t i = 0; i < grads.size(); ++i) {
      REQUIRE(grads[i].defined());
      CHECK(grads[i].shape() == Shape{B, T, H, D});
      // dq, dk, dv were written as q, k and v lie: the three (B, T, H, D) slices of one
      // (B, T, 3C) buffer (Note [Pieces that tile their input]).
      CHECK(grads[i].strides() == bthd[i].strides());
      CHECK(grads[i].same_storage(grads[0]));
    }
    // Heads that are (B, T, H, D)-dense each, not pieces of one buffer, get dense gradients.
    std::vector<Tensor> own;
    for (int i = 0; i < 3; ++i) {
      own.push_back(empty({B, T, H, D}, {.dtype = dt, .device = kMeta}).requires_grad_(true));
    }
    Tensor y2 = scaled_dot_product_attention(own[0].transpose(1, 2), own[1].transpose(1, 2),
                                             own[2].transpose(1, 2), {.causal = true});
    for (const Tensor& g : grad({sum(y2)}, {Tensor()}, own)) CHECK(g.is_contiguous());
    // Dense heads stay dense.
    Tensor q = empty({B, H, T, D}, {.dtype = dt, .device = kMeta});
    CHECK(scaled_dot_product_attention(q, q, q).is_contiguous());
  }
}

TEST_CASE("meta mirroring CUDA: GPT-style heads get their gradient in one buffer, without a copy") {
  // Note [Pieces that tile their input]: q, k and v split from one (B, T, 3C) projection get dq,
  // dk and dv as the three slices of one (B, T, 3C) buffer, which split's backward hands on
  // whole. The backward then holds that one buffer (plus a few rows' statistics), where copying
  // would hold it twice over.
  MetaBackendGuard mirror(Backend::cuda);
  const std::int64_t B = 4, T = 64, H = 4, D = 32, C = H * D;
  const TensorOptions o{.dtype = DType::bf16, .device = kMeta};
  Tensor qkv = empty({B, T, 3 * C}, o).requires_grad_(true);
  const std::vector<Tensor> parts = split(qkv, C, 2);
  auto head = [&](int i) { return parts[i].reshape({B, T, H, D}).transpose(1, 2); };
  Tensor y = scaled_dot_product_attention(head(0), head(1), head(2), {.causal = true})
                 .transpose(1, 2)
                 .reshape({B, T, C});
  Tensor g = empty({B, T, C}, o);
  reset_peak_memory_stats(kMeta);
  const std::int64_t before = memory_stats(kMeta).allocated.current;
  const Tensor dqkv = grad({y}, {g}, {qkv})[0];
  const std::int64_t extra = memory_stats(kMeta).allocated.peak - before;
  const std::int64_t buffer = B * T * 3 * C * 2;
  INFO("peak above the start of the backward " << extra << ", one (B, T, 3C) buffer " << buffer);
  CHECK(dqkv.shape() == qkv.shape());
  CHECK(dqkv.is_contiguous());
  CHECK(extra >= buffer);
  CHECK(extra < buffer + buffer / 2);
  // Pieces that are not siblings (three separate tensors) keep one gradient each.
  Tensor q = empty({B, H, T, D}, o).requires_grad_(true), k = empty({B, H, T, D}, o).requires_grad_(true);
  const std::vector<Tensor> gs = grad({scaled_dot_product_attention(q, k, k)}, {empty({B, H, T, D}, o)}, {q, k});
  CHECK(gs[0].shape() == q.shape());
  CHECK(gs[1].shape() == k.shape());
}

TEST_CASE("split's backward takes gradients that tile the input whole, and copies otherwise") {
  // Note [Pieces that tile their input], on the CPU: pieces of one dense buffer come back as that
  // buffer; the same values in separate tensors are copied into a new one; both are right.
  Tensor a = input({4, 6}).detach().requires_grad_(true);
  const Tensor tile = input({4, 6}, -1, 1, 7).detach();
  const std::vector<Tensor> parts = split(a, 2, 1);
  const std::vector<Tensor> tile_parts = split(tile, 2, 1);  // views into tile
  const std::vector<Tensor> gs = grad(parts, tile_parts, {a});
  CHECK(gs[0].same_storage(tile));  // handed on whole
  check_close(gs[0], tile.to_vector(), 0, 0, "tiled gradient");
  std::vector<Tensor> copies;
  for (const Tensor& t : tile_parts) copies.push_back(t.contiguous());
  const std::vector<Tensor> gc = grad(split(a, 2, 1), copies, {a});
  CHECK_FALSE(gc[0].same_storage(tile));
  check_close(gc[0], tile.to_vector(), 0, 0, "copied gradient");
  // Out of order or with a gap: copied.
  const std::vector<Tensor> swapped = {tile_parts[1], tile_parts[0], tile_parts[2]};
  const std::vector<Tensor> gw = grad(split(a, 2, 1), swapped, {a});
  CHECK_FALSE(gw[0].same_storage(tile));
  CHECK(gw[0].slice(1, 0, 2).to_vector() == tile_parts[1].to_vector());
}
