// Rotary embedding in place, exactly as layers.apply_rotary computes it in torch:
//
//     x * cos + rotate_half(x) * sin      (rotate_half's sign lives in the sin table)
//
// each product rounded to float32, then their sum: the same three roundings as the torch ops
// it replaces, so the same bits, at one call per step instead of five tensor ops. In bfloat16
// each of the three is rounded to bf16, as torch's bf16 ops round them.

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kMaxHead = 1024;

inline float mul(float a, float b) { return a * b; }
inline float add(float a, float b) { return a + b; }
inline uint16_t mul(uint16_t a, uint16_t b) { return to_bf16(to_float(a) * to_float(b)); }
inline uint16_t add(uint16_t a, uint16_t b) { return to_bf16(to_float(a) + to_float(b)); }

// One head's first (or second) half: out[j] = v[j] * c[j] + other[j] * s[j], j < count.
inline void rotate_half(const float* v, const float* other, const float* c, const float* s, float* out,
                        int64_t count) {
  for (int64_t j = 0; j < count; ++j) out[j] = add(mul(v[j], c[j]), mul(other[j], s[j]));
}

inline void rotate_half(const uint16_t* v, const uint16_t* other, const uint16_t* c, const uint16_t* s, uint16_t* out,
                        int64_t count) {
  int64_t j = 0;
#ifdef __AVX2__
  for (; j + 8 <= count; j += 8) {
    const __m256 a = round_bf16(_mm256_mul_ps(load8(v + j), load8(c + j)));
    const __m256 b = round_bf16(_mm256_mul_ps(load8(other + j), load8(s + j)));
    store8_bf16(out + j, round_bf16(_mm256_add_ps(a, b)));
  }
#endif
  for (; j < count; ++j) out[j] = add(mul(v[j], c[j]), mul(other[j], s[j]));
}

template <typename T>
int rotary(T* x, int64_t ldx, const T* cos, const T* sin, int64_t t, int64_t heads, int64_t d, int threads) {
  if (d % 2 || d > kMaxHead) return 1;
  const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && t * heads * d >= (1 << 16))
  for (int64_t row = 0; row < t; ++row) {
    const T* c = cos + row * d;
    const T* s = sin + row * d;
    T v[kMaxHead];
    for (int64_t h = 0; h < heads; ++h) {
      T* head = x + row * ldx + h * d;
      std::memcpy(v, head, d * sizeof(T));
      rotate_half(v, v + half, c, s, head, half);
      rotate_half(v + half, v, c + half, s + half, head + half, half);
    }
  }
  return 0;
}

}  // namespace

// x [t, heads, d] (rows ldx floats apart, heads d apart), cos and sin [t, d] as
// RotaryEmbedding.tables gives them.
extern "C" int ladle_rotary(float* x, int64_t ldx, const float* cos, const float* sin, int64_t t, int64_t heads,
                            int64_t d, int threads) {
  return rotary(x, ldx, cos, sin, t, heads, d, threads);
}

// The same for bfloat16 x and tables (their bits as uint16_t).
extern "C" int ladle_rotary_bf16(uint16_t* x, int64_t ldx, const uint16_t* cos, const uint16_t* sin, int64_t t,
                                 int64_t heads, int64_t d, int threads) {
  return rotary(x, ldx, cos, sin, t, heads, d, threads);
}
