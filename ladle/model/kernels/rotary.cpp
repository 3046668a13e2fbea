// Rotary embedding in place, exactly as layers.apply_rotary computes it in torch:
//
//     x * cos + rotate_half(x) * sin      (rotate_half's sign lives in the sin table)
//
// each product rounded to float32, then their sum: the same three roundings as the torch ops
// it replaces, so the same bits, at one call per step instead of five tensor ops.

#include <algorithm>
#include <cstdint>
#include <cstring>

// x [t, heads, d] (rows ldx floats apart, heads d apart), cos and sin [t, d] as
// RotaryEmbedding.tables gives them.
extern "C" int ladle_rotary(float* x, int64_t ldx, const float* cos, const float* sin, int64_t t, int64_t heads,
                            int64_t d, int threads) {
  constexpr int64_t kMaxHead = 1024;
  if (d % 2 || d > kMaxHead) return 1;
  const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && t * heads * d >= (1 << 16))
  for (int64_t row = 0; row < t; ++row) {
    const float* c = cos + row * d;
    const float* s = sin + row * d;
    float v[kMaxHead];
    for (int64_t h = 0; h < heads; ++h) {
      float* head = x + row * ldx + h * d;
      std::memcpy(v, head, d * sizeof(float));
      for (int64_t j = 0; j < half; ++j) head[j] = v[j] * c[j] + v[j + half] * s[j];
      for (int64_t j = half; j < d; ++j) head[j] = v[j] * c[j] + v[j - half] * s[j];
    }
  }
  return 0;
}
