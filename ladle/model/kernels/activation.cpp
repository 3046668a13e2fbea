// SwiGLU's activation in place: gate = silu(gate) * up for each row of a fused gate_up
// projection, where silu(x) = x * sigmoid(x) and sigmoid takes e^-|x| (never overflows):
//
//     e = exp(-|x|);  sigmoid = x >= 0 ? 1 / (1 + e) : e / (1 + e);  gate = (x * sigmoid) * up
//
// The vector body and the scalar tail run the same operations (simd.h's exp_nonpositive), so
// an element's bits depend on its value alone: not on its column, its row or the row count.
// In bfloat16 it rounds where torch's `F.silu(gate).mul_(up)` rounds: silu(x) to bf16, then the
// product to bf16.

#include "simd.h"

#include <cmath>
#include <cstdint>

namespace {

// x * sigmoid(x), the sigmoid taken from e^-|x|; the vector form runs the same operations.
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  return x * (x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

#ifdef __AVX2__
inline __m256 silu(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp_nonpositive(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));  // e^-|x|
  const __m256 positive = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
  return _mm256_mul_ps(x, _mm256_div_ps(_mm256_blendv_ps(e, one, positive), _mm256_add_ps(one, e)));
}
#endif

void silu_and_mul_row(float* gate, const float* up, int64_t n) {
  int64_t j = 0;
#ifdef __AVX2__
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(gate + j, _mm256_mul_ps(silu(_mm256_loadu_ps(gate + j)), load8(up + j)));
#endif
  for (; j < n; ++j) gate[j] = silu(gate[j]) * up[j];
}

// silu rounded to bf16, then the product rounded to bf16.
void silu_and_mul_row_bf16(uint16_t* gate, const uint16_t* up, int64_t n) {
  int64_t j = 0;
#ifdef __AVX2__
  for (; j + 8 <= n; j += 8)
    store8_bf16(gate + j, round_bf16(_mm256_mul_ps(round_bf16(silu(load8(gate + j))), load8(up + j))));
#endif
  for (; j < n; ++j) gate[j] = to_bf16(to_float(to_bf16(silu(to_float(gate[j])))) * to_float(up[j]));
}

}  // namespace

// Rows of gate_up ld floats apart, each [gate (n) | up (n)]; the result replaces gate.
extern "C" void ladle_silu_and_mul(float* gate_up, int64_t ld, int64_t m, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m * n >= (1 << 16))
  for (int64_t row = 0; row < m; ++row) silu_and_mul_row(gate_up + row * ld, gate_up + row * ld + n, n);
}

// The same over bfloat16 rows (their bits as uint16_t), ld elements apart.
extern "C" void ladle_silu_and_mul_bf16(uint16_t* gate_up, int64_t ld, int64_t m, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m * n >= (1 << 16))
  for (int64_t row = 0; row < m; ++row) silu_and_mul_row_bf16(gate_up + row * ld, gate_up + row * ld + n, n);
}
