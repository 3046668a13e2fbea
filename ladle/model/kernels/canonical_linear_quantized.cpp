// The canonical kernel on int8 and 4-bit panels, in a source of its own so that it compiles
// in parallel with the float and bf16 instantiations (canonical_linear.cpp).

#include "canonical_linear.h"

void canonical_linear_quantized(const float* x, int64_t ldx, const void* packed, bool four_bit, const float* scales,
                                const void* group_scales, const void* group_mins, bool half, int64_t group_size,
                                const float* bias, float* y, int64_t m, int64_t k, int64_t n, int threads) {
  Groups groups;
  if (group_scales) groups = {group_scales, group_mins, nullptr, group_size, k / group_size, half};
  if (four_bit)
    canonical_linear(x, ldx, static_cast<const int4x2*>(packed), scales, groups, bias, y, m, k, n, threads);
  else
    canonical_linear(x, ldx, static_cast<const int8_t*>(packed), scales, groups, bias, y, m, k, n, threads);
}
