// The float32 lanes of the instruction set the row kernels are built for (-mavx512f ... or -mavx2 -mfma): load
// float32, bfloat16 or int8 numbers as float32 (each exactly), multiply-add, and a sum whose order is fixed.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

namespace specpipe {

#if defined(__AVX512F__)
// Sixteen float32 lanes. A bfloat16 is the top half of a float32: widening is a shift.
struct Lanes {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const at::BFloat16* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V fma(V a, V b, V acc) { return _mm512_fmadd_ps(a, b, acc); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
// Eight float32 lanes (and sixteen registers).
struct Lanes {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const at::BFloat16* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static V load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V fma(V a, V b, V acc) { return _mm256_fmadd_ps(a, b, acc); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static float sum(V v) {  // a fixed tree: halves, then pairs
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
};
#else
#error "the row kernels need -mavx512f or -mavx2 -mfma"
#endif

}  // namespace specpipe
