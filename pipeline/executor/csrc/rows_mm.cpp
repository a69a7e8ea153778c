// out = x @ w.T (+ bias) for a forward of 1-16 rows on an x86-64 CPU with AVX-512 or AVX2 + FMA: every weight row
// is read once, for all of x's rows together, and each output is a float32 dot product whose order of additions is
// the same whatever the number of rows (so a token's result does not depend on its neighbours in the forward).
// Weights float32 or bfloat16 [N, K] with K a multiple of 16, x in the weights' dtype; or int8 weights with one
// scale per output row (quantize.py's weight-only layers), x float32 or bfloat16. Built by
// pipeline/executor/row_kernels.py with the flags of one instruction set (-mavx512f ... or -mavx2 -mfma), and
// SPECPIPE_DPBF16 defined where the CPU has AVX512_BF16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "lanes.h"

#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 16;

using specpipe::Lanes;

#if defined(__AVX512F__)
// Weight rows interleaved per pass: one (interleaving was measured only on an AVX2 CPU).
template <int M, typename W>
constexpr int block_rows() { return 1; }
#else
// Weight rows interleaved per pass, by input row count and weight type: as measured on an AMD EPYC (Zen 3), six
// float32 rows at once for one input row (a step over one model's matrices 13% faster), one row elsewhere
// (interleaving was slower from two input rows, and for the weights widened on load).
template <int M, typename W>
constexpr int block_rows() { return M == 1 && std::is_same<W, float>::value ? 6 : 1; }
#endif

// Accumulators per output, each over every S-th block of lanes along k: weights widened on load (bfloat16, int8)
// take two, so two multiply-adds are in flight where one chain of them would bind the loop (on the Zen 3 EPYC,
// int8 products over one model's matrices 20-25% faster, bfloat16 5%); float32 rows are bound by memory.
template <typename W>
constexpr int k_splits() { return std::is_same<W, float>::value ? 1 : 2; }

// out[m, n] for the NB weight rows n in [n0, n0 + NB); x float32 [M, K]. Each output is S accumulators, the j-th
// over the lane blocks j, j + S, ... in ascending order (a last partial group into the first), added in a fixed
// order and reduced by one fixed tree: the same additions whatever M and NB are.
template <int M, int NB, typename W>
inline void rows_block(const float* x, const W* w, float* out, int64_t K, int64_t N, int64_t n0) {
  constexpr int S = k_splits<W>();
  constexpr int64_t L = Lanes::kWidth;
  typename Lanes::V acc[NB][S][M];
#pragma GCC unroll 16
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 16
    for (int j = 0; j < S; ++j)
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[b][j][m] = Lanes::zero();
  int64_t k = 0;
  for (; k + S * L <= K; k += S * L) {
    typename Lanes::V a[NB][S];
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b)
#pragma GCC unroll 16
      for (int j = 0; j < S; ++j) a[b][j] = Lanes::load(w + (n0 + b) * K + k + j * L);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
      for (int j = 0; j < S; ++j) {
        typename Lanes::V xm = Lanes::load(x + m * K + k + j * L);
#pragma GCC unroll 16
        for (int b = 0; b < NB; ++b) acc[b][j][m] = Lanes::fma(a[b][j], xm, acc[b][j][m]);
      }
  }
  for (; k < K; k += L)
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      typename Lanes::V a = Lanes::load(w + (n0 + b) * K + k);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[b][0][m] = Lanes::fma(a, Lanes::load(x + m * K + k), acc[b][0][m]);
    }
#pragma GCC unroll 16
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      typename Lanes::V total = acc[b][0][m];
#pragma GCC unroll 16
      for (int j = 1; j < S; ++j) total = Lanes::add(total, acc[b][j][m]);
      out[m * N + n0 + b] = Lanes::sum(total);
    }
}

template <int M, typename W>
void rows(const float* x, const W* w, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NB = block_rows<M, W>();
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) rows_block<M, NB>(x, w, out, K, N, n);
  for (; n < n1; ++n) rows_block<M, 1>(x, w, out, K, N, n);
}

