// Attention over the paged KV cache, keys and values read in place through each sequence's
// block table (no gather copies, no masks), grouped-query heads served together.
//
// Decode: one query token per sequence. Replaces the torch path, whose fixed costs dominate
// at decode sizes; and the index_copy_ that writes the new K/V.
//
// Prompt rows, row-invariant (K/V in float32, bfloat16, or 8 bits with a scale per token and
// KV head): each query row is computed by
// the same sequence of operations whatever else shares the call (other rows of its chunk,
// other sequences, where its chunk began), so a prompt scored cold, from a cached prefix or
// inside any batch gives bit-identical outputs. Scoring, --deterministic and every decode
// step rely on it.

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {


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

// The first key a query at `keys` keys (its position + 1) attends to: keys - window under a
// sliding window, else 0.
inline int64_t first_key(int64_t keys, int64_t window) { return window > 0 ? std::max<int64_t>(0, keys - window) : 0; }

// One sequence, one KV head and the `group` query heads that share it: keys [lo, n). sinks: the
// group's logits that join each softmax's denominator and weigh no value (null: none).
void attend_group(const float* q, const float* k_cache, const float* v_cache, const int64_t* table, int64_t n,
                  int64_t lo, int64_t kv_head, int64_t kv_heads, int64_t group, int64_t d, int64_t block_size,
                  float scale, const float* sinks, float* out, std::vector<float>& scores) {
  scores.resize(group * n);
  for (int64_t t = lo; t < n; ++t) {
    const float* k = k_cache + ((table[t / block_size] * block_size + t % block_size) * kv_heads + kv_head) * d;
    for (int64_t g = 0; g < group; ++g) scores[g * n + t] = dot(q + g * d, k, d) * scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* p = scores.data() + g * n + lo;
    const float sink = sinks ? sinks[g] : -INFINITY;
    const float max = std::max(*std::max_element(p, p + n - lo), sink);
    const float inv_sum = 1.0f / (exp_shifted(p, n - lo, max) + std::exp(sink - max));
    float* o = out + g * d;
    std::fill(o, o + d, 0.0f);
    for (int64_t t = lo; t < n; ++t) {
      const float* v = v_cache + ((table[t / block_size] * block_size + t % block_size) * kv_heads + kv_head) * d;
      const float w = p[t - lo] * inv_sum;
      for (int64_t i = 0; i < d; ++i) o[i] += w * v[i];
    }
  }
}

}  // namespace

// out[b, h*d] = softmax(q[b, h] . K[b]^T * scale) V[b] for b < batch, with K[b], V[b] the
// first context_lens[b] tokens of the blocks in block_tables[b] (the last `window` of them, if
// window > 0: a sliding-window layer), and sinks[h] (if not null: gpt-oss's learned logit per head)
// in each softmax's denominator. q rows are q_stride apart,
// each [heads, d] contiguous; the caches are one layer's [num_blocks, block_size, kv_heads, d].
// Returns 0, or -1 (computing nothing) if a table or length points outside the cache.
extern "C" int ladle_decode_attention(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                                      int64_t num_blocks, const int64_t* block_tables, int64_t max_blocks,
                                      const int64_t* context_lens, float* out, int64_t batch, int64_t heads,
                                      int64_t kv_heads, int64_t d, int64_t block_size, float scale, int64_t window,
                                      const float* sinks, int threads) {
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
                   context_lens[b], first_key(context_lens[b], window), kv_head, kv_heads, group, d, block_size, scale,
                   sinks ? sinks + kv_head * group : nullptr, out + (b * heads + kv_head * group) * d, scores);
    }
  }
  return 0;
}

