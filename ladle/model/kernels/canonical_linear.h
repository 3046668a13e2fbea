// y[M, N] = x[M, K] @ W^T (+ bias) with one fixed reduction order per output element:
//
//     acc = 0;  for k in 0..K-1: acc = fma(x[m, k], w[n, k], acc);  y[m, n] = acc + bias[n]
//
// Vector lanes run across output columns and rows are independent accumulators, so
// blocking, threading, the number of rows in the call and the instruction set change
// only which elements are computed together, never the operations that produce one.
// A row therefore gets the same bits alone, in any batch and on AVX-512, AVX2 or the
// scalar path. Canonical sequences (scoring, --deterministic) rely on it.
//
// W is packed once at load into panels of 16 columns: panel p holds w[16p + j, k] at
// [p][k][j] (float32, bfloat16 bits or int8, columns past N zero), so the inner loop reads
// one contiguous line of W per k. int8 weights (weight-only quantisation) are widened to
// float exactly, and each output's sum is multiplied by its column's scale at the end:
// y[m, n] = acc * scale[n] + bias[n], the same operations on every path.
//
// 4-bit weights (values 0..15) are packed two to a byte, inputs 2t and 2t + 1 of a column in the
// low and high nibble of its byte at [p][t][j]: half the bytes, the same values, so the same bits.
//
// Grouped int8 weights (GGUF's Q8_0, Q4_0, Q4_1 blocks, GPTQ and AWQ layers) carry a scale,
// and optionally a minimum, per column and group of G inputs. Each group's chain starts at
// zero and is folded into the output's running sum:
//
//     acc = 0;  for each group g:  part = 0;  for k in g: part = fma(x[m, k], q[n, k], part)
//                                  acc = fma(part, scale[n, g], acc)
//                                  acc = fma(xsum[m, g], min[n, g], acc)      (with minimums)
//     y[m, n] = acc + bias[n]
//
// where xsum[m, g] is x's sum over the group, added in input order.

#pragma once

#include "widen.h"

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// An anonymous namespace on purpose: each source including this header instantiates only the
// weight types it dispatches (float and bf16 in canonical_linear.cpp, int8 and 4-bit in
// canonical_linear_quantized.cpp), so the two compile in parallel.
namespace {

// W is read from memory once per block of rows, so blocks are large: x rows up to this many
// bytes (they are read from L2/L3 as broadcasts while each W panel group sits in L2).
constexpr int64_t kRowBlockBytes = 8 << 20;

// W streams from memory (a model's weights do not stay in cache from one call to the next),
// so while the row tiles of one panel group run, they prefetch the next group into L2, each
// tile an equal share of its lines, spread evenly over its k loop. Spread, not issued in a burst
// at the loop's start: with two or more tiles a burst outran what memory serves and the next
// group's first tile waited on misses (benchmarks/canonical_rows.py on the EPYC Zen 3: 12 rows
// through a 0.5B model's layers in 57-60 ms spread, 64-87 ms in bursts; 24 rows 102-104 against
// 107-115; 4, 8 and 16 rows within the machine's noise).
struct Prefetch {
  const char* base = nullptr;
  int64_t lines = 0;
  int64_t per_step = 0;  // lines per step of the k loop, in 16.16 fixed point

  inline void step(int64_t i) const { steps(i, i + 1); }
  // The lines of steps [i, end) at once.
  inline void steps(int64_t i, int64_t end) const {
    const int64_t from = (i * per_step) >> 16, to = std::min(lines, (end * per_step) >> 16);
    for (int64_t j = from; j < to; ++j) __builtin_prefetch(base + j * kCacheLine, 0, 2);
  }
};

// Tile `index` of `tiles`'s share of the `bytes` at `next` (nullptr: nothing to fetch), over k steps.
inline Prefetch prefetch_share(const void* next, int64_t bytes, int64_t index, int64_t tiles, int64_t k) {
  if (next == nullptr || k == 0) return {};
  const int64_t lines = bytes / kCacheLine, share = (lines + tiles - 1) / tiles;
  const int64_t first = std::min(lines, index * share), mine = std::min(share, lines - first);
  return {static_cast<const char*>(next) + first * kCacheLine, mine, ((mine << 16) + k - 1) / k};
}

// Per-group scales (and minimums) of grouped weights, in the panels' layout: panel p's group g
// holds 16 values at (p * count + g) * 16, float32 or, where every one is exactly an fp16 (a
// GGUF's are), fp16 (`half`: widened exactly, so the same numbers in half the bytes);
// xsums[m * count + g] for row m of x.
struct Groups {
  const void* scales = nullptr;  // null: not grouped
  const void* mins = nullptr;
  const float* xsums = nullptr;
  int64_t size = 0, count = 0;
  bool half = false;

