// Decode attention over the paged KV cache: one query token per sequence, grouped-query
// heads, keys and values read in place through each sequence's block table. Replaces the
// gather copies, mask and scaled_dot_product_attention call of the torch path, whose
// fixed costs dominate at decode sizes; and the index_copy_ that writes the new K/V.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (softmax after subtracting the max): Cephes' expf, within 2 ulp.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 fx = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}
#endif

inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// p[i] = exp(p[i] - max); returns their sum.
float exp_shifted(float* p, int64_t n, float max) {
  float sum = 0;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(max)));
    _mm256_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    p[i] = std::exp(p[i] - max);
    sum += p[i];
  }
  return sum;
}

// One sequence, one KV head and the `group` query heads that share it.
void attend_group(const float* q, const float* k_cache, const float* v_cache, const int64_t* table, int64_t n,
                  int64_t kv_head, int64_t kv_heads, int64_t group, int64_t d, int64_t block_size, float scale,
                  float* out, std::vector<float>& scores) {
  scores.resize(group * n);
  for (int64_t t = 0; t < n; ++t) {
    const float* k = k_cache + ((table[t / block_size] * block_size + t % block_size) * kv_heads + kv_head) * d;
    for (int64_t g = 0; g < group; ++g) scores[g * n + t] = dot(q + g * d, k, d) * scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* p = scores.data() + g * n;
    const float inv_sum = 1.0f / exp_shifted(p, n, *std::max_element(p, p + n));
    float* o = out + g * d;
    std::fill(o, o + d, 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      const float* v = v_cache + ((table[t / block_size] * block_size + t % block_size) * kv_heads + kv_head) * d;
      const float w = p[t] * inv_sum;
      for (int64_t i = 0; i < d; ++i) o[i] += w * v[i];
    }
  }
}

}  // namespace

// out[b, h*d] = softmax(q[b, h] . K[b]^T * scale) V[b] for b < batch, with K[b], V[b] the
// first context_lens[b] tokens of the blocks in block_tables[b]. q rows are q_stride apart,
// each [heads, d] contiguous; the caches are one layer's [num_blocks, block_size, kv_heads, d].
// Returns 0, or -1 (computing nothing) if a table or length points outside the cache.
extern "C" int ladle_decode_attention(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                                      int64_t num_blocks, const int64_t* block_tables, int64_t max_blocks,
                                      const int64_t* context_lens, float* out, int64_t batch, int64_t heads,
                                      int64_t kv_heads, int64_t d, int64_t block_size, float scale, int threads) {
  const int64_t group = heads / kv_heads;
  int64_t tokens = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = context_lens[b];
    if (n < 1 || n > max_blocks * block_size) return -1;
    for (int64_t i = 0; i < (n + block_size - 1) / block_size; ++i)
      if (block_tables[b * max_blocks + i] < 0 || block_tables[b * max_blocks + i] >= num_blocks) return -1;
    tokens += n;
  }
  // Short contexts take microseconds: a second thread would cost more than it saves.
  if (tokens * kv_heads * d < (1 << 17)) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < batch * kv_heads; ++task) {
      const int64_t b = task / kv_heads, kv_head = task % kv_heads;
      attend_group(q + b * q_stride + kv_head * group * d, k_cache, v_cache, block_tables + b * max_blocks,
                   context_lens[b], kv_head, kv_heads, group, d, block_size, scale,
                   out + (b * heads + kv_head * group) * d, scores);
    }
  }
  return 0;
}

// cache[slots[t]] = rows[t] for t < count, for K and V: `width` floats per slot, source
// rows k_stride / v_stride apart. Returns 0, or -1 (writing nothing) if a slot is not in
// [0, num_slots).
extern "C" int ladle_write_kv(const float* k, int64_t k_stride, const float* v, int64_t v_stride, float* k_cache,
                              float* v_cache, int64_t num_slots, const int64_t* slots, int64_t count, int64_t width) {
  for (int64_t t = 0; t < count; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return -1;
  for (int64_t t = 0; t < count; ++t) {
    std::memcpy(k_cache + slots[t] * width, k + t * k_stride, width * sizeof(float));
    std::memcpy(v_cache + slots[t] * width, v + t * v_stride, width * sizeof(float));
  }
  return 0;
}