// cache[slots[t]] = rows[t] for t < count, for K and V: `width` elements of `elem` bytes per
// slot, source rows k_stride / v_stride elements apart. Returns 0, or -1 (writing nothing) if
// a slot is not in [0, num_slots).
extern "C" int ladle_write_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* k_cache,
                              void* v_cache, int64_t num_slots, const int64_t* slots, int64_t count, int64_t width,
                              int64_t elem) {
  for (int64_t t = 0; t < count; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return -1;
  const auto* ks = static_cast<const char*>(k);
  const auto* vs = static_cast<const char*>(v);
  for (int64_t t = 0; t < count; ++t) {
    std::memcpy(static_cast<char*>(k_cache) + slots[t] * width * elem, ks + t * k_stride * elem, width * elem);
    std::memcpy(static_cast<char*>(v_cache) + slots[t] * width * elem, vs + t * v_stride * elem, width * elem);
  }
  return 0;
}

namespace {

// Nearest e4m3 to x (|x| <= 448), ties to even, from x's bits.
uint8_t to_e4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint8_t sign = (bits >> 24) & 0x80;
  bits &= 0x7FFFFFFF;
  if (bits >= 0x43E00000) return sign | 0x7E;  // 448, the largest finite e4m3
  if (bits < 0x3C800000) {  // below 2^-6: subnormal, a multiple of 2^-9
    float magnitude;
    std::memcpy(&magnitude, &bits, sizeof magnitude);
    return sign | static_cast<uint8_t>(std::nearbyint(magnitude * 512.0f));  // 8 rounds up to 2^-6
  }
  const uint32_t rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20;  // 8 exponent + 3 mantissa bits
  return sign | static_cast<uint8_t>(rounded - (120 << 3));  // rebias the exponent: 127 -> 7
}

// One token's `d` values of one head: their scale (max |x| / qmax), and x / scale rounded.
template <bool kFp8>
float quantize_head(const float* x, int64_t d, uint8_t* q) {
  float absmax = 0;
  for (int64_t i = 0; i < d; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float qmax = kFp8 ? 448.0f : 127.0f;
  const float inv = absmax > 0 ? qmax / absmax : 0.0f;
  for (int64_t i = 0; i < d; ++i) {
    const float y = x[i] * inv;
    q[i] = kFp8 ? to_e4m3(y) : static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.0f, 127.0f)));
  }
  return absmax / qmax;
}

template <bool kFp8>
void write_quantized(const float* x, int64_t stride, uint8_t* cache, float* scales, const int64_t* slots,
                     int64_t count, int64_t kv_heads, int64_t d) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t h = 0; h < kv_heads; ++h)
      scales[slots[t] * kv_heads + h] = quantize_head<kFp8>(x + t * stride + h * d, d, cache + (slots[t] * kv_heads + h) * d);
}

}  // namespace

// The same for an 8-bit cache (int8, or fp8 e4m3 if fp8): float32 rows quantised per token and
// KV head, each head's scale into k_scales / v_scales [num_slots, kv_heads].
extern "C" int ladle_write_kv_quantized(const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                                        void* k_cache, void* v_cache, float* k_scales, float* v_scales,
                                        int64_t num_slots, const int64_t* slots, int64_t count, int64_t kv_heads,
                                        int64_t d, int fp8) {
  for (int64_t t = 0; t < count; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return -1;
  auto* kc = static_cast<uint8_t*>(k_cache);
  auto* vc = static_cast<uint8_t*>(v_cache);
  if (fp8) {
    write_quantized<true>(k, k_stride, kc, k_scales, slots, count, kv_heads, d);
    write_quantized<true>(v, v_stride, vc, v_scales, slots, count, kv_heads, d);
  } else {
    write_quantized<false>(k, k_stride, kc, k_scales, slots, count, kv_heads, d);
    write_quantized<false>(v, v_stride, vc, v_scales, slots, count, kv_heads, d);
  }
  return 0;
}

namespace {

constexpr int64_t kRowsPerTask = 16;  // at most this many query rows of one sequence and KV head per task

struct PromptTask {
  int64_t seq, kv_head, first_row, rows;
};

// s[j] = scale * (q . key j) for the 8 keys at k, key_stride apart. Each dot product is
// eight lane sums (fused multiply-adds over the dimensions, 8 at a time, in order) added in
// a fixed tree: it depends on q and the key alone, never on what is computed beside it.
template <typename KV>
void scores8(const float* q, const KV* k, int64_t key_stride, int64_t d, float scale, float* s) {
#ifdef __AVX2__
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qi = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qi, load8(k + j * key_stride + i), acc[j]);
  }
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                    _mm256_permute2f128_ps(s0123, s4567, 0x31));
  _mm256_storeu_ps(s, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
#else
  for (int j = 0; j < 8; ++j) {
    float acc = 0;
    for (int64_t i = 0; i < d; ++i) acc = std::fma(q[i], to_float(k[j * key_stride + i]), acc);
    s[j] = acc * scale;
  }
#endif
}