// Runs body(std::integral_constant<int, M>, begin, end) over the weight rows [0, N) split between the threads, M
// the row count as a compile-time constant (the kernels keep one accumulator register per row). Whole weight rows
// per thread: each output is one thread's sum, so the thread count does not change it.
template <typename Body>
void split_rows(int64_t M, int64_t N, const Body& body) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    switch (M) {
#define SPECPIPE_ROWS(i) case i: body(std::integral_constant<int, i>{}, begin, end); break;
      SPECPIPE_ROWS(1) SPECPIPE_ROWS(2) SPECPIPE_ROWS(3) SPECPIPE_ROWS(4) SPECPIPE_ROWS(5) SPECPIPE_ROWS(6)
      SPECPIPE_ROWS(7) SPECPIPE_ROWS(8) SPECPIPE_ROWS(9) SPECPIPE_ROWS(10) SPECPIPE_ROWS(11) SPECPIPE_ROWS(12)
      SPECPIPE_ROWS(13) SPECPIPE_ROWS(14) SPECPIPE_ROWS(15) SPECPIPE_ROWS(16)
#undef SPECPIPE_ROWS
    }
  });
}

#ifdef SPECPIPE_DPBF16
// bfloat16 weights and inputs on a CPU with AVX512_BF16: each instruction multiplies 32 pairs and adds them into
// 16 float32 lanes, half the instructions of widening to float32 first (which binds the loop past four rows).
template <int M>
void rows_bf16(const at::BFloat16* x, const at::BFloat16* w, float* out, int64_t K, int64_t N, int64_t n0,
               int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* row = w + n * K;
    __m512 acc[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh a = reinterpret_cast<__m512bh>(_mm512_loadu_si512(row + k));
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], a, reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + m * K + k)));
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) out[m * N + n] = _mm512_reduce_add_ps(acc[m]);
  }
}

#endif

// x [M, K] as float32: its own memory when it is float32 already, else a widened copy in ``copy``.
const float* as_float(const at::Tensor& x, std::vector<float>& copy) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rows kernels: float32 or bfloat16 inputs, got ", x.scalar_type());
  const at::BFloat16* p = x.data_ptr<at::BFloat16>();
  copy.resize(x.numel());
  for (int64_t i = 0; i < x.numel(); ++i) copy[i] = static_cast<float>(p[i]);
  return copy.data();
}

// An optional per-output vector (a scale or a bias) as float32 contiguous: itself when it is (row_kernels.py passes
// them so, made once), else a copy.
at::Tensor floats(const std::optional<at::Tensor>& v) {
  if (!v.has_value()) return at::Tensor();
  if (v->scalar_type() == at::kFloat && v->is_contiguous()) return *v;
  return v->to(at::kFloat).contiguous();
}

// After the float32 sums of the weight rows [begin, end): each output times its row's scale (when given), plus its
// bias (when given), rounded once to O, the inputs' dtype. In the same loop as the sums, while they are in the cache.
template <typename O>
inline void finish(const float* sums, O* out, const float* scale, const float* bias, int64_t M, int64_t N,
                   int64_t begin, int64_t end) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = begin; n < end; ++n) {
      float v = sums[m * N + n];
      if (scale != nullptr) v *= scale[n];
      if (bias != nullptr) v += bias[n];
      out[m * N + n] = static_cast<O>(v);
    }
}

// x [M, K] (float32 or bfloat16) @ w.T (* scale) (+ bias) for weights [N, K] that Lanes::load reads as float32 (their
// type picks the load: float32, bfloat16 or int8); the sums float32, the result in x's dtype. ``sum_rows(m, xp, sums,
// begin, end)`` computes the sums of weight rows [begin, end) for m rows of float32 inputs xp.
template <typename SumRows>
at::Tensor product(const at::Tensor& x_in, int64_t N, const std::optional<at::Tensor>& scale_in,
                   const std::optional<at::Tensor>& bias_in, const SumRows& sum_rows) {
  const at::Tensor x = x_in.contiguous(), scale = floats(scale_in), bias = floats(bias_in);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const bool wide = x.scalar_type() == at::kFloat;
  // float32 outputs take their sums in place; bfloat16 ones from a float32 buffer
  std::vector<float> widened, buffer(wide ? 0 : M * N);
  const float* xp = as_float(x, widened);
  float* sums = wide ? out.data_ptr<float>() : buffer.data();
  const float* sp = scale.defined() ? scale.data_ptr<float>() : nullptr;
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  split_rows(M, N, [&](auto m, int64_t begin, int64_t end) {
    sum_rows(m, xp, sums, begin, end);
    if (wide) {
      if (sp != nullptr || bp != nullptr) finish(sums, sums, sp, bp, M, N, begin, end);
    } else {
      finish(sums, out.data_ptr<at::BFloat16>(), sp, bp, M, N, begin, end);
    }
  });
  return out;
}

