// Attention over paged KV for few queries per row, in one call: each query reads its row's keys and values
// straight from the block pools through the row's block table (no gathered copy), in float32 whatever the pools'
// dtype. Built and loaded by native_attention.py; attention_choice.py measures it beside the torch kernels.
//
// query [n, heads, W, d]; key_pool/value_pool [blocks, block_size, kv_heads, d]; blocks [n, B] (padded with any
// block, which the mask hides); mask [n, 1, W, B * block_size] float32, additive. Query head h reads KV head
// h / (heads / kv_heads). One (row, head, query) per task, split over the intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
void attend_rows(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool,
                 const at::Tensor& blocks, const at::Tensor& mask, double scale, at::Tensor& out) {
  const int64_t rows = query.size(0), heads = query.size(1), width = query.size(2), dim = query.size(3);
  const int64_t block_size = key_pool.size(1), kv_heads = key_pool.size(2), nblocks = blocks.size(1);
  const int64_t length = nblocks * block_size, group = heads / kv_heads;
  const T* q = query.data_ptr<T>();
  const T* k = key_pool.data_ptr<T>();
  const T* v = value_pool.data_ptr<T>();
  const int64_t* table = blocks.data_ptr<int64_t>();
  const float* m = mask.data_ptr<float>();
  T* o = out.data_ptr<T>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, rows * heads * width, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(length), acc(dim), qf(dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / (heads * width), h = (item / width) % heads, w = item % width, kh = h / group;
      const T* qrow = q + item * dim;
      for (int64_t j = 0; j < dim; ++j) qf[j] = static_cast<float>(qrow[j]) * s;
      const float* mrow = m + (r * width + w) * length;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t b = 0; b < nblocks; ++b) {
        const T* kb = k + (table[r * nblocks + b] * block_size * kv_heads + kh) * dim;
        for (int64_t t = 0; t < block_size; ++t) {
          const T* krow = kb + t * kv_heads * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < dim; ++j) dot += qf[j] * static_cast<float>(krow[j]);
          const float x = dot + mrow[b * block_size + t];
          scores[b * block_size + t] = x;
          top = x > top ? x : top;
        }
      }
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t p = 0; p < length; ++p) {
        scores[p] = std::exp(scores[p] - top);
        total += scores[p];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < nblocks; ++b) {
        const T* vb = v + (table[r * nblocks + b] * block_size * kv_heads + kh) * dim;
        for (int64_t t = 0; t < block_size; ++t) {
          const float p = scores[b * block_size + t];
          if (p == 0.f) continue;
          const T* vrow = vb + t * kv_heads * dim;
          for (int64_t j = 0; j < dim; ++j) acc[j] += p * static_cast<float>(vrow[j]);
        }
      }
      T* orow = o + item * dim;
      const float inv = 1.f / total;
      for (int64_t j = 0; j < dim; ++j) orow[j] = static_cast<T>(acc[j] * inv);
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