  explicit operator bool() const { return scales != nullptr; }
  // Value `at` of `params` (scales or mins).
  float param(const void* params, int64_t at) const {
    return half ? half_to_float(static_cast<const uint16_t*>(params)[at]) : static_cast<const float*>(params)[at];
  }
  // The same groups seen from row tile `m`, panel `p` onwards.
  Groups at(int64_t m, int64_t p) const {
    if (!scales) return *this;
    const int64_t skip = p * count * 16 * (half ? 2 : 4);
    return {static_cast<const char*>(scales) + skip, mins ? static_cast<const char*>(mins) + skip : nullptr,
            xsums + m * count, size, count, half};
  }
};

// Panel column `w`'s weight for input i (w points at its first element).
template <typename W>
inline float weight_at(const W* w, int64_t i) { return to_float(w[i * kPanel]); }
inline float weight_at(const int4x2* w, int64_t i) { return float((w[(i / 2) * kPanel].bits >> (4 * (i & 1))) & 15); }

// 4-bit panels: two inputs to a byte, and always grouped.
template <typename W>
constexpr bool kFourBit = std::is_same_v<W, int4x2>;

// Elements of W one panel of k inputs takes.
template <typename W>
constexpr int64_t panel_elements(int64_t k) { return kFourBit<W> ? k / 2 * kPanel : k * kPanel; }

// The reference order, one element at a time: every vector path must agree with it bit for bit.
// c holds `panels` panels per row (row stride panels * 16); panel_stride apart in w.
template <typename W>
void tile_scalar(const float* x, int64_t ldx, const W* panels, int64_t panel_stride, int64_t k, int64_t rows,
                 int64_t num_panels, float* c, Groups groups) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t p = 0; p < num_panels; ++p)
      for (int64_t j = 0; j < kPanel; ++j) {
        const W* w = panels + p * panel_stride + j;
        float acc = 0.0f;
        if (!groups) {
          for (int64_t i = 0; i < k; ++i) acc = std::fma(x[m * ldx + i], weight_at(w, i), acc);
        } else {
          for (int64_t g = 0; g < groups.count; ++g) {
            float part = 0.0f;
            for (int64_t i = g * groups.size; i < (g + 1) * groups.size; ++i)
              part = std::fma(x[m * ldx + i], weight_at(w, i), part);
            const int64_t at = (p * groups.count + g) * kPanel + j;
            acc = std::fma(part, groups.param(groups.scales, at), acc);
            if (groups.mins) acc = std::fma(groups.xsums[m * groups.count + g], groups.param(groups.mins, at), acc);
          }
        }
        c[m * num_panels * kPanel + p * kPanel + j] = acc;
      }
}

#if defined(__AVX512F__)
constexpr int kTileRows = 12;  // 12 rows x 2 panels = 24 zmm accumulators
constexpr int kTilePanels = 2;

template <typename W>
inline __m512 load_panel(const W* p) {
  if constexpr (sizeof(W) == 1)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  else if constexpr (sizeof(W) == 2)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  else return _mm512_loadu_ps(p);
}

// acc[r][p] continues its FMA chain over inputs [begin, end): R rows x P panels.
template <int R, int P, typename W>
inline void chain(const float* x, int64_t ldx, const W* panels, int64_t panel_stride, int64_t begin, int64_t end,
                  Prefetch prefetch, __m512 (&acc)[R][P]) {
  if constexpr (kFourBit<W>) {  // two inputs per byte: each pair's bytes widened once
    for (int64_t i = begin; i < end; i += 2) {
      prefetch.step(i);
      prefetch.step(i + 1);
      for (int p = 0; p < P; ++p) {
        const auto* bytes = reinterpret_cast<const __m128i*>(panels + p * panel_stride + i / 2 * kPanel);
        const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes));
        const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(d, _mm512_set1_epi32(15)));
        for (int r = 0; r < R; ++r) acc[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + i]), even, acc[r][p]);
        const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
        for (int r = 0; r < R; ++r) acc[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + i + 1]), odd, acc[r][p]);
      }
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      prefetch.step(i);
      __m512 w[P];
      for (int p = 0; p < P; ++p) w[p] = load_panel(panels + p * panel_stride + i * kPanel);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + i]);
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xv, w[p], acc[r][p]);
      }
    }
  }
}

