// Batched multi-LoRA (Punica's BGMV gather): each token row t whose adapter slot s is set adds
// that adapter's low-rank update to the base projection's output, in place,
//
//     y[t, cols[p] : cols[p + 1]] += (x[t] @ A[s, p]^T) @ B[s, p]^T       for each part p,
//
// for the P parts of a fused projection (qkv: 3, gate_up: 2), each with its own A [R, in] and
// B^T [R, out] (the scaling folded into B), of which the first ranks[s, p] rank rows count.
//
// Batch invariance: a row's arithmetic is one fixed sequence whatever else is in the batch.
// Each u[r] is 8 FMA chains, lane l over inputs i = l mod 8 in order (the tail stripe masked,
// not a scalar loop), added up by simd.h's hsum; each output column's delta is one FMA chain
// over r starting from zero, added to y once (y + (u @ B^T), peft's order). Tiles of several
// rank rows, columns and token rows only share loads: every (row, rank) and (row, column)
// keeps its own accumulator, so neither the tiling, the row's neighbours nor the thread count
// changes a bit. The avx512 build runs the same chains as the avx2 one (the same bits); the
// scalar build rounds each product before adding it (no FMA there), so its bits are its own.
//
// Rows are visited grouped by slot (a counting sort), so an adapter's A and B stay in cache
// across its rows, and up to four rows of a slot go together so each load of A or B serves them all.

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Token rows of one slot sharing each load of A and B. A slot's A (P * R rows of `in` floats,
// 110 KiB for qkv at rank 16 and in 576) streams from L2 once per group, so the group is as
// wide as the registers allow: with AVX2's 16 a tile holds 8 accumulators, with AVX-512's 32, 16.
constexpr int kRowGroup = 4;
// Multiply-adds below which waking a second core costs more than it saves.
constexpr int64_t kParallelMin = int64_t(1) << 18;

#ifdef __AVX2__
// Lanes [0, n) set (n in 1..7): the tail stripe's mask for maskload / maskstore.
inline __m256i tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// u[g * ldu + r] = dot(a[r * k ...], x[g]) for R rank rows and G token rows: one 8-lane
// accumulator per (r, g), stripes of 8 inputs in order (masked-off lanes load as zeros), then
// hsum; so a dot's bits do not depend on R or G.
template <int R, int G>
inline void dot_tile(const float* a, int64_t k, const float* const* x, float* u, int64_t ldu) {
  __m256 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 xv[G];
    for (int g = 0; g < G; ++g) xv[g] = _mm256_loadu_ps(x[g] + i);
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_loadu_ps(a + r * k + i);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm256_fmadd_ps(av, xv[g], acc[r][g]);
    }
  }
  if (i < k) {
    const __m256i mask = tail_mask(k - i);
    __m256 xv[G];
    for (int g = 0; g < G; ++g) xv[g] = _mm256_maskload_ps(x[g] + i, mask);
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_maskload_ps(a + r * k + i, mask);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm256_fmadd_ps(av, xv[g], acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) u[g * ldu + r] = hsum(acc[r][g]);
}

#if defined(__AVX512F__)
// AVX-512 runs the very same operations, two 8-lane chains to a register: the dots of rank rows
// r and r + 1 side by side (so each FMA does the work of two), the columns 16 at a time (each
// column's chain is its own lane whatever the width). The avx512 and avx2 builds agree bit for bit.
inline __m512 halves(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_zextpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// dot_tile<2 * Pairs, G>'s results, the rank rows in pairs.
template <int Pairs, int G>
inline void dot_pairs(const float* a, int64_t k, const float* const* x, float* u, int64_t ldu) {
  __m512 acc[Pairs][G];
  for (int q = 0; q < Pairs; ++q)
    for (int g = 0; g < G; ++g) acc[q][g] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m512 xv[G];
    for (int g = 0; g < G; ++g) {
      const __m256 v = _mm256_loadu_ps(x[g] + i);
      xv[g] = halves(v, v);
    }
    for (int q = 0; q < Pairs; ++q) {
      const __m512 av = halves(_mm256_loadu_ps(a + 2 * q * k + i), _mm256_loadu_ps(a + (2 * q + 1) * k + i));
      for (int g = 0; g < G; ++g) acc[q][g] = _mm512_fmadd_ps(av, xv[g], acc[q][g]);
    }
  }
  if (i < k) {
    const __m256i mask = tail_mask(k - i);
    __m512 xv[G];
    for (int g = 0; g < G; ++g) {
      const __m256 v = _mm256_maskload_ps(x[g] + i, mask);
      xv[g] = halves(v, v);
    }
    for (int q = 0; q < Pairs; ++q) {
      const __m512 av = halves(_mm256_maskload_ps(a + 2 * q * k + i, mask),
                               _mm256_maskload_ps(a + (2 * q + 1) * k + i, mask));
      for (int g = 0; g < G; ++g) acc[q][g] = _mm512_fmadd_ps(av, xv[g], acc[q][g]);
    }
  }
  for (int q = 0; q < Pairs; ++q)
    for (int g = 0; g < G; ++g) {
      alignas(64) float lanes[16];  // each half summed by the very hsum of dot_tile
      _mm512_store_ps(lanes, acc[q][g]);
      u[g * ldu + 2 * q] = hsum(_mm256_load_ps(lanes));
      u[g * ldu + 2 * q + 1] = hsum(_mm256_load_ps(lanes + 8));
    }
}

