// y[M, out] = x[M, in] @ W[out, in]^T (+ bias) for the few rows of a decode step.
//
// Each weight row is read from memory once for all M input rows, which stay in L1.
// Threads split the output rows into contiguous ranges, so each core reads one
// sequential stretch of W. IEEE arithmetic, no -ffast-math: a fixed sequence of FMAs
// per output, with no contraction beyond the FMAs written here.

#include "simd.h"

#include <algorithm>
#include <cstdint>

namespace {

// Up to this many input rows the kernel is memory-bound: it walks W one row at a time,
// a single sequential stream per core, which the prefetchers follow at full bandwidth.
// Beyond it, it is compute-bound and tiles 8 weight rows x 2 input rows, so each input
// vector loaded serves 8 FMAs (16 accumulators, fits AVX-512VL's 32 registers and costs
// AVX2's 16 a few spills).
constexpr int64_t kStreamMaxRows = 6;
constexpr int kRowBlock = 8;
constexpr int kInputGroup = 2;
// Below this many weight elements, waking the second core costs more than it saves.
constexpr int64_t kParallelMin = 1 << 15;

// y[g * ldy] = dot(w, x[g]) + b for one weight row and G input rows; 4 accumulators per
// input row hide the FMA latency.
template <int G>
inline void row(const float* w, const float* x, const float* b, int64_t k, float* y, int64_t ldy) {
  float s[G] = {};
  int64_t i = 0;
#ifdef __AVX2__
  __m256 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < 4; ++u) acc[g][u] = _mm256_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    __m256 wv[4];
    for (int u = 0; u < 4; ++u) wv[u] = _mm256_loadu_ps(w + i + 8 * u);
    for (int g = 0; g < G; ++g)
      for (int u = 0; u < 4; ++u) acc[g][u] = _mm256_fmadd_ps(wv[u], _mm256_loadu_ps(x + g * k + i + 8 * u), acc[g][u]);
  }
  for (; i + 8 <= k; i += 8) {
    const __m256 wv = _mm256_loadu_ps(w + i);
    for (int g = 0; g < G; ++g) acc[g][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + g * k + i), acc[g][0]);
  }
  for (int g = 0; g < G; ++g)
    s[g] = hsum(_mm256_add_ps(_mm256_add_ps(acc[g][0], acc[g][1]), _mm256_add_ps(acc[g][2], acc[g][3])));
#endif
  for (; i < k; ++i)
    for (int g = 0; g < G; ++g) s[g] += w[i] * x[g * k + i];
  for (int g = 0; g < G; ++g) y[g * ldy] = b ? s[g] + *b : s[g];
}

// y[g * ldy + r] = dot(w[r], x[g]) + b[r] for R weight rows and G input rows.
template <int R, int G>
inline void tile(const float* w, const float* x, const float* b, int64_t k, float* y, int64_t ldy) {
  float s[R][G] = {};
  int64_t i = 0;
#ifdef __AVX2__
  __m256 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + r * k + i);
    for (int g = 0; g < G; ++g) {
      const __m256 xv = _mm256_loadu_ps(x + g * k + i);
      for (int r = 0; r < R; ++r) acc[r][g] = _mm256_fmadd_ps(wv[r], xv, acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) s[r][g] = hsum(acc[r][g]);
#endif
  for (; i < k; ++i)
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) s[r][g] += w[r * k + i] * x[g * k + i];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) y[g * ldy + r] = b ? s[r][g] + b[r] : s[r][g];
}

// Weight rows [begin, end) against all m input rows.
void row_range(const float* w, const float* x, const float* bias, float* y, int64_t m, int64_t k, int64_t n,
               int64_t begin, int64_t end) {
  if (m <= kStreamMaxRows) {
    for (int64_t j = begin; j < end; ++j) {
      const float* b = bias ? bias + j : nullptr;
      int64_t g = 0;
      for (; g + 2 <= m; g += 2) row<2>(w + j * k, x + g * k, b, k, y + g * n + j, n);
      if (g < m) row<1>(w + j * k, x + g * k, b, k, y + g * n + j, n);
    }
    return;
  }
  int64_t j = begin;
  for (; j + kRowBlock <= end; j += kRowBlock) {
    const float* b = bias ? bias + j : nullptr;
    int64_t g = 0;
    for (; g + kInputGroup <= m; g += kInputGroup)
      tile<kRowBlock, kInputGroup>(w + j * k, x + g * k, b, k, y + g * n + j, n);
    for (; g < m; ++g) tile<kRowBlock, 1>(w + j * k, x + g * k, b, k, y + g * n + j, n);
  }
  for (; j < end; ++j)
    for (int64_t g = 0; g < m; ++g) tile<1, 1>(w + j * k, x + g * k, bias ? bias + j : nullptr, k, y + g * n + j, n);
}

}  // namespace

// y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]); all contiguous float32. Any m works; it is
// fastest against MKL for the few rows of decode steps.
extern "C" void ladle_small_linear(const float* x, const float* w, const float* bias, float* y, int64_t m,
                                   int64_t k, int64_t n, int threads) {
  if (n * k < kParallelMin) threads = 1;
  // Contiguous chunks of whole tiles, one per thread.
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = std::min(n, blocks * t / threads * kRowBlock);
    const int64_t end = std::min(n, blocks * (t + 1) / threads * kRowBlock);
    row_range(w, x, bias, y, m, k, n, begin, end);
  }
}
