// y[M, out] = x[M, in] @ W[out, in]^T (+ bias) for the few rows of a decode step.
//
// Memory-bound: each weight row is streamed once and dotted with all M input rows.
// Threads split the output rows into contiguous ranges, so each core reads one
// sequential stretch of W. IEEE arithmetic, no -ffast-math: every output is the same
// fixed sequence of FMAs whatever M is, so a row's result does not depend on its batch.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

// A tile is 8 weight rows x 2 input rows: 16 accumulators, 8 streams of W in flight. It
// measured best with AVX-512VL's 32 vector registers and with AVX2's 16 (which spill a few).
constexpr int kRowBlock = 8;
constexpr int kInputGroup = 2;
// Below this many weight elements, waking the second core costs more than it saves.
constexpr int64_t kParallelMin = 1 << 15;

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// y[g * ldy + r] = dot(w[r], x[g]) + b[r] for R weight rows and G input rows, each of length k.
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
      __m256 xv = _mm256_loadu_ps(x + g * k + i);
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

template <int R>
inline void rows(const float* w, const float* x, const float* b, int64_t m, int64_t k, float* y, int64_t ldy) {
  int64_t g = 0;
  for (; g + kInputGroup <= m; g += kInputGroup) tile<R, kInputGroup>(w, x + g * k, b, k, y + g * ldy, ldy);
  for (; g < m; ++g) tile<R, 1>(w, x + g * k, b, k, y + g * ldy, ldy);
}

// Weight rows [begin, end) for all m input rows.
void row_range(const float* w, const float* x, const float* bias, float* y, int64_t m, int64_t k, int64_t n,
               int64_t begin, int64_t end) {
  int64_t j = begin;
  for (; j + kRowBlock <= end; j += kRowBlock)
    rows<kRowBlock>(w + j * k, x, bias ? bias + j : nullptr, m, k, y + j, n);
  for (; j < end; ++j) rows<1>(w + j * k, x, bias ? bias + j : nullptr, m, k, y + j, n);
}

}  // namespace

// y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]); all contiguous float32. Any m works; decode steps
// have a few, whose rows then stay in L1 while W streams past.
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
