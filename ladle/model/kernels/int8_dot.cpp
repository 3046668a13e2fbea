// Per-row int8 weights on integer dot products: the weights as they are stored, each row of x
// quantised to 8 bits per block of 32 inputs on the fly (llama.cpp's Q8_0 x Q8_0 arithmetic).
// A decode step then costs one VNNI instruction (or three AVX2 ones) per 64 weights instead of a
// widening and an FMA per 16, so it runs at the speed memory delivers the weights.
//
// W[n, k] = q[n, k] * s[n], q in -127..127, held as u = q + 128 (uint8) in panels of 16 output
// columns with four consecutive inputs of a column side by side:
//
//     panel p: [k / 4][16][4], byte (i / 4, j, i % 4) = u[16p + j, i]      (columns past N: 128)
//
// so one 64-byte line is 16 columns x 4 inputs, what one vpdpbusd multiplies. Row m of x is
// quantised per block b of 32 inputs: a = max |x| over the block, sx = a / 127, xq = x * (127 / a)
// rounded to nearest even (0 where a = 0). Each output is then
//
//     isum[b] = sum over the block of q * xq      (int32: exact, so every order gives the same)
//     acc = 0;  for each block in order: acc = fma(float(isum[b]), sx[b], acc)
//     y = acc * s[n] + bias[n]
//
// AVX-512 VNNI (u times xq, less 128 times the block's sum of xq), AVX2 (|xq| times q carrying
// xq's sign, vpmaddubsw: no pair exceeds 2 * 127 * 127) and the scalar loop give the same isum and
// run the same float steps, so the same bits; a row's bits depend on nothing else in the call, so
// the kernel is batch-invariant by construction, as canonical (scoring) rows need.
//
// On AMX (the `amx` build, or tiles emulated in tests) ladle_int8_amx_linear computes the same
// isum with TDPBSUD for up to 32 rows at once: x's quantised rows are the signed tile A (one block
// of 32 inputs per tile row), a panel's block of W (8 lines of 16 columns x 4 inputs, as packed) the
// unsigned tile B, so each tile product is u times xq over one block, less 128 times its sum as
// above. The float steps are the same, so the same bits as every other path.

#include "amx_tiles.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // inputs per activation scale
constexpr int64_t kSteps = kBlock / 4;  // 4-input steps per block

// x's rows quantised: xq[m][k], and per row and block its scale and sum of xq.
struct QuantisedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
  int64_t k = 0, blocks = 0;
};

void quantise_row(const float* x, int8_t* q, float* scale, int32_t* sum, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float a = 0.0f;
    bool finite = true;
    for (int64_t i = 0; i < kBlock; ++i) {
      a = std::max(a, std::fabs(xb[i]));
      finite &= std::isfinite(xb[i]);
    }
    int32_t s = 0;
    if (!finite || a == 0.0f) {  // zeros; a NaN scale carries a non-finite input into the outputs
      std::fill(q + b * kBlock, q + (b + 1) * kBlock, int8_t(0));
      scale[b] = finite ? 0.0f : NAN;
    } else {
      const float inv = 127.0f / a;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
        q[b * kBlock + i] = static_cast<int8_t>(std::clamp(v, -127, 127));
        s += q[b * kBlock + i];
      }
      scale[b] = a / 127.0f;
    }
    sum[b] = s;
  }
}

QuantisedRows quantise(const float* x, int64_t ldx, int64_t m, int64_t k, int threads) {
  QuantisedRows r;
  r.k = k;
  r.blocks = k / kBlock;
  r.q.resize(m * k);
  r.scale.resize(m * r.blocks);
  r.sum.resize(m * r.blocks);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m * k >= (1 << 16))
  for (int64_t row = 0; row < m; ++row)
    quantise_row(x + row * ldx, r.q.data() + row * k, r.scale.data() + row * r.blocks, r.sum.data() + row * r.blocks,
                 r.blocks);
  return r;
}

