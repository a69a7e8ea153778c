// A whole Llama-family decoder layer as one operator, for the eager lean decoder's decode and verify steps: the
// operators it chains (RMSNorm, the rows kernel's products, rope_write_attend, SiLU(gate) * up) are the library's
// own, called directly, so a layer costs one call from Python instead of ten, and every number is the one the
// operator-by-operator path computes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "kernels.h"

namespace {

// x @ w.T (+ bias): an int8 weight-only matrix when it comes with a scale per output row, else float32 or bfloat16.
at::Tensor multiply(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                    const std::optional<at::Tensor>& bias) {
  return scale.has_value() ? specpipe::rows_mm_int8(x, w, *scale, bias) : specpipe::rows_mm(x, w, bias);
}

// x [T, d], the residual stream of n rows of W tokens each (T = n W, row after row) -> the stream after the layer.
// Each matrix is (weight, scale per output row for int8 weights, bias); cos/sin [T, d]; the KV pools, slots, block
// tables and mask as rope_write_attend takes them.
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& norm1, double eps1, const at::Tensor& qkv,
                         const std::optional<at::Tensor>& qkv_scale, const std::optional<at::Tensor>& qkv_bias,
                         const at::Tensor& o, const std::optional<at::Tensor>& o_scale,
                         const std::optional<at::Tensor>& o_bias, const at::Tensor& norm2, double eps2,
                         const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_scale,
                         const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
                         const std::optional<at::Tensor>& down_scale, const std::optional<at::Tensor>& down_bias,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor key, at::Tensor value,
                         const at::Tensor& slots, const at::Tensor& blocks, const at::Tensor& mask, int64_t heads,
                         double scale) {
  const at::Tensor fused = multiply(specpipe::rms_norm(x, norm1, eps1), qkv, qkv_scale, qkv_bias);
  const at::Tensor attended = specpipe::rope_write_attend(fused, cos, sin, key, value, slots, blocks, mask, heads,
                                                          scale);
  const at::Tensor mid = x + multiply(attended, o, o_scale, o_bias);
  const at::Tensor gated = specpipe::silu_mul(multiply(specpipe::rms_norm(mid, norm2, eps2), gate_up, gate_up_scale,
                                                      gate_up_bias));
  return mid + multiply(gated, down, down_scale, down_bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_rows, m) {
  m.def("decoder_layer(Tensor x, Tensor norm1, float eps1, Tensor qkv, Tensor? qkv_scale, Tensor? qkv_bias, "
        "Tensor o, Tensor? o_scale, Tensor? o_bias, Tensor norm2, float eps2, Tensor gate_up, "
        "Tensor? gate_up_scale, Tensor? gate_up_bias, Tensor down, Tensor? down_scale, Tensor? down_bias, "
        "Tensor cos, Tensor sin, Tensor(a!) key, Tensor(b!) value, Tensor slots, Tensor blocks, Tensor mask, "
        "int heads, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specpipe_rows, CPU, m) { m.impl("decoder_layer", decoder_layer); }
