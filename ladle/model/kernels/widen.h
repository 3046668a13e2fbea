// int8 and 4-bit panel values widened to float32, each times its column's scale plus its minimum:
// the canonical kernel's float copy of a panel group (scale 1, minimum 0: the values exactly) and
// widen_panels.cpp's weights for a GEMM.
#pragma once

#include "simd.h"

#include <cstdint>

namespace {

// Inputs [begin, end) of one panel into out (row i at out + i * ld), each times scale[j] plus min[j].
inline void widen_rows(const int8_t* q, const uint8_t* nibbles, int64_t begin, int64_t end, const float* scale,
                       const float* min, float* out, int64_t ld) {
#if defined(__AVX512F__)
  const __m512 s = _mm512_loadu_ps(scale), m = _mm512_loadu_ps(min);
  const auto put = [&](int64_t i, __m512i values) {
    _mm512_storeu_ps(out + i * ld, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(values), s), m));
  };
  if (nibbles != nullptr) {  // begin and end even: byte row t holds inputs 2t and 2t + 1
    for (int64_t i = begin; i < end; i += 2) {
      const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(nibbles + i / 2 * kPanel)));
      put(i, _mm512_and_si512(d, _mm512_set1_epi32(15)));
      put(i + 1, _mm512_srli_epi32(d, 4));
    }
  } else {
    for (int64_t i = begin; i < end; ++i) put(i, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + i * kPanel))));
  }
#elif defined(__AVX2__)
  const __m256 s[2] = {_mm256_loadu_ps(scale), _mm256_loadu_ps(scale + 8)};
  const __m256 m[2] = {_mm256_loadu_ps(min), _mm256_loadu_ps(min + 8)};
  const auto put = [&](int64_t i, int half, __m256i values) {
    _mm256_storeu_ps(out + i * ld + 8 * half, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(values), s[half]), m[half]));
  };
  for (int64_t i = begin; i < end; nibbles != nullptr ? i += 2 : ++i) {
    for (int half = 0; half < 2; ++half) {
      if (nibbles != nullptr) {
        const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(nibbles + i / 2 * kPanel + 8 * half)));
        put(i, half, _mm256_and_si256(d, _mm256_set1_epi32(15)));
        put(i + 1, half, _mm256_srli_epi32(d, 4));
      } else {
        put(i, half, _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + i * kPanel + 8 * half))));
      }
    }
  }
#else
  for (int64_t i = begin; i < end; ++i) {
    float* row = out + i * ld;
    for (int64_t j = 0; j < kPanel; ++j) {
      const float value = nibbles != nullptr ? float((nibbles[i / 2 * kPanel + j] >> (4 * (i & 1))) & 15)
                                             : float(q[i * kPanel + j]);
      row[j] = value * scale[j] + min[j];
    }
  }
#endif
}

}  // namespace
