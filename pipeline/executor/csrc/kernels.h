// The row kernels' operators that other operators of the library call directly (one C++ call, no dispatch).
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace specpipe {

at::Tensor rows_mm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
at::Tensor rows_mm_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const std::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& h);
at::Tensor rope_write_attend(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor key,
                             at::Tensor value, const at::Tensor& slots, const at::Tensor& blocks,
                             const at::Tensor& mask, int64_t heads, double scale);

}  // namespace specpipe