// The same for two query vectors and 4 keys (each key load serves both vectors): the same
// chain and the same tree per score, so the same bits as scores8.
template <typename KV>
void scores4x2(const float* q0, const float* q1, const KV* k, int64_t key_stride, int64_t d, float scale,
               float* s0, float* s1) {
#ifdef __AVX2__
  __m256 acc[8];  // vector 0 with keys 0-3, then vector 1 with keys 0-3
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 a = _mm256_loadu_ps(q0 + i), b = _mm256_loadu_ps(q1 + i);
    for (int j = 0; j < 4; ++j) {
      const __m256 kj = load8(k + j * key_stride + i);
      acc[j] = _mm256_fmadd_ps(a, kj, acc[j]);
      acc[4 + j] = _mm256_fmadd_ps(b, kj, acc[4 + j]);
    }
  }
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  const __m256 sums = _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                                  _mm256_permute2f128_ps(s0123, s4567, 0x31)),
                                    _mm256_set1_ps(scale));
  _mm_storeu_ps(s0, _mm256_castps256_ps128(sums));
  _mm_storeu_ps(s1, _mm256_extractf128_ps(sums, 1));
#else
  for (int j = 0; j < 4; ++j) {
    float a = 0, b = 0;
    for (int64_t i = 0; i < d; ++i) {
      a = std::fma(q0[i], to_float(k[j * key_stride + i]), a);
      b = std::fma(q1[i], to_float(k[j * key_stride + i]), b);
    }
    s0[j] = a * scale;
    s1[j] = b * scale;
  }
#endif
}

// p[j] = exp(p[j] - max) for j < n, p[j] = 0 up to the next multiple of 8; returns the sum,
// accumulated in 8 lanes in key order and then across lanes (fixed by n alone), plus
// exp(sink - max): a sink logit in the denominator, where max counts it too (-inf: none, adding 0).
float softmax_numerators(float* p, int64_t n, float sink) {
#ifdef __AVX2__
  __m256 maxes = _mm256_set1_ps(p[0]);  // a maximum is exact in any order
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) maxes = _mm256_max_ps(maxes, _mm256_loadu_ps(p + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, maxes);
  float max = std::max(*std::max_element(lanes, lanes + 8), sink);
  for (; i < n; ++i) max = std::max(max, p[i]);
  const __m256i first_lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)), first_lanes);
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
    const __m256 x = _mm256_and_ps(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(max)), live);
    const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_min_ps(x, _mm256_setzero_ps())), live);
    _mm256_storeu_ps(p + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  return hsum(acc) + std::exp(sink - max);
#else
  const float max = std::max(*std::max_element(p, p + n), sink);
  float sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - max));
  for (int64_t j = n; j % 8; ++j) p[j] = 0;
  return sum + std::exp(sink - max);
#endif
}

