// Attention for the few queries per row of a decode or verify forward, reading each row's keys and values where
// they lie in the paged KV pools (through its block table) instead of gathering copies of them first, with the
// query heads of one KV head sharing it (grouped-query attention). Scores, softmax and the weighted sum are float32
// whatever the pools' dtype (float32 or bfloat16), the softmax online over fixed chunks of keys (flash decoding):
// each key and value is read once per KV head for all the queries that read it. A query's output depends on its
// own row alone, and its sums run in the same order whatever the number of rows or threads. Built into the row
// kernels' library (pipeline/executor/row_kernels.py); attention_choice.py times it per query width as "paged".
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "lanes.h"
#include "vector_math.h"

namespace {

using specpipe::Lanes;

// Keys per task: a row's keys are split into chunks of this many (a fixed count, not one per thread, so the
// partial sums and their merge are the same whatever the thread count).
constexpr int64_t kChunk = 256;
constexpr int64_t kTile = 8;  // keys scored together (kChunk is a multiple)
constexpr float kNever = std::numeric_limits<float>::lowest();  // the mask's "never attend"
constexpr float kNone = -std::numeric_limits<float>::infinity();

struct Shape {
  int64_t width, heads, kv_heads, group, dim, block_size, table, length, chunks;
  float scale;
};

// One chunk of one row's keys for the group * W queries that read KV head ``kv``: each key and value is read once
// for all of them. Softmax online (a running maximum): part[q] = (sum of p * v over the chunk [dim], max, sum of p).
template <typename T>
void attend_chunk(const Shape& s, const T* query, const T* keys, const T* values, const int64_t* blocks,
                  const float* mask, int64_t row, int64_t kv, int64_t chunk, float* part) {
  const int64_t queries = s.group * s.width, stride = s.dim + 2;
  std::vector<float> q(queries * s.dim);
  std::vector<const float*> m(queries);
  for (int64_t i = 0; i < queries; ++i) {  // query i: head kv * group + i % group, slot i / group
    const int64_t head = kv * s.group + i % s.group, slot = i / s.group;
    const T* qp = query + ((row * s.width + slot) * s.heads + head) * s.dim;
    for (int64_t t = 0; t < s.dim; ++t) q[i * s.dim + t] = static_cast<float>(qp[t]);
    m[i] = mask + (row * s.width + slot) * s.length;
    float* p = part + i * stride;
    std::fill(p, p + s.dim, 0.0f);
    p[s.dim] = kNone;
    p[s.dim + 1] = 0.0f;
  }
  const int64_t* table_row = blocks + row * s.table;
  const int64_t end = std::min(s.length, (chunk + 1) * kChunk);
  const T* k[kTile];
  const T* v[kTile];
  alignas(32) float scores[kTile];
  alignas(32) float weights[kTile];
  for (int64_t j0 = chunk * kChunk; j0 < end; j0 += kTile) {
    const int64_t tile = std::min(kTile, end - j0);
    for (int64_t u = 0; u < kTile; ++u) {  // a short last tile repeats its first key (its scores are "never")
      const int64_t j = j0 + (u < tile ? u : 0), position = table_row[j / s.block_size] * s.block_size +
                                                            j % s.block_size;
      k[u] = keys + (position * s.kv_heads + kv) * s.dim;
      v[u] = values + (position * s.kv_heads + kv) * s.dim;
    }
    for (int64_t i = 0; i < queries; ++i) {
      // The tile's scores: independent dot products side by side (one would wait on its own multiply-adds)
      typename Lanes::V dots[kTile];
#pragma GCC unroll 8
      for (int64_t u = 0; u < kTile; ++u) dots[u] = Lanes::zero();
      const float* qi = q.data() + i * s.dim;
      for (int64_t t = 0; t < s.dim; t += Lanes::kWidth) {
        const typename Lanes::V qv = Lanes::load(qi + t);
#pragma GCC unroll 8
        for (int64_t u = 0; u < kTile; ++u) dots[u] = Lanes::fma(qv, Lanes::load(k[u] + t), dots[u]);
      }
      specpipe::sums8(dots, scores);
      float best = kNone;
      for (int64_t u = 0; u < kTile; ++u) {
        const float bias = u < tile ? m[i][j0 + u] : kNever;
        scores[u] = bias <= kNever ? kNone : scores[u] * s.scale + bias;  // "never": its weight is 0
        best = std::max(best, scores[u]);
      }
      if (best == kNone) continue;
      float* acc = part + i * stride;
      float& top = acc[s.dim];
      float& total = acc[s.dim + 1];
      if (best > top) {  // a new maximum: what was summed so far is rescaled to it
        const float shrink = top == kNone ? 0.0f : specpipe::exp1(top - best);
        if (total > 0.0f) {
          const typename Lanes::V c = Lanes::set1(shrink);
          for (int64_t t = 0; t < s.dim; t += Lanes::kWidth)
            Lanes::store(acc + t, Lanes::fma(c, Lanes::load(acc + t), Lanes::zero()));
        }
        total *= shrink;
        top = best;
      }
      specpipe::exp8(scores, top, weights);  // exp(score - top), 0 for "never"
      typename Lanes::V weight[kTile];
#pragma GCC unroll 8
      for (int64_t u = 0; u < kTile; ++u) {
        total += weights[u];
        weight[u] = Lanes::set1(weights[u]);
      }
      // Each lane of the sum adds the tile's keys in order; a short tile's extra keys weigh 0 (adding exactly 0)
      for (int64_t t = 0; t < s.dim; t += Lanes::kWidth) {
        typename Lanes::V sum = Lanes::load(acc + t);
#pragma GCC unroll 8
        for (int64_t u = 0; u < kTile; ++u) sum = Lanes::fma(weight[u], Lanes::load(v[u] + t), sum);
        Lanes::store(acc + t, sum);
      }
    }
  }
}

// The chunks' partial sums of one query, merged in chunk order, into its output.
template <typename T>
void merge(const Shape& s, const float* parts, int64_t queries, T* out) {
  const int64_t stride = s.dim + 2;
  float top = kNone;
  for (int64_t c = 0; c < s.chunks; ++c) top = std::max(top, parts[c * queries * stride + s.dim]);
  if (top == kNone) {  // no key to attend (a padding slot): zeros
    for (int64_t t = 0; t < s.dim; ++t) out[t] = static_cast<T>(0.0f);
    return;
  }
  std::vector<float> acc(s.dim, 0.0f);
  float total = 0.0f;
  for (int64_t c = 0; c < s.chunks; ++c) {
    const float* p = parts + c * queries * stride;
    if (p[s.dim] == kNone) continue;
    const float weight = specpipe::exp1(p[s.dim] - top);
    total += p[s.dim + 1] * weight;
    for (int64_t t = 0; t < s.dim; ++t) acc[t] += p[t] * weight;
  }
  for (int64_t t = 0; t < s.dim; ++t) out[t] = static_cast<T>(acc[t] / total);
}

template <typename T>
void attend(const Shape& s, int64_t n, const T* query, const T* keys, const T* values, const int64_t* blocks,
            const float* mask, T* out) {
  const int64_t queries = s.group * s.width, stride = s.dim + 2;
  // parts[row, kv, chunk, query, dim + 2]
  std::vector<float> parts(n * s.kv_heads * s.chunks * queries * stride);
  at::parallel_for(0, n * s.kv_heads * s.chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task % s.chunks, kv = (task / s.chunks) % s.kv_heads, row = task / (s.chunks * s.kv_heads);
      attend_chunk(s, query, keys, values, blocks, mask, row, kv, chunk, parts.data() + task * queries * stride);
    }
  });
  at::parallel_for(0, n * s.kv_heads * queries, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t i = index % queries, kv = (index / queries) % s.kv_heads, row = index / (queries * s.kv_heads);
      const int64_t head = kv * s.group + i % s.group, slot = i / s.group;
      const float* first = parts.data() + ((row * s.kv_heads + kv) * s.chunks * queries + i) * stride;
      merge(s, first, queries, out + ((row * s.width + slot) * s.heads + head) * s.dim);
    }
  });
}

