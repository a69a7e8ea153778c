// The small per-token operations of a Llama-family layer as one operator each, for the eager lean decoder: RMSNorm,
// rotary positions over the query and key heads of the fused QKV output (in place), and SiLU(gate) * up. Each
// rounds as the torch expressions it replaces (pipeline/layer_math.py) do, to the model's dtype after every
// operation (built with -ffp-contract=off, so no multiply and add are fused); only the order of RMSNorm's sum of
// squares differs from aten's. Per token, so a token's result does not depend on its neighbours in the forward.
// Built with rows_mm.cpp by pipeline/executor/row_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#include "kernels.h"
#include "lanes.h"
#include "rope.h"

namespace {

using specpipe::by_dtype;
using specpipe::Lanes;
using specpipe::round_to;


template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t tokens, int64_t dim, float eps) {
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = x + t * dim;
      typename Lanes::V acc = Lanes::zero();
      int64_t i = 0;
      for (; i + Lanes::kWidth <= dim; i += Lanes::kWidth) {
        const typename Lanes::V v = Lanes::load(row + i);
        acc = Lanes::fma(v, v, acc);
      }
      float squares = Lanes::sum(acc);
      for (; i < dim; ++i) squares += static_cast<float>(row[i]) * static_cast<float>(row[i]);
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
      for (int64_t k = 0; k < dim; ++k)
        out[t * dim + k] = static_cast<T>(static_cast<float>(w[k]) * round_to<T>(static_cast<float>(row[k]) * scale));
    }
  });
}

}  // namespace

namespace specpipe {

// x [T, d], weight [d] of x's dtype: weight * (x * rsqrt(mean(x^2) + eps)), the statistics in float32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1) && x.scalar_type() ==
              weight.scalar_type(), "rms_norm: x [T, d] and a weight [d] of its dtype");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  by_dtype(x, "rms_norm", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rms_rows(xc.data_ptr<T>(), wc.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1), eps);
  });
  return out;
}

}  // namespace specpipe

namespace {

// qkv [T, C] (rows contiguous), cos/sin [T, d]: rotates the first ``heads`` heads of d columns of every row in place
// (the query and key heads of a fused QKV output; the value heads after them are left alone).
void rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  specpipe::check_rope(qkv, cos, sin, heads, "rope_");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  by_dtype(qkv, "rope_", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    specpipe::rope_rows(qkv.data_ptr<T>(), c.data_ptr<T>(), s.data_ptr<T>(), qkv.size(0), qkv.stride(0), heads,
                        cos.size(-1));
  });
}

template <typename T>
void silu_rows(const T* h, T* out, int64_t tokens, int64_t width) {
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = h + t * 2 * width;
      const T* up = gate + width;
      for (int64_t i = 0; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        out[t * width + i] = static_cast<T>(round_to<T>(g / (1.0f + std::exp(-g))) * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace

namespace specpipe {

// h [T, 2 I] (gate then up, as the fused gate/up product gives them) -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& h) {
  TORCH_CHECK(h.dim() == 2 && h.size(1) % 2 == 0, "silu_mul: h [T, 2 I]");
  const at::Tensor hc = h.contiguous();
  at::Tensor out = at::empty({h.size(0), h.size(1) / 2}, h.options());
  by_dtype(h, "silu_mul", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    silu_rows(hc.data_ptr<T>(), out.data_ptr<T>(), h.size(0), h.size(1) / 2);
  });
  return out;
}

}  // namespace specpipe

TORCH_LIBRARY_FRAGMENT(specpipe_rows, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("silu_mul(Tensor h) -> Tensor");
}
TORCH_LIBRARY_IMPL(specpipe_rows, CPU, m) {
  m.impl("rms_norm", specpipe::rms_norm);
  m.impl("rope_", rope_);
  m.impl("silu_mul", specpipe::silu_mul);
}