inline int32_t dword(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc[R][P * 16] for rows [row, row + R) and P panels from `w` (panel_stride bytes apart).
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr int kWide = 4;  // panels per tile for one or two rows: independent chains for the few rows
constexpr int kMaxRows = 4;

template <int R, int P>
void tile(const QuantisedRows& x, int64_t row, const uint8_t* w, int64_t panel_stride, float* c) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m512i isum[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) isum[r][p] = _mm512_setzero_si512();
    for (int64_t s = 0; s < kSteps; ++s) {
      const int64_t step = b * kSteps + s;
      __m512i wv[P];
      for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_si512(w + p * panel_stride + step * 64);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(dword(x.q.data() + (row + r) * x.k + step * 4));
        for (int p = 0; p < P; ++p) isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], wv[p], xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row + r) * x.blocks + b;
      const __m512i offset = _mm512_set1_epi32(128 * x.sum[at]);
      const __m512 scale = _mm512_set1_ps(x.scale[at]);
      for (int p = 0; p < P; ++p)
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r][p], offset)), scale, acc[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(c + (r * P + p) * kPanel, acc[r][p]);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kWide = 1;
constexpr int kMaxRows = 2;

template <int R, int P>
void tile(const QuantisedRows& x, int64_t row, const uint8_t* w, int64_t, float* c) {
  static_assert(P == 1, "AVX2 tiles are one panel wide");
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m256i isum[R][2];
    for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    for (int64_t s = 0; s < kSteps; ++s) {
      const int64_t step = b * kSteps + s;
      __m256i q[2];  // u - 128 as signed bytes
      for (int h = 0; h < 2; ++h)
        q[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + step * 64 + h * 32)), flip);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_set1_epi32(dword(x.q.data() + (row + r) * x.k + step * 4));
        const __m256i magnitude = _mm256_abs_epi8(xv);
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(q[h], xv));
          isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(x.scale[(row + r) * x.blocks + b]);
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), scale, acc[r][h]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(c + r * kPanel + 8 * h, acc[r][h]);
}
#else
constexpr int kWide = 1;
constexpr int kMaxRows = 1;

template <int R, int P>
void tile(const QuantisedRows& x, int64_t row, const uint8_t* w, int64_t panel_stride, float* c) {
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int64_t j = 0; j < kPanel; ++j) {
        float acc = 0.0f;
        for (int64_t b = 0; b < x.blocks; ++b) {
          int32_t isum = 0;
          for (int64_t i = b * kBlock; i < (b + 1) * kBlock; ++i)
            isum += (int32_t(w[p * panel_stride + (i / 4) * 64 + j * 4 + i % 4]) - 128) * x.q[(row + r) * x.k + i];
          const int64_t at = (row + r) * x.blocks + b;
          acc = std::fma(static_cast<float>(isum), x.scale[at], acc);
        }
        c[(r * P + p) * kPanel + j] = acc;
      }
}
#endif

// Dispatches `rows` (1..kMaxRows) to the instantiation for that count.
template <int P, int R = kMaxRows>
void tile_rows(int64_t rows, const QuantisedRows& x, int64_t row, const uint8_t* w, int64_t stride, float* c) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, P>(x, row, w, stride, c);
    return tile_rows<P, R - 1>(rows, x, row, w, stride, c);
  }
}

// Every path's last step: rows of sums (ld apart) for columns [col0, col0 + cols) into y (rows n apart),
// each times its column's weight scale, plus the bias.
void store_outputs(const float* sums, int64_t ld, int64_t rows, const float* scales, const float* bias, float* y,
                   int64_t n, int64_t col0, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      const float v = sums[r * ld + j] * scales[col0 + j];
      y[r * n + col0 + j] = bias ? v + bias[col0 + j] : v;
    }
}

// Panels [first, end) for every row: each panel group is read from memory once and serves all
// row tiles from cache.
void panel_range(const QuantisedRows& x, int64_t m, const uint8_t* packed, const float* scales, const float* bias,
                 float* y, int64_t n, int64_t first, int64_t end) {
  const int64_t stride = x.k * kPanel;
  const int wide = m <= 2 ? kWide : 1;
  alignas(64) float c[kMaxRows * kWide * kPanel];
  for (int64_t p = first; p < end;) {
    const int64_t panels = p + wide <= end ? wide : 1;
    const uint8_t* w = packed + p * stride;
    for (int64_t row = 0; row < m; row += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, m - row);
      if (panels == kWide) tile_rows<kWide>(rows, x, row, w, stride, c);
      else tile_rows<1>(rows, x, row, w, stride, c);
      const int64_t col0 = p * kPanel;
      store_outputs(c, panels * kPanel, rows, scales, bias, y + row * n, n, col0, std::min(panels * kPanel, n - col0));
    }
    p += panels;
  }
}

}  // namespace

