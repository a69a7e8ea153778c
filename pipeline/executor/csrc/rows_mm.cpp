// out = x @ w.T (+ bias) for a forward of 1-16 rows on a CPU with AVX-512: every weight row is read once, for all
// of x's rows together, and each output is a float32 dot product whose order of additions is the same whatever the
// number of rows (so a token's result does not depend on its neighbours in the forward). Weights float32 or
// bfloat16 [N, K] with K a multiple of 16; x in the weights' dtype. Built by pipeline/executor/row_kernels.py, with
// SPECPIPE_DPBF16 defined where the CPU has AVX512_BF16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <type_traits>

namespace {

constexpr int64_t kMaxRows = 16;

// Sixteen weights from w[0..16) as float32 lanes (a bfloat16 is the top half of a float32).
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const at::BFloat16* w) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// out[m, n] for the weight rows n in [n0, n1); x float32 [M, K].
template <int M, typename W>
void rows(const float* x, const W* w, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * K;
    __m512 acc[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __m512 a = load16(row + k);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + m * K + k), acc[m]);
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) out[m * N + n] = _mm512_reduce_add_ps(acc[m]);
  }
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
    auto widened = [&](const auto* wp) {  // the weights' type picks load16
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