template <int R, int P>
inline void zero(__m512 (&acc)[R][P]) {
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
}

// 16 scales or minimums from `at`, widened exactly if fp16.
inline __m512 load_params(const Groups& groups, const void* params, int64_t at) {
  if (groups.half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(params) + at)));
  return _mm512_loadu_ps(static_cast<const float*>(params) + at);
}

// Grouped weights: each group's chains in registers, folded into the running sums in c.
template <int R, int P, typename W>
void tile_grouped(const float* x, int64_t ldx, const W* panels, int64_t panel_stride, float* c, Prefetch prefetch,
                  Groups groups) {
  for (int i = 0; i < R * P * kPanel; ++i) c[i] = 0.0f;
  for (int64_t g = 0; g < groups.count; ++g) {
    __m512 part[R][P];
    zero(part);
    chain(x, ldx, panels, panel_stride, g * groups.size, (g + 1) * groups.size, prefetch, part);
    for (int p = 0; p < P; ++p) {
      const int64_t at = (p * groups.count + g) * kPanel;
      const __m512 scale = load_params(groups, groups.scales, at);
      for (int r = 0; r < R; ++r) {
        float* sums = c + r * P * kPanel + p * kPanel;
        __m512 acc = _mm512_fmadd_ps(part[r][p], scale, _mm512_loadu_ps(sums));
        if (groups.mins)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(groups.xsums[r * groups.count + g]),
                                load_params(groups, groups.mins, at), acc);
        _mm512_storeu_ps(sums, acc);
      }
    }
  }
}

// R rows x P panels over all k; c[m][P * 16] receives the sums.
template <int R, int P, typename W>
void tile(const float* x, int64_t ldx, const W* panels, int64_t panel_stride, int64_t k, float* c,
          Prefetch prefetch, Groups groups) {
  if constexpr (kFourBit<W>) {
    tile_grouped<R, P>(x, ldx, panels, panel_stride, c, prefetch, groups);
  } else {
    if (groups) return tile_grouped<R, P>(x, ldx, panels, panel_stride, c, prefetch, groups);
    __m512 acc[R][P];
    zero(acc);
    chain(x, ldx, panels, panel_stride, 0, k, prefetch, acc);
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) _mm512_storeu_ps(c + r * P * kPanel + p * kPanel, acc[r][p]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kTileRows = 6;  // 6 rows x 2 ymm (one panel) = 12 accumulators
constexpr int kTilePanels = 1;

// Prefetches are issued every 8 inputs, not every one: each issue's bookkeeping is a dozen scalar
// instructions, and a 4-row tile's 8 FMAs an input cannot hide them.
constexpr int64_t kPrefetchEvery = 8;

// lo[r][p], hi[r][p] continue their FMA chains over inputs [begin, end): R rows x P panels.
template <int R, int P, typename W>
inline void chain(const float* x, int64_t ldx, const W* panels, int64_t panel_stride, int64_t begin, int64_t end,
                  Prefetch prefetch, __m256 (&lo)[R][P], __m256 (&hi)[R][P]) {
  if constexpr (kFourBit<W>) {  // two inputs per byte: each pair's bytes widened once
    const __m256i nibble = _mm256_set1_epi32(15);
    for (int64_t i = begin; i < end; i += 2) {
      if ((i - begin) % kPrefetchEvery == 0) prefetch.steps(i, std::min(i + kPrefetchEvery, end));
      for (int p = 0; p < P; ++p) {
        const auto* b = reinterpret_cast<const char*>(panels + p * panel_stride + i / 2 * kPanel);
        const __m256i dl = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
        const __m256i dh = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8)));
        for (int half = 0; half < 2; ++half) {
          const __m256 wl = _mm256_cvtepi32_ps(half ? _mm256_srli_epi32(dl, 4) : _mm256_and_si256(dl, nibble));
          const __m256 wh = _mm256_cvtepi32_ps(half ? _mm256_srli_epi32(dh, 4) : _mm256_and_si256(dh, nibble));
          for (int r = 0; r < R; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i + half);
            lo[r][p] = _mm256_fmadd_ps(xv, wl, lo[r][p]);
            hi[r][p] = _mm256_fmadd_ps(xv, wh, hi[r][p]);
          }
        }
      }
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      if ((i - begin) % kPrefetchEvery == 0) prefetch.steps(i, std::min(i + kPrefetchEvery, end));
      for (int p = 0; p < P; ++p) {
        const W* w = panels + p * panel_stride + i * kPanel;
        const __m256 wl = load8(w), wh = load8(w + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);
          lo[r][p] = _mm256_fmadd_ps(xv, wl, lo[r][p]);
          hi[r][p] = _mm256_fmadd_ps(xv, wh, hi[r][p]);
        }
      }
    }
  }
}

