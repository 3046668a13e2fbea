// Small AVX2 helpers the kernels share.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

constexpr int64_t kCacheLine = 64;  // bytes: the unit of the kernels' software prefetches

// K/V caches hold float32 or bfloat16 (its bits as uint16_t); kernels widen bf16 on load, exactly.
// Quantised weights are int8 (their scale applied after the sum).
inline float to_float(float x) { return x; }
inline float to_float(int8_t q) { return static_cast<float>(q); }
inline float to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef __AVX2__
// The sum of a vector's 8 lanes, in a fixed order.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif
