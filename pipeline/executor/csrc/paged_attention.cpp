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
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "lanes.h"
#include "rope.h"
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
  int64_t query_stride;  // elements from one token's query heads to the next token's
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
    const T* qp = query + (row * s.width + slot) * s.query_stride + head * s.dim;
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
  // per query of the tile: its scores, its softmax weights, its largest score
  std::vector<float> tile_scores(queries * kTile), tile_weights(queries * kTile), bests(queries);
  // Where key j of the row lies in the pools (its value lies at the same offset)
  const auto offset = [&](int64_t j) {
    return ((table_row[j / s.block_size] * s.block_size + j % s.block_size) * s.kv_heads + kv) * s.dim;
  };
  const int64_t lines = (s.dim * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  // bfloat16 keys and values read by several queries are widened to float32 once per tile (exactly), not once per
  // query: widening is two operations per lanes-full, as many as the multiply-add that uses it. From four queries:
  // for fewer, storing the widened tile costs about what it saves.
  constexpr bool kWidens = !std::is_same<T, float>::value;
  constexpr int64_t kWidenFrom = 4;
  const bool widen = kWidens && queries >= kWidenFrom;
  std::vector<float> wide(widen ? 2 * kTile * s.dim : 0);
  const float* kw[kTile];
  const float* vw[kTile];
  for (int64_t j0 = chunk * kChunk; j0 < end; j0 += kTile) {
    const int64_t tile = std::min(kTile, end - j0);
    for (int64_t u = 0; u < kTile; ++u) {  // a short last tile repeats its first key (its scores are "never")
      const int64_t at = offset(j0 + (u < tile ? u : 0));
      k[u] = keys + at;
      v[u] = values + at;
    }
    if (widen) {
      for (int64_t u = 0; u < kTile; ++u) {
        float* kd = wide.data() + u * s.dim;
        float* vd = wide.data() + (kTile + u) * s.dim;
        for (int64_t t = 0; t < s.dim; t += Lanes::kWidth) {
          Lanes::store(kd + t, Lanes::load(k[u] + t));
          Lanes::store(vd + t, Lanes::load(v[u] + t));
        }
        kw[u] = kd;
        vw[u] = vd;
      }
    }
    // The next tile's keys and values asked of memory now: a step's weights have pushed the pools out of the
    // caches, and each tile would otherwise wait for its loads before it computes
    for (int64_t j = j0 + kTile; j < std::min(end, j0 + 2 * kTile); ++j) {
      const char* key_row = reinterpret_cast<const char*>(keys + offset(j));
      const char* value_row = reinterpret_cast<const char*>(values + offset(j));
      for (int64_t line = 0; line < lines; ++line) {
        _mm_prefetch(key_row + 64 * line, _MM_HINT_T0);
        _mm_prefetch(value_row + 64 * line, _MM_HINT_T0);
      }
    }
    // keys kk and values vv of the tile: float32 or the pools' own type (Lanes::load widens on the way)
    const auto passes = [&](const auto* const* kk, const auto* const* vv) {
      // Three passes over the queries, each query's arithmetic the same as in one: the scores of all, then the
      // softmax weights of all, then the weighted values of all. Within a query each step waits on the one before
      // (sum, scale, maximum, exp, multiply-add); across queries they are independent, and passes let the CPU
      // overlap them.
      for (int64_t i = 0; i < queries; ++i) {
        // The tile's scores: independent dot products side by side (one would wait on its own multiply-adds)
        typename Lanes::V dots[kTile];
#pragma GCC unroll 8
        for (int64_t u = 0; u < kTile; ++u) dots[u] = Lanes::zero();
        const float* qi = q.data() + i * s.dim;
        for (int64_t t = 0; t < s.dim; t += Lanes::kWidth) {
          const typename Lanes::V qv = Lanes::load(qi + t);
#pragma GCC unroll 8
          for (int64_t u = 0; u < kTile; ++u) dots[u] = Lanes::fma(qv, Lanes::load(kk[u] + t), dots[u]);
        }
        float* scores = tile_scores.data() + i * kTile;
        specpipe::sums8(dots, scores);
        float best = kNone;
        if (tile == kTile) {
          best = specpipe::scaled_scores8(scores, m[i] + j0, s.scale, kNever);
        } else {
          for (int64_t u = 0; u < kTile; ++u) {
            const float bias = u < tile ? m[i][j0 + u] : kNever;
            scores[u] = bias <= kNever ? kNone : scores[u] * s.scale + bias;  // "never": its weight is 0
            best = std::max(best, scores[u]);
          }
        }
        bests[i] = best;
      }
      for (int64_t i = 0; i < queries; ++i) {
        const float best = bests[i];
        if (best == kNone) continue;  // no key of this tile for this query
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
        float* weights = tile_weights.data() + i * kTile;
        specpipe::exp8(tile_scores.data() + i * kTile, top, weights);  // exp(score - top), 0 for "never"
#pragma GCC unroll 8
        for (int64_t u = 0; u < kTile; ++u) total += weights[u];
      }
      for (int64_t i = 0; i < queries; ++i) {
        if (bests[i] == kNone) continue;
        float* acc = part + i * stride;
        const float* weights = tile_weights.data() + i * kTile;
        typename Lanes::V weight[kTile];
#pragma GCC unroll 8
        for (int64_t u = 0; u < kTile; ++u) weight[u] = Lanes::set1(weights[u]);
        // Each lane of the sum adds the tile's keys in order; a short tile's extra keys weigh 0 (adding exactly 0)
        for (int64_t t = 0; t < s.dim; t += Lanes::kWidth) {
          typename Lanes::V sum = Lanes::load(acc + t);
#pragma GCC unroll 8
          for (int64_t u = 0; u < kTile; ++u) sum = Lanes::fma(weight[u], Lanes::load(vv[u] + t), sum);
          Lanes::store(acc + t, sum);
        }
      }
    };
    if (widen) {
      passes(kw, vw);
    } else {
      passes(k, v);
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

// The attention's shape from query [n, W, heads, d] (its heads' values may lie ``query_stride`` apart per token),
// the pools [blocks, block_size, kv_heads, d], the tables [n, B] and the mask [n, 1, W, B * block_size], checked.
Shape shape_of(int64_t n, int64_t width, int64_t heads, int64_t dim, int64_t query_stride, const at::Tensor& query,
               const at::Tensor& key, const at::Tensor& value, const at::Tensor& blocks, const at::Tensor& mask,
               double scale, const char* op) {
  TORCH_CHECK(key.dim() == 4 && key.sizes() == value.sizes() && blocks.dim() == 2,
              op, ": pools [blocks, block_size, kv_heads, d] and blocks [n, B]");
  const int64_t block_size = key.size(1), kv_heads = key.size(2), table = blocks.size(1);
  TORCH_CHECK(key.size(3) == dim && dim % Lanes::kWidth == 0 && heads % kv_heads == 0 && blocks.size(0) == n,
              op, ": head sizes a multiple of ", Lanes::kWidth, " and query heads a multiple of KV heads");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              op, ": query and pools of one dtype");
  TORCH_CHECK(mask.scalar_type() == at::kFloat && mask.numel() == n * width * table * block_size &&
              mask.is_contiguous(), op, ": a contiguous float32 mask [n, 1, W, B * block_size]");
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous() && blocks.scalar_type() == at::kLong &&
              blocks.is_contiguous(), op, ": contiguous pools and a contiguous long block table");
  const int64_t length = table * block_size;
  return Shape{width, heads, kv_heads, heads / kv_heads, dim, block_size, table, length,
               std::max<int64_t>(1, (length + kChunk - 1) / kChunk), static_cast<float>(scale), query_stride};
}

// query [n, W, heads, d]; key/value pools [blocks, block_size, kv_heads, d]; blocks [n, B] each row's block
// table; mask [n, 1, W, B * block_size] float32, additive (its lowest value: never attend). -> [n, W, heads, d].
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& blocks, const at::Tensor& mask, double scale) {
  TORCH_CHECK(query.dim() == 4, "paged_attention: query [n, W, heads, d]");
  const at::Tensor q = query.contiguous(), m = mask.contiguous(), b = blocks.contiguous();
  const int64_t heads = q.size(2), dim = q.size(3);
  const Shape shape = shape_of(q.size(0), q.size(1), heads, dim, heads * dim, q, key, value, b, m, scale,
                               "paged_attention");
  at::Tensor out = at::empty_like(q);
  specpipe::by_dtype(q, "paged_attention", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    attend(shape, q.size(0), q.data_ptr<T>(), key.data_ptr<T>(), value.data_ptr<T>(), b.data_ptr<int64_t>(),
           m.data_ptr<float>(), out.data_ptr<T>());
  });
  return out;
}

}  // namespace

