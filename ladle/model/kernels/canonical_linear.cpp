// The canonical kernel's entry points (the kernel itself: canonical_linear.h).

#include "canonical_linear.h"

// Weight element types of the packed panels.
enum WeightType { kFloat32 = 0, kBFloat16 = 1, kInt8 = 2, kInt4 = 3 };

// Packs w[n, k] (elements of WeightType wtype) into 16-column panels: out must hold
// ceil(n / 16) * 16 * k elements of the same type. kInt4 takes int8 values 0..15 and packs
// them into ceil(n / 16) * 16 * k / 2 bytes.
extern "C" void ladle_pack_panels(const void* w, void* out, int64_t n, int64_t k, int wtype) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  if (wtype == kInt4) {  // int8 values 0..15, k even: two inputs to a byte
    const auto* src = static_cast<const uint8_t*>(w);
    auto* dst = static_cast<uint8_t*>(out);
    std::memset(dst, 0, panels * kPanel * (k / 2));
    for (int64_t col = 0; col < n; ++col)
      for (int64_t i = 0; i < k; ++i)
        dst[((col / kPanel) * (k / 2) + i / 2) * kPanel + col % kPanel] |= (src[col * k + i] & 15) << (4 * (i & 1));
    return;
  }
  const int64_t size = wtype == kInt8 ? 1 : wtype == kBFloat16 ? 2 : 4;
  auto* dst = static_cast<char*>(out);
  const auto* src = static_cast<const char*>(w);
  std::memset(dst, 0, panels * kPanel * k * size);
  for (int64_t col = 0; col < n; ++col)
    for (int64_t i = 0; i < k; ++i)
      std::memcpy(dst + ((col / kPanel) * k * kPanel + i * kPanel + col % kPanel) * size, src + (col * k + i) * size,
                  size);
}

// y[m, n] (row stride n) = x[m, k] (row stride ldx) @ W^T (* scales) (+ bias), W packed by
// ladle_pack_panels; scales (one per output column) only for int8 weights, else nullptr.
// Grouped int8 and 4-bit weights instead pass group_scales (and optionally group_mins), each
// [ceil(n / 16), k / group_size, 16], float32 or (half) fp16, and group_size (which divides k);
// scales is then null. 4-bit weights are always grouped.
extern "C" void ladle_canonical_linear(const float* x, int64_t ldx, const void* packed, int wtype,
                                       const float* scales, const void* group_scales, const void* group_mins,
                                       int half, int64_t group_size, const float* bias, float* y, int64_t m,
                                       int64_t k, int64_t n, int threads) {
  if (wtype == kInt8 || wtype == kInt4)
    return canonical_linear_quantized(x, ldx, packed, wtype == kInt4, scales, group_scales, group_mins, half != 0,
                                      group_size, bias, y, m, k, n, threads);
  if (wtype == kBFloat16)
    canonical_linear(x, ldx, static_cast<const uint16_t*>(packed), nullptr, Groups{}, bias, y, m, k, n, threads);
  else canonical_linear(x, ldx, static_cast<const float*>(packed), nullptr, Groups{}, bias, y, m, k, n, threads);
}

// The same for bfloat16 rows of x (row stride ldx) and a bfloat16 y: x widened exactly, the sums
// rounded once to bf16, as `canonical_linear(x.float(), ...).to(bfloat16)` gives them, without
// the two tensor conversions around every call of a bf16 model's decode step.
extern "C" void ladle_canonical_linear_bf16(const uint16_t* x, int64_t ldx, const void* packed, int wtype,
                                            const float* scales, const void* group_scales, const void* group_mins,
                                            int half, int64_t group_size, const float* bias, uint16_t* y, int64_t m,
                                            int64_t k, int64_t n, int threads) {
  thread_local std::vector<float> wide, sums;
  wide.resize(m * k);
  sums.resize(m * n);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) wide[r * k + i] = to_float(x[r * ldx + i]);
  ladle_canonical_linear(wide.data(), k, packed, wtype, scales, group_scales, group_mins, half, group_size, bias,
                         sums.data(), m, k, n, threads);
  for (int64_t i = 0; i < m * n; ++i) y[i] = to_bf16(sums[i]);
}

// The instruction set this library was built for, as the loader reports it.
extern "C" const char* ladle_isa() {
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return "amx";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}