// o[0, 8 * W) += sum over the n keys of a block of w[j] * value j, key by key in order.
template <int W, typename KV>
void add_weighted_values(const float* w, const KV* v, int64_t value_stride, int64_t n, float* o) {
#ifdef __AVX2__
  __m256 acc[W];
  for (int c = 0; c < W; ++c) acc[c] = _mm256_loadu_ps(o + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 wj = _mm256_set1_ps(w[j]);
    for (int c = 0; c < W; ++c) acc[c] = _mm256_fmadd_ps(wj, load8(v + j * value_stride + 8 * c), acc[c]);
  }
  for (int c = 0; c < W; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
#else
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < 8 * W; ++i) o[i] = std::fma(w[j], to_float(v[j * value_stride + i]), o[i]);
#endif
}

// The same over all d (a multiple of 8) dimensions, 64 at a time (8 registers of sums).
template <typename KV>
void add_weighted_values(const float* w, const KV* v, int64_t value_stride, int64_t n, int64_t d, float* o) {
  int64_t i = 0;
  for (; i + 64 <= d; i += 64) add_weighted_values<8, KV>(w, v + i, value_stride, n, o + i);
  switch ((d - i) / 8) {
    case 7: return add_weighted_values<7, KV>(w, v + i, value_stride, n, o + i);
    case 6: return add_weighted_values<6, KV>(w, v + i, value_stride, n, o + i);
    case 5: return add_weighted_values<5, KV>(w, v + i, value_stride, n, o + i);
    case 4: return add_weighted_values<4, KV>(w, v + i, value_stride, n, o + i);
    case 3: return add_weighted_values<3, KV>(w, v + i, value_stride, n, o + i);
    case 2: return add_weighted_values<2, KV>(w, v + i, value_stride, n, o + i);
    case 1: return add_weighted_values<1, KV>(w, v + i, value_stride, n, o + i);
    default: return;
  }
}

struct PromptScratch {
  std::vector<float> scores, acc, inv_sum, weights;
};

// An 8-bit cache's scales, one float per slot and KV head ([num_blocks, block_size, kv_heads]);
// both null for float caches.
struct KVScales {
  const float* k = nullptr;
  const float* v = nullptr;
};

// The d values of one KV head at each of a block's n slots (slot stride `stride`) into L2:
// the blocks of a sequence lie anywhere in the pool, so the hardware prefetcher cannot see
// the next one coming. A prefetch never faults and changes no arithmetic.
template <typename KV>
inline void prefetch_block(const KV* first, int64_t stride, int64_t n, int64_t d) {
  const int64_t bytes = d * int64_t(sizeof(KV));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < bytes; b += kCacheLine)
      __builtin_prefetch(reinterpret_cast<const char*>(first + j * stride) + b, 0, 2);
}