// query [n, W, heads, d]; key/value pools [blocks, block_size, kv_heads, d]; blocks [n, B] each row's block
// table; mask [n, 1, W, B * block_size] float32, additive (its lowest value: never attend). -> [n, W, heads, d].
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& blocks, const at::Tensor& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && key.sizes() == value.sizes() && blocks.dim() == 2,
              "paged_attention: query [n, W, heads, d], pools [blocks, block_size, kv_heads, d], blocks [n, B]");
  const int64_t n = query.size(0), width = query.size(1), heads = query.size(2), dim = query.size(3);
  const int64_t block_size = key.size(1), kv_heads = key.size(2), table = blocks.size(1);
  TORCH_CHECK(key.size(3) == dim && dim % Lanes::kWidth == 0 && heads % kv_heads == 0 && blocks.size(0) == n,
              "paged_attention: head sizes a multiple of ", Lanes::kWidth, " and query heads a multiple of KV heads");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "paged_attention: query and pools of one dtype");
  TORCH_CHECK(mask.scalar_type() == at::kFloat && mask.numel() == n * width * table * block_size,
              "paged_attention: a float32 mask [n, 1, W, B * block_size]");
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous() && blocks.scalar_type() == at::kLong,
              "paged_attention: contiguous pools and a long block table");
  const at::Tensor q = query.contiguous(), b = blocks.contiguous(), m = mask.contiguous();
  at::Tensor out = at::empty_like(q);
  const int64_t length = table * block_size;
  const Shape shape{width, heads, kv_heads, heads / kv_heads, dim, block_size, table, length,
                    std::max<int64_t>(1, (length + kChunk - 1) / kChunk), static_cast<float>(scale)};
  if (q.scalar_type() == at::kFloat) {
    attend(shape, n, q.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(), b.data_ptr<int64_t>(),
           m.data_ptr<float>(), out.data_ptr<float>());
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_attention: float32 or bfloat16, got ", q.scalar_type());
    attend(shape, n, q.data_ptr<at::BFloat16>(), key.data_ptr<at::BFloat16>(), value.data_ptr<at::BFloat16>(),
           b.data_ptr<int64_t>(), m.data_ptr<float>(), out.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpipe_rows, m) {
  m.def("paged_attention(Tensor query, Tensor key, Tensor value, Tensor blocks, Tensor mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specpipe_rows, CPU, m) { m.impl("paged_attention", paged_attention); }