template <int R, int P>
inline void zero(__m256 (&lo)[R][P], __m256 (&hi)[R][P]) {
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) lo[r][p] = hi[r][p] = _mm256_setzero_ps();
}

// 8 scales or minimums from `at`, widened exactly if fp16.
inline __m256 load_params(const Groups& groups, const void* params, int64_t at) {
  if (groups.half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(params) + at)));
  return _mm256_loadu_ps(static_cast<const float*>(params) + at);
}

template <int R, int P, typename W>
void tile_grouped(const float* x, int64_t ldx, const W* panels, int64_t panel_stride, float* c, Prefetch prefetch,
                  Groups groups) {
  for (int i = 0; i < R * P * kPanel; ++i) c[i] = 0.0f;
  for (int64_t g = 0; g < groups.count; ++g) {
    __m256 lo[R][P], hi[R][P];
    zero(lo, hi);
    chain(x, ldx, panels, panel_stride, g * groups.size, (g + 1) * groups.size, prefetch, lo, hi);
    for (int p = 0; p < P; ++p) {
      const int64_t at = (p * groups.count + g) * kPanel;
      const __m256 scale_lo = load_params(groups, groups.scales, at);
      const __m256 scale_hi = load_params(groups, groups.scales, at + 8);
      for (int r = 0; r < R; ++r) {
        float* sums = c + r * P * kPanel + p * kPanel;
        __m256 a = _mm256_fmadd_ps(lo[r][p], scale_lo, _mm256_loadu_ps(sums));
        __m256 b = _mm256_fmadd_ps(hi[r][p], scale_hi, _mm256_loadu_ps(sums + 8));
        if (groups.mins) {
          const __m256 xs = _mm256_set1_ps(groups.xsums[r * groups.count + g]);
          a = _mm256_fmadd_ps(xs, load_params(groups, groups.mins, at), a);
          b = _mm256_fmadd_ps(xs, load_params(groups, groups.mins, at + 8), b);
        }
        _mm256_storeu_ps(sums, a);
        _mm256_storeu_ps(sums + 8, b);
      }
    }
  }
}

template <int R, int P, typename W>
void tile(const float* x, int64_t ldx, const W* panels, int64_t panel_stride, int64_t k, float* c, Prefetch prefetch,
          Groups groups) {
  if constexpr (kFourBit<W>) {
    tile_grouped<R, P>(x, ldx, panels, panel_stride, c, prefetch, groups);
  } else {
    if (groups) return tile_grouped<R, P>(x, ldx, panels, panel_stride, c, prefetch, groups);
    __m256 lo[R][P], hi[R][P];
    zero(lo, hi);
    chain(x, ldx, panels, panel_stride, 0, k, prefetch, lo, hi);
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) {
        _mm256_storeu_ps(c + r * P * kPanel + p * kPanel, lo[r][p]);
        _mm256_storeu_ps(c + r * P * kPanel + p * kPanel + 8, hi[r][p]);
      }
  }
}
#else
constexpr int kTileRows = 4;
constexpr int kTilePanels = 1;

template <int R, int P, typename W>
void tile(const float* x, int64_t ldx, const W* panels, int64_t panel_stride, int64_t k, float* c, Prefetch,
          Groups groups) {
  tile_scalar(x, ldx, panels, panel_stride, k, R, P, c, groups);
}
#endif

// Dispatches a tile of `rows` (<= kTileRows) rows to the instantiation for that count.
template <int P, typename W, int R = kTileRows>
void tile_rows(int64_t rows, const float* x, int64_t ldx, const W* panels, int64_t panel_stride, int64_t k,
               float* c, Prefetch prefetch, Groups groups) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, P>(x, ldx, panels, panel_stride, k, c, prefetch, groups);
    return tile_rows<P, W, R - 1>(rows, x, ldx, panels, panel_stride, k, c, prefetch, groups);
  }
}


