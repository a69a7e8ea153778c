// Eight float32 numbers at a time with AVX2 + FMA (which an AVX-512 build has too): the scores of a tile of keys as
// one vector of dot-product sums, and exp. The row kernels' paged attention runs its softmax on these.
#pragma once
#include <immintrin.h>

#include <limits>

#include "lanes.h"

namespace specpipe {

// out[u] = the sum of d[u]'s lanes, for eight accumulators: pairs added in a fixed tree (a 16-lane accumulator's
// halves first), so one sum is the same whichever accumulators share its tree.
inline void sums8(const Lanes::V d[8], float* out) {
  __m256 h[8];
  for (int u = 0; u < 8; ++u) {
#if defined(__AVX512F__)
    h[u] = _mm256_add_ps(_mm512_castps512_ps256(d[u]), _mm512_extractf32x8_ps(d[u], 1));
#else
    h[u] = d[u];
#endif
  }
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | the same of the upper halves]
  const __m256 p01 = _mm256_hadd_ps(h[0], h[1]), p23 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 p45 = _mm256_hadd_ps(h[4], h[5]), p67 = _mm256_hadd_ps(h[6], h[7]);
  const __m256 q0 = _mm256_hadd_ps(p01, p23), q1 = _mm256_hadd_ps(p45, p67);  // [s0 s1 s2 s3 | s0 s1 s2 s3]-halves
  const __m256 low = _mm256_permute2f128_ps(q0, q1, 0x20), high = _mm256_permute2f128_ps(q0, q1, 0x31);
  _mm256_storeu_ps(out, _mm256_add_ps(low, high));
}

// e^x in every lane, within a few units in the last place (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in
// r, times 2^n); 0 below -87 (where e^x leaves float32's normal range: a softmax weight of nothing).
inline __m256 exp_ps(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(exponent)), live);
}

// out[u] = e^(x[u] - top) (0 where x[u] is -infinity)
inline void exp8(const float* x, float top, float* out) {
  _mm256_storeu_ps(out, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x), _mm256_set1_ps(top))));
}

// A full tile's scores as the softmax takes them: scores[u] * scale + bias[u] (the product rounded before the sum),
// -infinity where bias[u] is at or below ``never`` (the mask's "never attend"); returns their maximum.
inline float scaled_scores8(float* scores, const float* bias, float scale, float never) {
  const __m256 b = _mm256_loadu_ps(bias);
  const __m256 blocked = _mm256_cmp_ps(b, _mm256_set1_ps(never), _CMP_LE_OQ);
  __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(scores), _mm256_set1_ps(scale)), b);
  v = _mm256_blendv_ps(v, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), blocked);
  _mm256_storeu_ps(scores, v);
  __m256 top = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
  top = _mm256_max_ps(top, _mm256_permute_ps(top, 0x4E));
  top = _mm256_max_ps(top, _mm256_permute_ps(top, 0xB1));
  return _mm256_cvtss_f32(top);
}

// e^x for one number, as exp8 computes it
inline float exp1(float x) { return _mm256_cvtss_f32(exp_ps(_mm256_set1_ps(x))); }

}  // namespace specpipe
