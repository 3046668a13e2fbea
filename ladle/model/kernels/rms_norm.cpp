// y[m, n] = w * (x / sqrt(mean(x^2) + eps)) row by row: transformers' RMSNorm in float32,
// squares rounded before they are summed as torch's pow-then-mean rounds them. In bfloat16
// as transformers does it there: normalise in float32, round to bf16, then scale by the
// bf16 weight and round again.

#include "simd.h"

#include <cmath>
#include <cstdint>

namespace {

void rms_norm_row_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t n, float eps) {
  float sum = 0;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    const float sq = v * v;
    sum += sq;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  int64_t j = 0;
#ifdef __AVX2__
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (; j + 8 <= n; j += 8)
    store8_bf16(y + j, round_bf16(_mm256_mul_ps(load8(w + j), round_bf16(_mm256_mul_ps(load8(x + j), inv8)))));
#endif
  for (; j < n; ++j) {
    const float normed = to_float(to_bf16(to_float(x[j]) * inv));
    y[j] = to_bf16(to_float(w[j]) * normed);
  }
}

void rms_norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  float sum = 0;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; i + 32 <= n; i += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
      acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(v, v));
    }
  const __m256 s8 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  sum = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
#endif
  for (; i < n; ++i) {
    const float sq = x[i] * x[i];
    sum += sq;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) {
    const float normed = x[j] * inv;
    y[j] = w[j] * normed;
  }
}

}  // namespace

// Rows are independent and each is computed the same way whatever m and the thread count.
extern "C" void ladle_rms_norm(const float* x, const float* w, float* y, int64_t m, int64_t n, float eps,
                               int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m * n >= (1 << 15))
  for (int64_t row = 0; row < m; ++row) rms_norm_row(x + row * n, w, y + row * n, n, eps);
}

// The same for bfloat16 x, w and y (their bits as uint16_t).
extern "C" void ladle_rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t n, float eps,
                                    int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m * n >= (1 << 15))
  for (int64_t row = 0; row < m; ++row) rms_norm_row_bf16(x + row * n, w, y + row * n, n, eps);
}

// The residual stream's step and the next norm in one pass: h += a (one rounded add per element,
// as torch's), then y = RMSNorm(h) as above. h, a and y are [m, n] float32, contiguous.
extern "C" void ladle_add_rms_norm(float* h, const float* a, const float* w, float* y, int64_t m, int64_t n,
                                   float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m * n >= (1 << 15))
  for (int64_t row = 0; row < m; ++row) {
    float* hr = h + row * n;
    const float* ar = a + row * n;
    for (int64_t j = 0; j < n; ++j) hr[j] = hr[j] + ar[j];
    rms_norm_row(hr, w, y + row * n, n, eps);
  }
}

// The same in bfloat16, as torch runs `h.add_(a)` there (the sum rounded to bf16) and then the
// bf16 RMSNorm above: one pass instead of an add and a norm that each convert to float and back.
extern "C" void ladle_add_rms_norm_bf16(uint16_t* h, const uint16_t* a, const uint16_t* w, uint16_t* y, int64_t m,
                                        int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m * n >= (1 << 15))
  for (int64_t row = 0; row < m; ++row) {
    uint16_t* hr = h + row * n;
    const uint16_t* ar = a + row * n;
    int64_t j = 0;
#ifdef __AVX2__
    for (; j + 8 <= n; j += 8) store8_bf16(hr + j, round_bf16(_mm256_add_ps(load8(hr + j), load8(ar + j))));
#endif
    for (; j < n; ++j) hr[j] = to_bf16(to_float(hr[j]) + to_float(ar[j]));
    rms_norm_row_bf16(hr, w, y + row * n, n, eps);
  }
}
