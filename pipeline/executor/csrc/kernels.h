// The row kernels' operators that other operators of the library call directly (one C++ call, no dispatch), and
// what their sources share.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace specpipe {

// Calls f with a null pointer of t's element type (float32 or bfloat16), from which f takes its type.
template <typename F>
void by_dtype(const at::Tensor& t, const char* op, const F& f) {
  if (t.scalar_type() == at::kFloat) return f(static_cast<float*>(nullptr));
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16, got ", t.scalar_type());
  f(static_cast<at::BFloat16*>(nullptr));
}

at::Tensor rows_mm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
at::Tensor rows_mm_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const std::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& h);
at::Tensor rope_write_attend(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor key,
                             at::Tensor value, const at::Tensor& slots, const at::Tensor& blocks,
                             const at::Tensor& mask, int64_t heads, double scale);

}  // namespace specpipe