// One task: `rows` consecutive query rows of one sequence, all `group` query heads of one KV
// head. Scores for every row first (block by block, so a block's keys stay in L1 for all
// rows), then each row's softmax, then the values block by block. A row attends to keys
// [first_key, its position]: from 0, or its last `window` under a sliding window; the blocks
// below the first row's window are never read.
template <typename KV>
void attend_prompt_rows(const PromptTask& t, const float* q, int64_t q_stride, const KV* k_cache,
                        const KV* v_cache, KVScales scales, const int64_t* table, int64_t first_pos,
                        int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, float scale, int64_t window,
                        const float* sinks, float* out, int64_t out_stride, PromptScratch& scratch) {
  const int64_t group = heads / kv_heads, vectors = group * t.rows;
  const int64_t last_pos = first_pos + t.rows - 1;
  const int64_t blocks = last_pos / block_size + 1, width = blocks * block_size;
  const int64_t key_stride = kv_heads * d;
  const int64_t pitch = width + 8;  // a row's softmax from a key not 8-aligned zeroes up to 7 lanes past its last
  scratch.scores.resize(vectors * pitch);
  scratch.acc.assign(vectors * d, 0.0f);
  // vector v: row v / group, head kv_head * group + v % group
  auto query = [&](int64_t v) { return q + (t.first_row + v / group) * q_stride + (t.kv_head * group + v % group) * d; };
  auto keys_of = [&](int64_t v) { return first_pos + v / group + 1; };  // causal: keys [.., pos]
  auto lo_of = [&](int64_t v) { return first_key(keys_of(v), window); };
  const int64_t first_block = lo_of(0) / block_size;

  auto block_of = [&](const KV* cache, int64_t b) { return cache + (table[b] * block_size * kv_heads + t.kv_head) * d; };
  // the scale of slot j of block b is scales_of(...)[j * kv_heads]
  auto scales_of = [&](const float* s, int64_t b) { return s + table[b] * block_size * kv_heads + t.kv_head; };
  for (int64_t b = first_block; b < blocks; ++b) {
    const int64_t start = b * block_size;
    const KV* k = block_of(k_cache, b);
    if (b + 1 < blocks) prefetch_block(block_of(k_cache, b + 1), key_stride, block_size, d);
    const int64_t first_vector = std::max<int64_t>(0, start - first_pos) * group;  // rows that see this block
    auto scores = [&](int64_t v) { return scratch.scores.data() + v * pitch + start; };
    int64_t v = first_vector;
    for (; v + 1 < vectors; v += 2) {  // in pairs; v + 1 sees at least as many keys as v
      const int64_t n = std::min(block_size, keys_of(v + 1) - start);
      for (int64_t j = 0; j < n; j += 4)
        scores4x2(query(v), query(v + 1), k + j * key_stride, key_stride, d, scale, scores(v) + j, scores(v + 1) + j);
    }
    if (v < vectors)
      for (int64_t j = 0; j < std::min(block_size, keys_of(v) - start); j += 8)
        scores8(query(v), k + j * key_stride, key_stride, d, scale, scores(v) + j);
    if (scales.k) {  // each key's scale, after its dot product
      const float* ks = scales_of(scales.k, b);
      for (int64_t w = first_vector; w < vectors; ++w)
        for (int64_t j = 0; j < std::min(block_size, keys_of(w) - start); ++j) scores(w)[j] *= ks[j * kv_heads];
    }
  }
  scratch.inv_sum.resize(vectors);
  for (int64_t v = 0; v < vectors; ++v)
    scratch.inv_sum[v] = 1.0f / softmax_numerators(scratch.scores.data() + v * pitch + lo_of(v), keys_of(v) - lo_of(v),
                                                   sinks ? sinks[t.kv_head * group + v % group] : -INFINITY);
  for (int64_t b = first_block; b < blocks; ++b) {
    const int64_t start = b * block_size;
    const KV* values = block_of(v_cache, b);
    if (b + 1 < blocks) prefetch_block(block_of(v_cache, b + 1), key_stride, block_size, d);
    const int64_t first_vector = std::max<int64_t>(0, start - first_pos) * group;
    const float* vs = scales.v ? scales_of(scales.v, b) : nullptr;
    for (int64_t v = first_vector; v < vectors; ++v) {
      const int64_t j0 = std::max<int64_t>(0, lo_of(v) - start), n = std::min(block_size, keys_of(v) - start);
      if (n <= j0) continue;  // the block is below this row's window
      const float* w = scratch.scores.data() + v * pitch + start + j0;  // key j's weight is at key j
      if (vs) {  // each value's scale folded into its weight
        scratch.weights.resize(block_size);
        for (int64_t j = j0; j < n; ++j) scratch.weights[j - j0] = w[j - j0] * vs[j * kv_heads];
        w = scratch.weights.data();
      }
      add_weighted_values(w, values + j0 * key_stride, key_stride, n - j0, d, scratch.acc.data() + v * d);
    }
  }
  for (int64_t v = 0; v < vectors; ++v) {
    float* o = out + (t.first_row + v / group) * out_stride + (t.kv_head * group + v % group) * d;
    const float* a = scratch.acc.data() + v * d;
    for (int64_t i = 0; i < d; ++i) o[i] = a[i] * scratch.inv_sum[v];
  }
}

}  // namespace