struct Vec {  // 16 columns
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static Mask mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
  static V load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(float* p, V v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
};
#else
struct Vec {  // 8 columns
  using V = __m256;
  using Mask = __m256i;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static Mask mask(int64_t n) { return tail_mask(n); }
  static V load(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static void store(float* p, V v, Mask m) { _mm256_maskstore_ps(p, m, v); }
};
#endif

// y[g][j] += sum_{r < n} u[g * ldu + r] * b[r * ldb + j] for C stripes of Vec::kLanes columns
// from column j and G token rows (b and y[g] point at the part's first column); Masked: one
// stripe, the lanes of `mask` only. Each column's delta is an FMA chain over r from zero,
// then one add into y.
template <int C, int G, bool Masked = false>
inline void update_tile(const float* b, int64_t ldb, int n, const float* u, int64_t ldu, float* const* y, int64_t j,
                        typename Vec::Mask mask = typename Vec::Mask()) {
  static_assert(!Masked || C == 1, "a masked tile is one stripe");
  constexpr int L = Vec::kLanes;
  typename Vec::V acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = Vec::zero();
  for (int r = 0; r < n; ++r) {
    typename Vec::V bv[C];
    for (int c = 0; c < C; ++c) bv[c] = Masked ? Vec::load(b + r * ldb + j, mask) : Vec::load(b + r * ldb + j + L * c);
    for (int g = 0; g < G; ++g) {
      const typename Vec::V ur = Vec::set1(u[g * ldu + r]);
      for (int c = 0; c < C; ++c) acc[g][c] = Vec::fma(ur, bv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      float* out = y[g] + j + L * c;
      if (Masked) Vec::store(out, Vec::add(Vec::load(out, mask), acc[g][c]), mask);
      else Vec::store(out, Vec::add(Vec::load(out), acc[g][c]));
    }
}

// One part's update for G rows of one slot: u = A_p x (n rank rows), then y[:, width] += u B_p^T.
template <int G>
void part(const float* a, const float* b, int64_t ldb, int n, int64_t k, int64_t width, const float* const* x,
          float* const* y, float* u, int64_t ldu, float*) {
  int r = 0;
#if defined(__AVX512F__)
  for (; r + 8 <= n; r += 8) dot_pairs<4, G>(a + r * k, k, x, u + r, ldu);
  for (; r + 2 <= n; r += 2) dot_pairs<1, G>(a + r * k, k, x, u + r, ldu);
#else
  constexpr int R = G <= 2 ? 4 : 2;  // R * G accumulators: 8 at most
  for (; r + R <= n; r += R) dot_tile<R, G>(a + r * k, k, x, u + r, ldu);
#endif
  for (; r < n; ++r) dot_tile<1, G>(a + r * k, k, x, u + r, ldu);
  constexpr int L = Vec::kLanes;
  constexpr int C = L == 16 || G <= 2 ? 4 : 2;  // stripes per tile: C * G accumulators
  int64_t j = 0;
  for (; j + L * C <= width; j += L * C) update_tile<C, G>(b, ldb, n, u, ldu, y, j);
  for (; j + L <= width; j += L) update_tile<1, G>(b, ldb, n, u, ldu, y, j);
  if (j < width) update_tile<1, G, true>(b, ldb, n, u, ldu, y, j, Vec::mask(width - j));
}
#else
// The same sums without AVX (and without FMA: a product is rounded before it is added): each
// u[r] in 8 interleaved partial sums (input i into sum i % 8, which SSE vectorises), added up
// in hsum's tree; each column's delta summed over r from zero in `delta` (width floats), then
// added to y once.
inline float dot8(const float* a, const float* x, int64_t k) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * x[i + l];
  for (int l = 0; i + l < k; ++l) acc[l] += a[i + l] * x[i + l];
  const float s0 = acc[0] + acc[4], s1 = acc[1] + acc[5], s2 = acc[2] + acc[6], s3 = acc[3] + acc[7];
  return (s0 + s2) + (s1 + s3);
}

template <int G>
void part(const float* a, const float* b, int64_t ldb, int n, int64_t k, int64_t width, const float* const* x,
          float* const* y, float* u, int64_t ldu, float* delta) {
  for (int r = 0; r < n; ++r)
    for (int g = 0; g < G; ++g) u[g * ldu + r] = dot8(a + r * k, x[g], k);
  for (int g = 0; g < G; ++g) {
    std::fill(delta, delta + width, 0.0f);
    for (int r = 0; r < n; ++r) {
      const float ur = u[g * ldu + r];
      for (int64_t j = 0; j < width; ++j) delta[j] += ur * b[r * ldb + j];
    }
    for (int64_t j = 0; j < width; ++j) y[g][j] += delta[j];
  }
}
#endif

}  // namespace

// y[t, :] (row stride out, in place) gets slot slots[t]'s update from x[t, :] (row stride ldx)
// for every row with slots[t] >= 0; a [S, parts * rank, in], bt [S, parts * rank, out] and
// ranks [S, parts] contiguous, cols [parts + 1]. Returns 0; or, having written nothing, -1 for
// a slot outside -1..S-1, -2 for a rank outside 0..rank, -3 for cols not rising within 0..out.
extern "C" int ladle_lora_add(const float* x, int64_t ldx, float* y, const int32_t* slots, const float* a,
                              const float* bt, const int32_t* ranks, const int64_t* cols, int64_t rows, int64_t in,
                              int64_t out, int64_t num_slots, int64_t parts, int64_t rank, int threads) {
  for (int64_t i = 0; i < num_slots * parts; ++i)
    if (ranks[i] < 0 || ranks[i] > rank) return -2;
  for (int64_t p = 0; p < parts; ++p)
    if (cols[p] < 0 || cols[p] > cols[p + 1] || cols[p + 1] > out) return -3;
  // Counting sort of the rows with an adapter by slot: order[first[s] .. first[s + 1]) are slot s's.
  std::vector<int64_t> first(num_slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    if (slots[t] < -1 || slots[t] >= num_slots) return -1;
    if (slots[t] >= 0) ++first[slots[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) first[s + 1] += first[s];
  const int64_t active = first[num_slots];
  if (active == 0) return 0;
  std::vector<int64_t> order(active), next(first.begin(), first.end() - 1);
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] >= 0) order[next[slots[t]]++] = t;
  // Units of work: up to kRowGroup consecutive rows of one slot, as [begin, end) of order.
  std::vector<int64_t> units;
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t i = first[s]; i < first[s + 1]; i += kRowGroup) units.push_back(i);
  units.push_back(active);
  const int64_t count = static_cast<int64_t>(units.size()) - 1;