// y[m, n] = x[m, k] (rows ldx apart) @ W^T (+ bias) for W packed as above (k a multiple of 32).
extern "C" void ladle_int8_dot_linear(const float* x, int64_t ldx, const uint8_t* packed, const float* scales,
                                      const float* bias, float* y, int64_t m, int64_t k, int64_t n, int threads) {
  const QuantisedRows rows = quantise(x, ldx, m, k, threads);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  threads = matmul_threads(m, n, k, (panels + kWide - 1) / kWide, threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const auto [first, end] = panel_share(panels, kWide, threads);
    panel_range(rows, m, packed, scales, bias, y, n, first, end);
  }
}

#ifdef LADLE_AMX_INT8
namespace {

constexpr int kAmxMaxRows = 32;  // two A tiles of 16 rows
constexpr int64_t kBlockBytes = kSteps * 64;  // a panel's block: 8 lines of 16 columns x 4 inputs

// Tiles for x halves of m0 and m1 rows (m1 = 0: one half): tmm6, tmm7 x's halves for one block
// (32 signed bytes a row), tmm4, tmm5 two panels' block of W (8 lines of 64 unsigned bytes), and
// tmm0-3 the int32 sums, tmm(2 * panel + half): [rows, 16 columns].
TileConfig int8_tiles(int m0, int m1) {
  TileConfig cfg = blank_config();
  const int halves[2] = {m0, m1};
  for (int h = 0; h < 2; ++h) {
    if (!halves[h]) continue;
    cfg.rows[6 + h] = static_cast<uint8_t>(halves[h]);
    cfg.colsb[6 + h] = kBlock;
    for (int panel = 0; panel < 2; ++panel) {
      cfg.rows[2 * panel + h] = static_cast<uint8_t>(halves[h]);
      cfg.colsb[2 * panel + h] = kPanel * 4;
    }
  }
  for (int b = 4; b < 6; ++b) {
    cfg.rows[b] = kSteps;
    cfg.colsb[b] = 64;
  }
  return cfg;
}

// One block's int32 sums of panels' tile pairs, folded into acc[panel][row * 16 + j] as the other
// paths fold theirs: acc = fma(float(isum - 128 * xsum), x's scale, acc).
void fold_block(const QuantisedRows& x, int64_t b, int m0, int m, int panels,
                const int32_t (&sums)[2][2][kTileRows * kPanel], float (&acc)[2][kAmxMaxRows * kPanel]) {
  for (int pp = 0; pp < panels; ++pp)
    for (int r = 0; r < m; ++r) {
      const int half = r < m0 ? 0 : 1;
      const int32_t* s = sums[pp][half] + (r - half * m0) * kPanel;
      const int64_t at = r * x.blocks + b;
      const int32_t offset = 128 * x.sum[at];
      const float scale = x.scale[at];
      float* a = acc[pp] + r * kPanel;
      for (int j = 0; j < kPanel; ++j) a[j] = std::fma(static_cast<float>(s[j] - offset), scale, a[j]);
    }
}

// Panels [first, end), two at a time, for all m = m0 + m1 rows.
void amx_panel_range(const QuantisedRows& x, int m0, int m1, const uint8_t* packed, const float* scales,
                     const float* bias, float* y, int64_t n, int64_t first, int64_t end) {
  const int64_t panel_bytes = x.k * kPanel;
  const int m = m0 + m1;
  alignas(64) int32_t sums[2][2][kTileRows * kPanel];  // [panel][half]: a tile's rows of 16 sums
  alignas(64) float acc[2][kAmxMaxRows * kPanel];
  load_config(int8_tiles(m0, m1));
  for (int64_t p = first; p < end; p += 2) {
    const int panels = p + 1 < end ? 2 : 1;
    std::memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < x.blocks; ++b) {
      const uint8_t* w = packed + p * panel_bytes + b * kBlockBytes;
      TILE_ZERO(0);
      TILE_ZERO(2);
      TILE_LOAD(6, x.q.data() + b * kBlock, x.k);
      TILE_LOAD(4, w, 64);
      TILE_DOT_SU(0, 6, 4);
      if (m1) {
        TILE_ZERO(1);
        TILE_ZERO(3);
        TILE_LOAD(7, x.q.data() + m0 * x.k + b * kBlock, x.k);
        TILE_DOT_SU(1, 7, 4);
      }
      if (panels == 2) {
        TILE_LOAD(5, w + panel_bytes, 64);
        TILE_DOT_SU(2, 6, 5);
        if (m1) TILE_DOT_SU(3, 7, 5);
      }
      TILE_STORE(0, sums[0][0], kPanel * 4);
      if (m1) TILE_STORE(1, sums[0][1], kPanel * 4);
      if (panels == 2) {
        TILE_STORE(2, sums[1][0], kPanel * 4);
        if (m1) TILE_STORE(3, sums[1][1], kPanel * 4);
      }
      fold_block(x, b, m0, m, panels, sums, acc);
    }
    for (int pp = 0; pp < panels; ++pp) {
      const int64_t col0 = (p + pp) * kPanel;
      store_outputs(acc[pp], kPanel, m, scales, bias, y, n, col0, std::min<int64_t>(kPanel, n - col0));
    }
  }
  TILE_RELEASE();
}

}  // namespace

