// Small AVX2 helpers the kernels share.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#ifdef _OPENMP
#include <omp.h>
#endif

constexpr int64_t kCacheLine = 64;  // bytes: the unit of the kernels' software prefetches
constexpr int64_t kPanel = 16;  // columns per packed panel (the canonical kernel's weight layout)

// Threads for an [m, k] x [k, n] matmul shared out in `units` column units: one where a parallel
// region would cost more than it saves, never more than there are units.
inline int matmul_threads(int64_t m, int64_t n, int64_t k, int64_t units, int threads) {
  if (m * n * k < (int64_t(1) << 18)) threads = 1;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, units)));
}

// The calling OpenMP thread's contiguous share [first, end) of `panels` panels, in whole units
// of `width` panels, so each thread streams one stretch of the weights.
inline std::pair<int64_t, int64_t> panel_share(int64_t panels, int64_t width, int threads) {
#ifdef _OPENMP
  const int t = omp_get_thread_num();
#else
  const int t = 0;
#endif
  const int64_t units = (panels + width - 1) / width;
  return {std::min(panels, units * t / threads * width), std::min(panels, units * (t + 1) / threads * width)};
}

// K/V caches hold float32, bfloat16 (its bits as uint16_t), int8 or fp8 e4m3; kernels widen each
// on load, exactly. Quantised weights are int8 or 4-bit. Scales are applied after the sums.
struct fp8_e4m3 {
  uint8_t bits;  // sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities
};
struct int4x2 {
  uint8_t bits;  // two 4-bit weights, 0..15: the first in the low nibble
};

inline float to_float(float x) { return x; }
inline float to_float(int8_t q) { return static_cast<float>(q); }
inline float to_float(fp8_e4m3 x) {
  const int e = (x.bits >> 3) & 15, m = x.bits & 7;
  const float magnitude = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
  return x.bits & 0x80 ? -magnitude : magnitude;
}
inline float to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 to bfloat16 bits, rounding to nearest even (finite inputs), as torch rounds them.
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// An fp16's value (exact: every fp16 is a float32).
inline float half_to_float(uint16_t h) {
  const int exponent = (h >> 10) & 31, mantissa = h & 1023;
  float magnitude;
  if (exponent == 0) magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // zero and subnormals
  else if (exponent == 31) magnitude = mantissa ? NAN : INFINITY;
  else magnitude = std::ldexp(static_cast<float>(mantissa | 1024), exponent - 25);
  return h & 0x8000 ? -magnitude : magnitude;
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
// float32 lanes rounded to bfloat16 as to_bf16 rounds them, kept as float32 lanes (low 16 bits zero).
inline __m256 round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// 8 lanes that round_bf16 gave, stored as their bf16 bits.
inline void store8_bf16(uint16_t* p, __m256 rounded) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
// e4m3's bits moved into a half's (exponent into its low 4 exponent bits, mantissa on top) make
// a half worth exactly 2^-8 times as much, subnormals included: widen that, scale back by 2^8.
inline __m256 load8(const fp8_e4m3* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.0f));
}
#endif

// e^x for x <= 0 (softmax after subtracting the max; silu's e^-|x|): Cephes' expf, within 2 ulp.
// The scalar twin runs the same operations, so a vector body and its scalar tail agree bit for bit.
inline float exp_nonpositive(float x) {
  x = x > -87.3f ? x : -87.3f;  // as max_ps: a NaN becomes the bound
  const float fx = std::floor(std::fma(x, 1.44269504088896341f, 0.5f));
  x = std::fma(-fx, 0.693359375f, x);
  x = std::fma(-fx, -2.12194440e-4f, x);
  float y = 1.9875691500e-4f;
  y = std::fma(y, x, 1.3981999507e-3f);
  y = std::fma(y, x, 8.3334519073e-3f);
  y = std::fma(y, x, 4.1665795894e-2f);
  y = std::fma(y, x, 1.6666665459e-1f);
  y = std::fma(y, x, 5.0000001201e-1f);
  y = std::fma(y, x * x, x + 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fx) + 127) << 23;
  float pow2;
  std::memcpy(&pow2, &bits, sizeof pow2);
  return y * pow2;
}
#ifdef __AVX2__
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