namespace specpipe {

// A layer's attention for the eager lean decoder in one call. qkv [T, C]: the fused QKV product of n rows of W
// tokens each (T = n W, row after row), its query heads, then its key heads, then its value heads, d columns each
// (C at least (heads + 2 kv_heads) d). Rotates the query and key heads in place (cos/sin [T, d], as rope_), writes
// each token's key and value heads into the pools at its slot (slots [T]: block * block_size + offset), then
// attends as paged_attention over blocks [n, B] and mask [n, 1, W, B * block_size]. -> [T, heads * d].
at::Tensor rope_write_attend(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor key,
                             at::Tensor value, const at::Tensor& slots, const at::Tensor& blocks,
                             const at::Tensor& mask, int64_t heads, double scale) {
  const int64_t tokens = qkv.size(0), n = blocks.size(0), dim = cos.size(-1), kv_heads = key.size(2);
  specpipe::check_rope(qkv, cos, sin, heads + kv_heads, "rope_write_attend");
  TORCH_CHECK(n > 0 && tokens % n == 0 && (heads + 2 * kv_heads) * dim <= qkv.size(1),
              "rope_write_attend: qkv [n W, C] with C >= (heads + 2 kv_heads) d");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == tokens && slots.scalar_type() == at::kLong,
              "rope_write_attend: slots [T] long");
  const Shape shape = shape_of(n, tokens / n, heads, dim, qkv.stride(0), qkv, key, value, blocks, mask, scale,
                               "rope_write_attend");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous(), where = slots.contiguous();
  const int64_t capacity = key.size(0) * key.size(1), width = kv_heads * dim;
  const int64_t* slot = where.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "rope_write_attend: slot ", slot[t], " outside the pools");
  at::Tensor out = at::empty({tokens, heads * dim}, qkv.options());
  specpipe::by_dtype(qkv, "rope_write_attend", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    T* rows = qkv.data_ptr<T>();
    specpipe::rope_rows(rows, c.data_ptr<T>(), s.data_ptr<T>(), tokens, qkv.stride(0), heads + kv_heads, dim);
    T* keys = key.data_ptr<T>();
    T* values = value.data_ptr<T>();
    for (int64_t t = 0; t < tokens; ++t) {
      const T* k = rows + t * qkv.stride(0) + heads * dim;
      std::copy(k, k + width, keys + slot[t] * width);
      std::copy(k + width, k + 2 * width, values + slot[t] * width);
    }
    attend(shape, n, static_cast<const T*>(rows), static_cast<const T*>(keys), static_cast<const T*>(values),
           blocks.data_ptr<int64_t>(), mask.data_ptr<float>(), out.data_ptr<T>());
  });
  return out;
}

}  // namespace specpipe

TORCH_LIBRARY_FRAGMENT(specpipe_rows, m) {
  m.def("paged_attention(Tensor query, Tensor key, Tensor value, Tensor blocks, Tensor mask, float scale) -> Tensor");
  m.def("rope_write_attend(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) key, Tensor(c!) value, Tensor slots, "
        "Tensor blocks, Tensor mask, int heads, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specpipe_rows, CPU, m) {
  m.impl("paged_attention", paged_attention);
  m.impl("rope_write_attend", specpipe::rope_write_attend);
}
