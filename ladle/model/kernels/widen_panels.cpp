// int8 and 4-bit panels widened back to float weights, for prompts: a call with many rows
// reuses each weight often enough that widening a slice of W once and handing it to a float
// GEMM (MKL's) beats converting the same weights again in every row tile of the canonical
// kernel. Canonical (batch-invariant) calls never come here: they keep their fixed chains.
//
// Each weight is widened as its format defines it: q * scale (+ minimum), a multiply and an
// add, the same operations (and so the same float) as dequantising the checkpoint to float.

#include "widen.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// The 16 parameters (scales or minimums) of one panel's group at `at`, float32 or fp16 bits.
inline void load_params(const void* params, int64_t at, bool half, float* out) {
  if (!half) {
    std::memcpy(out, static_cast<const float*>(params) + at, kPanel * sizeof(float));
    return;
  }
  const uint16_t* bits = static_cast<const uint16_t*>(params) + at;
#if defined(__AVX512F__)
  _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)bits)));
#elif defined(__F16C__)
  _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)bits)));
  _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(bits + 8))));
#else
  for (int64_t j = 0; j < kPanel; ++j) out[j] = half_to_float(bits[j]);
#endif
}

}  // namespace

// out[i, 16 * (p - first_panel) + j] = W[16p + j, i] for panels [first_panel, end_panel): the
// weights of those panels as a float32 [k, 16 * panels] matrix (W^T's columns, row stride ld),
// so a GEMM computes x @ out. Per-column `scales` (int8 per row) or grouped `group_scales` and
// optional `group_mins` as ladle_canonical_linear takes them. wtype: 2 int8, 3 4-bit.
extern "C" void ladle_widen_panels(const void* packed, int wtype, const float* scales, const void* group_scales,
                                   const void* group_mins, int half, int64_t group_size, int64_t k,
                                   int64_t first_panel, int64_t end_panel, float* out, int64_t ld, int threads) {
  const bool four_bit = wtype == 3;
  const int64_t panel_bytes = four_bit ? k / 2 * kPanel : k * kPanel;
  const int64_t groups = group_scales != nullptr ? k / group_size : 1;
  const int64_t size = group_scales != nullptr ? group_size : k;
  // Rows of out are written a block at a time across this thread's panels: one panel's k rows
  // at a time would store down a column, ld apart, which thrashes the L1 sets and the TLB.
  constexpr int64_t kRowBlock = 32;  // even: 4-bit byte rows hold two inputs
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), count = omp_get_num_threads();
#else
    const int t = 0, count = 1;
#endif
    const int64_t panels = end_panel - first_panel;
    const int64_t p0 = first_panel + panels * t / count, p1 = first_panel + panels * (t + 1) / count;
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t i = g * size; i < (g + 1) * size; i += kRowBlock)
        for (int64_t p = p0; p < p1; ++p) {
          float scale[kPanel], min[kPanel] = {};
          const int64_t at = (p * groups + g) * kPanel;
          if (group_scales != nullptr) load_params(group_scales, at, half, scale);
          else std::memcpy(scale, scales + p * kPanel, sizeof scale);
          if (group_mins != nullptr) load_params(group_mins, at, half, min);
          const auto* base = static_cast<const uint8_t*>(packed) + p * panel_bytes;
          widen_rows(reinterpret_cast<const int8_t*>(base), four_bit ? base : nullptr, i,
                     std::min(i + kRowBlock, (g + 1) * size), scale, min, out + (p - first_panel) * kPanel, ld);
        }
  }
}
