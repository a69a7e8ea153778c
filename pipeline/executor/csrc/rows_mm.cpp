// out = x @ w.T (+ bias) for a forward of 1-16 rows on an x86-64 CPU with AVX-512 or AVX2 + FMA: every weight row
// is read once, for all of x's rows together, and each output is a float32 dot product whose order of additions is
// the same whatever the number of rows (so a token's result does not depend on its neighbours in the forward).
// Weights float32 or bfloat16 [N, K] with K a multiple of 16; x in the weights' dtype. Built by
// pipeline/executor/row_kernels.py with the flags of one instruction set (-mavx512f ... or -mavx2 -mfma), and
// SPECPIPE_DPBF16 defined where the CPU has AVX512_BF16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "lanes.h"

#include <type_traits>

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
// (interleaving was slower from two input rows, and for bfloat16, whose widening binds the loop).
template <int M, typename W>
constexpr int block_rows() { return M == 1 && std::is_same<W, float>::value ? 6 : 1; }
#endif

// out[m, n] for the NB weight rows n in [n0, n0 + NB); x float32 [M, K]. Each output is one accumulator over k in
// ascending order, then one fixed reduction, whatever M and NB are.
template <int M, int NB, typename W>
inline void rows_block(const float* x, const W* w, float* out, int64_t K, int64_t N, int64_t n0) {
  typename Lanes::V acc[NB][M];
#pragma GCC unroll 16
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[b][m] = Lanes::zero();
  for (int64_t k = 0; k < K; k += Lanes::kWidth) {
    typename Lanes::V a[NB];
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) a[b] = Lanes::load(w + (n0 + b) * K + k);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      typename Lanes::V xm = Lanes::load(x + m * K + k);
#pragma GCC unroll 16
      for (int b = 0; b < NB; ++b) acc[b][m] = Lanes::fma(a[b], xm, acc[b][m]);
    }
  }
#pragma GCC unroll 16
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) out[m * N + n0 + b] = Lanes::sum(acc[b][m]);
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

at::Tensor rows_mm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "rows_mm: x [M, K] and w [N, K], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "rows_mm: 1 to ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(w.size(1) % 16 == 0 && w.is_contiguous() && w.device().is_cpu() && x.device().is_cpu(),
              "rows_mm: a contiguous CPU weight whose rows are a multiple of 16 long");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rows_mm: x and w of one dtype");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  bool done = false;
#ifdef SPECPIPE_DPBF16
  if (w.scalar_type() == at::kBFloat16 && K % 32 == 0) {
    at::Tensor xc = x.contiguous();
    const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
    const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
    split_rows(M, N, [&](auto m, int64_t begin, int64_t end) {
      rows_bf16<decltype(m)::value>(xp, wp, o, K, N, begin, end);
    });
    done = true;
  }
#endif
  if (!done) {
    at::Tensor xf = x.to(at::kFloat).contiguous();
    const float* xp = xf.data_ptr<float>();
    auto widened = [&](const auto* wp) {  // the weights' type picks Lanes::load
      split_rows(M, N, [&](auto m, int64_t begin, int64_t end) {
        rows<decltype(m)::value>(xp, wp, o, K, N, begin, end);
      });
    };
    if (w.scalar_type() == at::kFloat) {
      widened(w.data_ptr<float>());
    } else {
      TORCH_CHECK(w.scalar_type() == at::kBFloat16, "rows_mm: float32 or bfloat16 weights, got ", w.scalar_type());
      widened(w.data_ptr<at::BFloat16>());
    }
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(specpipe_rows, m) { m.def("rows_mm(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(specpipe_rows, CPU, m) { m.impl("rows_mm", rows_mm); }