// Panels per tile for a row range: few rows get wide tiles, so enough FMA chains run at once to
// cover an FMA's latency (one chain per row and panel half, each FMA waiting on the last: with a
// decode step's one or two rows on one panel, the chains' latency, not memory, bounds quantised
// weights). AVX-512: 1-2 rows x 8 panels, 8-16 chains of 32 zmm. AVX2 (16 ymm): 1 row x 4 panels
// or 2 rows x 2 panels, 8 chains. Which outputs share a tile never changes an output's own chain.
#if defined(__AVX512F__)
constexpr int kWidePanels = 8;
constexpr int64_t kFewRows = 2;
constexpr int kMidPanels = kTilePanels;
constexpr int64_t kMidRows = 0;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kWidePanels = 4;
constexpr int64_t kFewRows = 1;
constexpr int kMidPanels = 2;
constexpr int64_t kMidRows = 2;
#else
constexpr int kWidePanels = kTilePanels;
constexpr int64_t kFewRows = 0;
constexpr int kMidPanels = kTilePanels;
constexpr int64_t kMidRows = 0;
#endif

// Which quantised panels column_range widens to a float copy: int8 ones too, and only where every
// row tile has kWidenTileRows rows or more. On AVX2 (benchmarks/canonical_rows.py, EPYC Zen 3, one
// thread), int8 weights converted in the tile ran three times faster than widened at 16-64 rows,
// and 4-bit weights widened ran 30% slower at 13 rows (tiles of 4, 4 and 5: 8 chains each stall on
// the copy) but 15% faster at 16 (5, 5 and 6).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kWidenInt8 = false;
constexpr int64_t kWidenTileRows = 5;
#else
constexpr bool kWidenInt8 = true;
constexpr int64_t kWidenTileRows = 1;
#endif

inline int64_t group_width(int64_t rows, int64_t p, int64_t end_panel) {
  if (rows <= kFewRows && p + kWidePanels <= end_panel) return kWidePanels;
  if (rows <= kMidRows && p + kMidPanels <= end_panel) return kMidPanels;
  return std::min<int64_t>(kTilePanels, end_panel - p);
}

// One tile of `rows` rows and `panels` panels (kWidePanels, kMidPanels, kTilePanels or 1).
template <typename W>
void tile_group(int64_t panels, int64_t rows, const float* x, int64_t ldx, const W* w, int64_t panel_stride,
                int64_t k, float* c, Prefetch pf, Groups groups) {
  if constexpr (kWidePanels != kTilePanels) {
    if (panels == kWidePanels)
      return tile_rows<kWidePanels, W, kFewRows>(rows, x, ldx, w, panel_stride, k, c, pf, groups);
  }
  if constexpr (kMidPanels != kTilePanels) {
    if (panels == kMidPanels)
      return tile_rows<kMidPanels, W, kMidRows>(rows, x, ldx, w, panel_stride, k, c, pf, groups);
  }
  if (panels == kTilePanels) tile_rows<kTilePanels>(rows, x, ldx, w, panel_stride, k, c, pf, groups);
  else if (panels == 1) tile_rows<1>(rows, x, ldx, w, panel_stride, k, c, pf, groups);
}

// The largest tile's outputs: c's size.
constexpr int64_t kTileOutputs =
    std::max<int64_t>({int64_t{kTileRows} * kTilePanels, kFewRows * kWidePanels, kMidRows * kMidPanels}) * kPanel;

// `panels` panels of k int8 or 4-bit weights as float panels, in a buffer of this thread's that
// lives until its next call.
template <typename W>
inline const float* widen_group(const W* w, int64_t panels, int64_t k) {
  static_assert(sizeof(W) == 1, "only int8 and 4-bit panels are widened");
  thread_local std::vector<float> buffer;
  const int64_t count = panels * k * kPanel;
  if (int64_t(buffer.size()) < count) buffer.resize(count);
  float* out = buffer.data();
  // the panels lie one after another, so they widen as one panel of panels * k inputs
  static const float ones[kPanel] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, zeros[kPanel] = {};
  const auto* bytes = reinterpret_cast<const uint8_t*>(w);
  widen_rows(reinterpret_cast<const int8_t*>(w), kFourBit<W> ? bytes : nullptr, 0, panels * k, ones, zeros, out,
             kPanel);
  return out;
}