// 1 where ladle_int8_amx_linear runs: the build has AMX-INT8 and Linux granted the tile state.
extern "C" int ladle_int8_amx_ready() { return tile_state_granted() ? 1 : 0; }

// ladle_int8_dot_linear's product on AMX tiles, the same bits, for 1 <= m <= 32 rows. Returns 0, -1
// for a row count out of range, -2 where the kernels are not built for AMX-INT8, -3 where the
// kernel cannot get the tile state.
extern "C" int ladle_int8_amx_linear(const float* x, int64_t ldx, const uint8_t* packed, const float* scales,
                                     const float* bias, float* y, int64_t m, int64_t k, int64_t n, int threads) {
  if (m < 1 || m > kAmxMaxRows) return -1;
  if (!tile_state_granted()) return -3;
  const QuantisedRows rows = quantise(x, ldx, m, k, threads);
  const int m0 = static_cast<int>(std::min<int64_t>(m, kTileRows)), m1 = static_cast<int>(m - m0);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  threads = matmul_threads(m, n, k, (panels + 1) / 2, threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const auto [first, end] = panel_share(panels, 2, threads);
    if (first < end) amx_panel_range(rows, m0, m1, packed, scales, bias, y, n, first, end);
  }
  return 0;
}
#else
extern "C" int ladle_int8_amx_ready() { return 0; }

extern "C" int ladle_int8_amx_linear(const float*, int64_t, const uint8_t*, const float*, const float*, float*, int64_t,
                                     int64_t, int64_t, int) {
  return -2;  // not built for AMX-INT8
}
#endif

// out[i, 16 * (p - first_panel) + j] = W[16p + j, i] = (u - 128) * s (the float the checkpoint's
// dequantisation gives) for panels [first_panel, end_panel): W^T's columns as a float32
// [k, 16 * panels] matrix, row stride ld, for a GEMM.
extern "C" void ladle_widen_dot_panels(const uint8_t* packed, const float* scales, int64_t k, int64_t first_panel,
                                       int64_t end_panel, float* out, int64_t ld, int threads) {
  const int64_t steps = k / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t step = 0; step < steps; ++step) {
    for (int64_t p = first_panel; p < end_panel; ++p) {
      const uint8_t* line = packed + p * k * kPanel + step * 64;
      const float* s = scales + p * kPanel;
      float* o = out + step * 4 * ld + (p - first_panel) * kPanel;
#if defined(__AVX512F__)
      const __m512i v = _mm512_loadu_si512(line);
      const __m512 sv = _mm512_loadu_ps(s);
      for (int i = 0; i < 4; ++i) {
        const __m512i u = _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(255));
        const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(128)));
        _mm512_storeu_ps(o + i * ld, _mm512_mul_ps(q, sv));
      }
#else
      for (int i = 0; i < 4; ++i)
        for (int64_t j = 0; j < kPanel; ++j) o[i * ld + j] = static_cast<float>(int(line[j * 4 + i]) - 128) * s[j];
#endif
    }
  }
}
