// The sampler's passes over whole vocabulary rows, on the CPU: each row's greedy token (argmax), and
// top_p's nucleus without sorting.
//
// argmax: the index of a row's largest value, the first of equal ones, a NaN before any number (as
// torch.argmax gives it), one pass of 8-lane maxima that keep each lane's first index.
//
// top_p's nucleus without sorting the vocabulary (the sampler's, on the CPU): in place, each row's
// probabilities outside its nucleus become 0. The nucleus is what a sort finds: the row's tokens in
// descending order, each kept while the mass before it is at most top_p,
//
//     keep token j (the j-th likeliest)  iff  p(1) + ... + p(j - 1) <= top_p
//
// Sorting a 150k vocabulary takes the CPU milliseconds a row. Instead, the tokens go into buckets by
// their value's top 16 bits (sign, exponent, 7 bits of mantissa: for p >= 0 the bucket order is the
// value order), each bucket's mass summed in float64 in token order. Walking the buckets down from
// the likeliest finds the one where the mass first passes top_p: every token above it is kept, every
// token below it dropped, and only its own few tokens are sorted (ties by token id) to find where in
// it the nucleus ends. A row's result depends on its values alone, the same on every instruction set.
//
// The masses are summed in float64, where a sort's cumsum (the torch path, a GPU's) sums in float32:
// the two can disagree only about a token whose mass before it is within float32's rounding of top_p.

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBuckets = 1 << 15;  // top 16 bits of a non-negative float (NaN's and inf's included)

inline uint32_t bucket_of(float p) {
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  return std::min<uint32_t>(bits >> 16, kBuckets - 1);  // a negative value (none in probabilities) goes last
}

void keep_nucleus_row(float* p, int64_t vocab, double top_p, std::vector<double>& mass) {
  std::fill(mass.begin(), mass.end(), 0.0);
  for (int64_t i = 0; i < vocab; ++i) mass[bucket_of(p[i])] += p[i];
  double above = 0.0;
  int64_t edge = -1;  // the bucket where the mass passes top_p
  for (int64_t b = kBuckets - 1; b >= 0; --b) {
    if (above + mass[b] > top_p) {
      edge = b;
      break;
    }
    above += mass[b];
  }
  if (edge < 0) return;  // the whole row's mass is at most top_p: every token is kept
  std::vector<std::pair<float, int64_t>> tied;  // the edge bucket's tokens, likeliest first
  for (int64_t i = 0; i < vocab; ++i) {
    const int64_t b = bucket_of(p[i]);
    if (b == edge) tied.emplace_back(p[i], i);
    else if (b < edge) p[i] = 0.0f;
  }
  std::sort(tied.begin(), tied.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  double before = above;
  for (const auto& [value, i] : tied) {
    if (before > top_p) p[i] = 0.0f;
    before += value;
  }
}

// The index of the first NaN, else of the first largest value (-inf everywhere: 0).
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float top = -INFINITY;
  bool nan = false;
#ifdef __AVX2__
  if (n >= 8) {
    __m256 lane_top = _mm256_loadu_ps(x), unordered = _mm256_cmp_ps(lane_top, lane_top, _CMP_UNORD_Q);
    __m256i lane_at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = lane_at;
    for (i = 8; i + 8 <= n; i += 8) {
      at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 above = _mm256_cmp_ps(v, lane_top, _CMP_GT_OQ);  // strictly: a lane keeps its first index
      lane_top = _mm256_blendv_ps(lane_top, v, above);
      lane_at = _mm256_blendv_epi8(lane_at, at, _mm256_castps_si256(above));
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    alignas(32) float tops[8];
    alignas(32) int32_t ats[8];
    _mm256_store_ps(tops, lane_top);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ats), lane_at);
    top = tops[0], best = ats[0];
    for (int lane = 1; lane < 8; ++lane)
      if (tops[lane] > top || (tops[lane] == top && ats[lane] < best)) top = tops[lane], best = ats[lane];
  }
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    if (x[i] > top) top = x[i], best = i;
  }
  if (nan)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  return best;
}

}  // namespace

// probs[rows, vocab] (float32, contiguous, non-negative), top_p[rows]: a row whose top_p is 1 or more
// (inf: off) keeps every token.
extern "C" void ladle_keep_nucleus(float* probs, const float* top_p, int64_t rows, int64_t vocab, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1 && rows > 1)
  {
    std::vector<double> mass(kBuckets);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      if (top_p[r] < 1.0f) keep_nucleus_row(probs + r * vocab, vocab, top_p[r], mass);
  }
}

// tokens[r] = the argmax of x's row r (x[rows, vocab], float32, rows ld apart).
extern "C" void ladle_argmax(const float* x, int64_t ld, int64_t rows, int64_t vocab, int64_t* tokens, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * vocab >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) tokens[r] = argmax_row(x + r * ld, vocab);
}