// Columns [16 * first_panel, 16 * end_panel) of rows [m0, m1).
template <typename W>
void column_range(const float* x, int64_t ldx, const W* wp, const float* scales, Groups groups, const float* bias,
                  float* y, int64_t ldy, int64_t m0, int64_t m1, int64_t k, int64_t n, int64_t first_panel,
                  int64_t end_panel) {
  const int64_t panel_stride = panel_elements<W>(k), wide_stride = k * kPanel;
  alignas(64) float c[kTileOutputs];
  for (int64_t p = first_panel; p < end_panel;) {
    const int64_t panels = group_width(m1 - m0, p, end_panel);
    const W* w = wp + p * panel_stride;
    // the next group in this range, or the range's first for the next row block
    const int64_t next_p = p + panels < end_panel ? p + panels : first_panel;
    const int64_t next_panels = group_width(m1 - m0, next_p, end_panel);
    const W* next = next_p == p ? nullptr : wp + next_p * panel_stride;
    const int64_t next_bytes = next_panels * panel_stride * int64_t(sizeof(W));
    const int64_t tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
    // int8 and 4-bit panels that three or more row tiles share are widened once (exactly) into a
    // float copy, so each tile runs the float inner loop rather than converting the same weights
    // again (not for two tiles: storing and reloading the copy costs more than converting twice),
    // where the instruction set gains by it (kWidenInt8, kWidenTileRows)
    const float* wide = nullptr;
    if constexpr (sizeof(W) == 1) {
      if (tiles > 2 && (kFourBit<W> || kWidenInt8) && (m1 - m0) / tiles >= kWidenTileRows)
        wide = widen_group(w, panels, k);
    }
    // the rows split evenly over the tiles, their sizes at most one apart (16 rows on AVX2: 5 + 5 + 6,
    // where rounding each tile up gave 6 + 6 + 4): a tile of few rows waits on its few FMA chains'
    // latency
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m = m0 + (m1 - m0) * t / tiles, rows = m0 + (m1 - m0) * (t + 1) / tiles - m;
      const Prefetch pf = prefetch_share(next, next_bytes, t, tiles, k);
      const Groups g = groups.at(m, p);
      if (wide != nullptr) tile_group(panels, rows, x + m * ldx, ldx, wide, wide_stride, k, c, pf, g);
      else tile_group(panels, rows, x + m * ldx, ldx, w, panel_stride, k, c, pf, g);
      const int64_t width = panels * kPanel;
      const int64_t col0 = p * kPanel, cols = std::min<int64_t>(width, n - col0);
      for (int64_t r = 0; r < rows; ++r) {
        float* out = y + (m + r) * ldy + col0;
        const float* sums = c + r * width;
        for (int64_t j = 0; j < cols; ++j) {
          const float v = scales ? sums[j] * scales[col0 + j] : sums[j];
          out[j] = bias ? v + bias[col0 + j] : v;
        }
      }
    }
    p += panels;
  }
}

template <typename W>
void canonical_linear(const float* x, int64_t ldx, const W* wp, const float* scales, Groups groups,
                      const float* bias, float* y, int64_t m, int64_t k, int64_t n, int threads) {
  std::vector<float> xsums;
  if (groups.mins) {  // each row's sum over each group, in input order
    xsums.resize(m * groups.count);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < groups.count; ++g) {
        float sum = 0.0f;
        for (int64_t i = g * groups.size; i < (g + 1) * groups.size; ++i) sum += x[r * ldx + i];
        xsums[r * groups.count + g] = sum;
      }
    groups.xsums = xsums.data();
  }
  const int64_t panels = (n + kPanel - 1) / kPanel;
  threads = matmul_threads(m, n, k, (panels + kTilePanels - 1) / kTilePanels, threads);
  const int64_t row_block = std::max<int64_t>(1, kRowBlockBytes / (k * int64_t(sizeof(float))) / kTileRows) * kTileRows;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const auto [first, end] = panel_share(panels, kTilePanels, threads);
    for (int64_t m0 = 0; m0 < m; m0 += row_block)
      column_range(x, ldx, wp, scales, groups, bias, y, n, m0, std::min(m, m0 + row_block), k, n, first, end);
  }
}

}  // namespace

// The int8 and 4-bit instantiations (canonical_linear_quantized.cpp).
void canonical_linear_quantized(const float* x, int64_t ldx, const void* packed, bool four_bit, const float* scales,
                                const void* group_scales, const void* group_mins, bool half, int64_t group_size,
                                const float* bias, float* y, int64_t m, int64_t k, int64_t n, int threads);
