// Rotary positions over the heads of a fused QKV output, rounded as pipeline/layer_math.py's torch expressions (to
// the model's dtype after every operation; the library is built with -ffp-contract=off, so no multiply and add are
// fused). Shared by the RoPE operator (layer_ops.cpp) and the attention that rotates before it writes the KV
// (paged_attention.cpp).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace specpipe {

// Rounds to T (a no-op for float).
template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

// Rotates the first ``heads`` heads of ``dim`` columns of each of ``tokens`` rows (``stride`` apart) of qkv:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product rounded; cos and sin [tokens, dim].
template <typename T>
void rope_rows(T* qkv, const T* cos, const T* sin, int64_t tokens, int64_t stride, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + t * stride + h * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          const float low = round_to<T>(round_to<T>(x1 * static_cast<float>(c[i])) +
                                        round_to<T>(-x2 * static_cast<float>(s[i])));
          const float high = round_to<T>(round_to<T>(x2 * static_cast<float>(c[i + half])) +
                                         round_to<T>(x1 * static_cast<float>(s[i + half])));
          x[i] = static_cast<T>(low);
          x[i + half] = static_cast<T>(high);
        }
      }
    }
  });
}

// Checks qkv [T, C] (contiguous rows) and cos/sin [T, d] of its dtype for rope_rows over ``heads`` heads.
inline void check_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                       const char* op) {
  const int64_t dim = cos.size(-1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
              cos.size(0) == qkv.size(0) && dim % 2 == 0 && heads * dim <= qkv.size(1),
              op, ": qkv [T, C] with contiguous rows, cos and sin [T, d], heads * d <= C");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && cos.scalar_type() == sin.scalar_type(),
              op, ": qkv, cos and sin of one dtype");
}

}  // namespace specpipe