  if (active * parts * rank * (in + out) < kParallelMin) threads = 1;
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, count)));
  const int64_t width = parts * rank;  // rank rows per slot
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef _OPENMP
    const int th = omp_get_thread_num(), team = omp_get_num_threads();
#else
    const int th = 0, team = 1;
#endif
    std::vector<float> u(static_cast<size_t>(kRowGroup * std::max<int64_t>(rank, 1)));
#ifdef __AVX2__
    float* delta = nullptr;
#else
    std::vector<float> delta_buffer(static_cast<size_t>(out));
    float* delta = delta_buffer.data();
#endif
    // A contiguous share of the units, so each thread walks its slots' rows in order.
    for (int64_t unit = count * th / team; unit < count * (th + 1) / team; ++unit) {
      const int64_t begin = units[unit], group = units[unit + 1] - begin;
      const int64_t s = slots[order[begin]];
      const float* xs[kRowGroup];
      float* ys[kRowGroup];
      for (int64_t g = 0; g < group; ++g) {
        xs[g] = x + order[begin + g] * ldx;
        ys[g] = y + order[begin + g] * out;
      }
      for (int64_t p = 0; p < parts; ++p) {
        const int n = ranks[s * parts + p];
        if (n == 0 || cols[p] == cols[p + 1]) continue;
        const float* ap = a + (s * width + p * rank) * in;
        const float* bp = bt + (s * width + p * rank) * out + cols[p];
        float* yp[kRowGroup];
        for (int64_t g = 0; g < group; ++g) yp[g] = ys[g] + cols[p];
        const int64_t w = cols[p + 1] - cols[p];
        switch (group) {
          case 4: part<4>(ap, bp, out, n, in, w, xs, yp, u.data(), rank, delta); break;
          case 3: part<3>(ap, bp, out, n, in, w, xs, yp, u.data(), rank, delta); break;
          case 2: part<2>(ap, bp, out, n, in, w, xs, yp, u.data(), rank, delta); break;
          default: part<1>(ap, bp, out, n, in, w, xs, yp, u.data(), rank, delta);
        }
      }
    }
  }
  return 0;
}