// The sums of weight rows [begin, end) by the rows kernel, for weights of type W.
template <typename W>
auto widened_sums(const W* w, int64_t K, int64_t N) {
  return [=](auto m, const float* xp, float* sums, int64_t begin, int64_t end) {
    rows<decltype(m)::value>(xp, w, sums, K, N, begin, end);
  };
}

}  // namespace

namespace specpipe {

at::Tensor rows_mm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "rows_mm: x [M, K] and w [N, K], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "rows_mm: 1 to ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(w.size(1) % 16 == 0 && w.is_contiguous() && w.device().is_cpu() && x.device().is_cpu(),
              "rows_mm: a contiguous CPU weight whose rows are a multiple of 16 long");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rows_mm: x and w of one dtype");
  const int64_t K = x.size(1), N = w.size(0);
  if (w.scalar_type() == at::kFloat) return product(x, N, std::nullopt, bias, widened_sums(w.data_ptr<float>(), K, N));
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "rows_mm: float32 or bfloat16 weights, got ", w.scalar_type());
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
#ifdef SPECPIPE_DPBF16
  if (K % 32 == 0) {
    const at::Tensor xc = x.contiguous();
    const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
    // the pairs instruction reads the bfloat16 inputs themselves, not their float32 copy
    return product(xc, N, std::nullopt, bias, [=](auto m, const float*, float* sums, int64_t begin, int64_t end) {
      rows_bf16<decltype(m)::value>(xp, wp, sums, K, N, begin, end);
    });
  }
#endif
  return product(x, N, std::nullopt, bias, widened_sums(wp, K, N));
}

// out = (x @ q.T) * scale (+ bias) for int8 weights q [N, K] (K a multiple of 16) and scale [N]: the products are
// of the exact integers, each sum in float32 as for float32 weights, then scaled; the output in x's dtype.
at::Tensor rows_mm_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1) && scale.numel() == q.size(0),
              "rows_mm_int8: x [M, K], q [N, K] and scale [N], got ", x.sizes(), ", ", q.sizes(), " and ",
              scale.sizes());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "rows_mm_int8: 1 to ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(q.scalar_type() == at::kChar && q.size(1) % 16 == 0 && q.is_contiguous() && q.device().is_cpu() &&
              x.device().is_cpu(), "rows_mm_int8: a contiguous CPU int8 weight whose rows are a multiple of 16 long");
  return product(x, q.size(0), scale, bias, widened_sums(q.data_ptr<int8_t>(), q.size(1), q.size(0)));
}

}  // namespace specpipe

namespace {

// How many threads split_rows's loop runs on for n weight rows: at::parallel_for is inline in ATen's headers, so a
// library built without OpenMP runs it on one thread whatever torch's setting (what the build's test checks).
int64_t threads(int64_t n) {
  std::atomic<int> most{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    int mine = at::get_thread_num() + 1;
    int seen = most.load();
    while (mine > seen && !most.compare_exchange_weak(seen, mine)) {
    }
  });
  return most.load();
}

}  // namespace

TORCH_LIBRARY(specpipe_rows, m) {
  m.def("rows_mm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("rows_mm_int8(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor");
  m.def("threads(int n) -> int");
}
TORCH_LIBRARY_IMPL(specpipe_rows, CPU, m) {
  m.impl("rows_mm", specpipe::rows_mm);
  m.impl("rows_mm_int8", specpipe::rows_mm_int8);
}
TORCH_LIBRARY_IMPL(specpipe_rows, CompositeExplicitAutograd, m) { m.impl("threads", threads); }