// Causal attention for prompt rows. Sequence s owns rows [row_starts[s], row_starts[s] +
// row_counts[s]) of q and out, at absolute positions first_positions[s] onwards; each row
// attends to keys [0, its position] (its last `window` keys, if window > 0) of the blocks in
// block_tables[s], which must already hold this step's K/V; sinks[h], if not null, joins head h's
// softmax denominators (gpt-oss). q rows are q_stride apart, each [heads, d]; out rows out_stride apart.
// kv_type: 0 float32, 1 bfloat16, 2 int8, 3 fp8 e4m3 (the 8-bit ones with k_scales, v_scales).
// Returns 0; -1 (computing nothing) if a table or position points outside the cache; -2 if
// d or block_size is not a multiple of 8.
extern "C" int ladle_prompt_attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                                      int kv_type, const float* k_scales, const float* v_scales,
                                      int64_t num_blocks, const int64_t* block_tables,
                                      int64_t max_blocks, const int64_t* row_starts, const int64_t* row_counts,
                                      const int64_t* first_positions, float* out, int64_t out_stride,
                                      int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t d,
                                      int64_t block_size, float scale, int64_t window, const float* sinks,
                                      int threads) {
  if (d % 8 || block_size % 8) return -2;
  std::vector<PromptTask> tasks;
  int64_t work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t end = first_positions[s] + row_counts[s];
    if (first_positions[s] < 0 || row_counts[s] < 0 || end > max_blocks * block_size) return -1;
    for (int64_t i = 0; i < (end + block_size - 1) / block_size; ++i)
      if (block_tables[s * max_blocks + i] < 0 || block_tables[s * max_blocks + i] >= num_blocks) return -1;
    const int64_t parts = (row_counts[s] + kRowsPerTask - 1) / kRowsPerTask;  // rows split evenly
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t r0 = row_counts[s] * p / parts, r1 = row_counts[s] * (p + 1) / parts;
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({s, h, row_starts[s] + r0, r1 - r0});
    }
    work += row_counts[s] * end;
  }
  if (work * heads * d < (1 << 17)) threads = 1;
  // a sequence part's KV heads go to one thread together, unless there are fewer parts than
  // threads (a decode step of one sequence): then the heads are shared out
  const int64_t parts = static_cast<int64_t>(tasks.size()) / kv_heads;
  const int chunk = parts >= threads ? static_cast<int>(kv_heads) : 1;
  threads = static_cast<int>(std::clamp<int64_t>(static_cast<int64_t>(tasks.size()) / chunk, 1, threads));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    PromptScratch scratch;
#pragma omp for schedule(dynamic, chunk)
    for (size_t i = 0; i < tasks.size(); ++i) {
      const PromptTask& t = tasks[i];
      const int64_t first_pos = first_positions[t.seq] + (t.first_row - row_starts[t.seq]);
      const int64_t* table = block_tables + t.seq * max_blocks;
      auto attend = [&](auto* kv_type_tag, KVScales scales) {
        using KV = std::remove_const_t<std::remove_pointer_t<decltype(kv_type_tag)>>;
        attend_prompt_rows(t, q, q_stride, static_cast<const KV*>(k_cache), static_cast<const KV*>(v_cache), scales,
                           table, first_pos, heads, kv_heads, d, block_size, scale, window, sinks, out,
                           out_stride, scratch);
      };
      switch (kv_type) {
        case 1: attend(static_cast<uint16_t*>(nullptr), {}); break;
        case 2: attend(static_cast<int8_t*>(nullptr), {k_scales, v_scales}); break;
        case 3: attend(static_cast<fp8_e4m3*>(nullptr), {k_scales, v_scales}); break;
        default: attend(static_cast<float*>(nullptr), {}); break;
      }
    }
  }
  return 0;
}
