// Attention over paged KV for few queries per row, in one call: each query reads its row's keys and values
// straight from the block pools through the row's block table (no gathered copy), in float32 whatever the pools'
// dtype. Built and loaded by native_attention.py; attention_choice.py measures it beside the torch kernels.
//
// query [n, heads, W, d]; key_pool/value_pool [blocks, block_size, kv_heads, d]; blocks [n, B] (padded with any
// block, which the mask hides); mask [n, 1, W, B * block_size] float32, additive. Query head h reads KV head
// h / (heads / kv_heads). One (row, KV head) per task, split over the intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// One key or value row as float32: 16-bit values are widened once per row and reused by every query of the group.
template <typename T>
inline const float* widened(const T* row, float* buffer, int64_t dim) {
  for (int64_t j = 0; j < dim; ++j) buffer[j] = static_cast<float>(row[j]);
  return buffer;
}

template <>
inline const float* widened<float>(const float* row, float*, int64_t) {
  return row;
}

template <>
inline const float* widened<c10::BFloat16>(const c10::BFloat16* row, float* buffer, int64_t dim) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  uint32_t* out = reinterpret_cast<uint32_t*>(buffer);
#pragma omp simd
  for (int64_t j = 0; j < dim; ++j) out[j] = static_cast<uint32_t>(bits[j]) << 16;  // bfloat16 is float's top half
  return buffer;
}

template <typename T>
void attend_rows(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                 const at::Tensor& blocks, const at::Tensor& mask, double scale, at::Tensor& out) {
  const int64_t rows = query.size(0), heads = query.size(1), width = query.size(2), dim = query.size(3);
  const int64_t block_size = key_pool.size(1), kv_heads = key_pool.size(2), nblocks = blocks.size(1);
  const int64_t length = nblocks * block_size, group = heads / kv_heads, queries = group * width;
  const T* q = query.data_ptr<T>();
  const T* k = key_pool.data_ptr<T>();
  const T* v = value_pool.data_ptr<T>();
  const int64_t* table = blocks.data_ptr<int64_t>();
  const float* m = mask.data_ptr<float>();
  T* o = out.data_ptr<T>();
  const float s = static_cast<float>(scale);
  // One task per (row, KV head): its query heads' queries read each of its key and value rows once.
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(queries * dim), scores(queries * length), acc(queries * dim), row(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, kh = task % kv_heads;
      for (int64_t i = 0; i < queries; ++i) {  // query i: head kh * group + i / width, slot i % width
        const T* src = q + ((r * heads + kh * group + i / width) * width + i % width) * dim;
        for (int64_t j = 0; j < dim; ++j) qf[i * dim + j] = static_cast<float>(src[j]) * s;
      }
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t block = table[r * nblocks + b];
        for (int64_t t = 0; t < block_size; ++t) {
          const int64_t p = b * block_size + t;
          const float* key = widened<T>(k + ((block * block_size + t) * kv_heads + kh) * dim, row.data(), dim);
          for (int64_t i = 0; i < queries; ++i) {
            const float* qi = qf.data() + i * dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < dim; ++j) dot += qi[j] * key[j];
            scores[i * length + p] = dot + m[(r * width + i % width) * length + p];
          }
        }
      }
      for (int64_t i = 0; i < queries; ++i) {
        float* si = scores.data() + i * length;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < length; ++p) top = si[p] > top ? si[p] : top;
        float total = 0.f;
        for (int64_t p = 0; p < length; ++p) {
          si[p] = std::exp(si[p] - top);
          total += si[p];
        }
        const float inv = 1.f / total;
        for (int64_t p = 0; p < length; ++p) si[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t block = table[r * nblocks + b];
        for (int64_t t = 0; t < block_size; ++t) {
          const int64_t p = b * block_size + t;
          const float* value = widened<T>(v + ((block * block_size + t) * kv_heads + kh) * dim, row.data(), dim);
          for (int64_t i = 0; i < queries; ++i) {
            const float weight = scores[i * length + p];
            if (weight == 0.f) continue;  // masked: exp underflowed to 0
            float* ai = acc.data() + i * dim;
#pragma omp simd
            for (int64_t j = 0; j < dim; ++j) ai[j] += weight * value[j];
          }
        }
      }
      for (int64_t i = 0; i < queries; ++i) {
        T* dst = o + ((r * heads + kh * group + i / width) * width + i % width) * dim;
        for (int64_t j = 0; j < dim; ++j) dst[j] = static_cast<T>(acc[i * dim + j]);
      }
    }
  });
}

at::Tensor paged_attend(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                        const at::Tensor& blocks, const at::Tensor& mask, double scale) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 4 && key_pool.dim() == 4, "paged_attend: CPU tensors "
              "query [n, heads, W, d] and pools [blocks, block_size, kv_heads, d]");
  TORCH_CHECK(query.size(1) % key_pool.size(2) == 0, "paged_attend: heads must be a multiple of kv_heads");
  TORCH_CHECK(mask.scalar_type() == at::kFloat && blocks.scalar_type() == at::kLong, "paged_attend: a float32 mask "
              "and long block tables");
  const auto q = query.contiguous();
  const auto kp = key_pool.contiguous();
  const auto vp = value_pool.contiguous();
  const auto bt = blocks.contiguous();
  const auto mk = mask.expand({query.size(0), 1, query.size(2), blocks.size(1) * key_pool.size(1)}).contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attend", [&] {
    attend_rows<scalar_t>(q, kp, vp, bt, mk, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specpipe_native, lib) {
  lib.def("paged_attend(Tensor query, Tensor key_pool, Tensor value_pool, Tensor blocks, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpipe_native, CPU, lib) {
  lib.impl("paged_attend", &paged_attend);
}
