// y[M, N] = x[M, K] @ W^T (+ bias) for bfloat16 x, W and bias (their bits) and M <= 32 rows, on Intel AMX:
// a decode step's matmul, which must stream W from memory once at the bandwidth bound.
//
// W stays as the model holds it, [N, K] row-major: the roles are swapped so that W is the tile
// A (16 of its rows by 32 inputs, loaded straight from memory with the row stride K) and x,
// repacked per call into AMX's pair-interleaved layout, is the tile B. So C = W x^T, [16 n, M],
// is transposed on the way out. A call computes
//
//     C[n, m] += sum over pairs (k, k + 1) of W[n, k] x[m, k] + W[n, k + 1] x[m, k + 1]
//
// in float32 (TDPBF16PS), 32 inputs per tile step, adds the bias, then rounds to bf16 once, as
// torch's bf16 matmul does. Inputs past the last whole tile of 32 (K % 32) and output rows past the last 16 (N % 16)
// are added in plain float32. This is not the canonical kernel's order: canonical rows never
// come here (routing.py sends them to the canonical kernel).
//
// Tiles: tmm6 and tmm7 hold x's rows 0-15 and 16-31, tmm4 and tmm5 two 16-row blocks of W, and
// tmm0-3 the four accumulators (W block x x half). Tile configs are loaded with our own
// ldtilecfg on a 64-byte operand (GCC 12.2's _tile_loadconfig is miscompiled).
//
// Built only where the compiler targets AMX (-march=native on a CPU with AMX-BF16): the `amx`
// instruction set of loader.py. Elsewhere ladle_amx_linear returns -2 and is never routed to.
// Compiled with LADLE_AMX_EMULATE instead, the same kernel runs on tiles in software, so its
// packing, tile shapes and tails are tested on any CPU (tests/test_amx.py; never in ladle's build).

#include "amx_tiles.h"
#include "simd.h"

#include <cstdint>
#include <cstring>

#ifdef LADLE_AMX_TILES

namespace {

constexpr int kTile = 16;       // rows of every tile, and pairs of inputs per B tile
constexpr int kTileK = 32;      // bf16 inputs per tile step (64 bytes of an A row)
constexpr int kMaxRows = 32;    // x rows per call: two B tiles

// The config for x halves of m0 and m1 rows (m1 = 0: one half).
TileConfig config_for(int m0, int m1) {
  TileConfig cfg = blank_config();
  const int halves[2] = {m0, m1};
  for (int h = 0; h < 2; ++h) {
    if (!halves[h]) continue;
    for (int block = 0; block < 2; ++block) {  // accumulators tmm(2 * block + h): 16 n x m floats
      cfg.rows[2 * block + h] = kTile;
      cfg.colsb[2 * block + h] = static_cast<uint16_t>(halves[h] * 4);
    }
    cfg.rows[6 + h] = kTile;  // x half: 16 input pairs x m rows x 2 bf16
    cfg.colsb[6 + h] = static_cast<uint16_t>(halves[h] * 4);
  }
  for (int a = 4; a < 6; ++a) {  // W blocks: 16 rows x 32 bf16
    cfg.rows[a] = kTile;
    cfg.colsb[a] = kTileK * 2;
  }
  return cfg;
}

// x rows [first, first + m) as B tiles: tile t holds, for input pair r of inputs 32t..32t+31,
// row r = [x[first + j][32t + 2r], x[first + j][32t + 2r + 1]] for j < m.
void pack_half(const uint16_t* x, int64_t k, int first, int m, int64_t tiles, uint16_t* out) {
  for (int64_t t = 0; t < tiles; ++t)
    for (int r = 0; r < kTile; ++r)
      for (int j = 0; j < m; ++j) {
        const uint16_t* src = x + (first + j) * k + t * kTileK + 2 * r;
        uint16_t* dst = out + ((t * kTile + r) * m + j) * 2;
        dst[0] = src[0];
        dst[1] = src[1];
      }
}

// One 16-row block of W's float32 results [16, m] (acc, row stride m) plus the inputs past the
// last whole tile, rounded into y's columns n0..n0+15.
void finish_block(const float* acc, int m, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t k,
                  int64_t k_tiles, int64_t n0, int64_t n, uint16_t* y) {
  for (int i = 0; i < kTile; ++i)
    for (int j = 0; j < m; ++j) {
      float sum = acc[i * m + j];
      for (int64_t c = k_tiles * kTileK; c < k; ++c) sum += to_float(x[j * k + c]) * to_float(w[(n0 + i) * k + c]);
      if (bias) sum += to_float(bias[n0 + i]);
      y[j * n + n0 + i] = to_bf16(sum);
    }
}

// Pairs of W blocks [b, b + 2) for b in [first, last) (one block if only one is left).
void run_blocks(const uint16_t* x, const uint16_t* w, const uint16_t* bias, const uint16_t* packed0,
                const uint16_t* packed1, int m0, int m1, int64_t k, int64_t n, int64_t first, int64_t last, uint16_t* y) {
  const int64_t k_tiles = k / kTileK, stride_w = k * 2;
  alignas(64) float acc[2][2][kTile * kTile];  // [block][half]
  const TileConfig cfg = config_for(m0, m1);
  load_config(cfg);
  for (int64_t b = first; b < last; b += 2) {
    const bool two = b + 1 < last;
    const uint16_t* w0 = w + b * kTile * k;
    const uint16_t* w1 = w0 + kTile * k;
    TILE_ZERO(0);
    TILE_ZERO(2);
    if (m1) {
      TILE_ZERO(1);
      TILE_ZERO(3);
    }
    for (int64_t t = 0; t < k_tiles; ++t) {
      TILE_LOAD(6, packed0 + t * kTile * m0 * 2, m0 * 4);
      if (m1) TILE_LOAD(7, packed1 + t * kTile * m1 * 2, m1 * 4);
      TILE_LOAD(4, w0 + t * kTileK, stride_w);
      TILE_DOT_BF16(0, 4, 6);
      if (m1) TILE_DOT_BF16(1, 4, 7);
      if (two) {
        TILE_LOAD(5, w1 + t * kTileK, stride_w);
        TILE_DOT_BF16(2, 5, 6);
        if (m1) TILE_DOT_BF16(3, 5, 7);
      }
    }
    TILE_STORE(0, acc[0][0], m0 * 4);
    if (m1) TILE_STORE(1, acc[0][1], m1 * 4);
    if (two) {
      TILE_STORE(2, acc[1][0], m0 * 4);
      if (m1) TILE_STORE(3, acc[1][1], m1 * 4);
    }
    for (int block = 0; block < (two ? 2 : 1); ++block) {
      const int64_t n0 = (b + block) * kTile;
      finish_block(acc[block][0], m0, x, w, bias, k, k_tiles, n0, n, y);
      if (m1) finish_block(acc[block][1], m1, x + m0 * k, w, bias, k, k_tiles, n0, n, y + m0 * n);
    }
  }
  TILE_RELEASE();
}

}  // namespace

// 1 where the tiles may be used: Linux granted this process the AMX tile state.
extern "C" int ladle_amx_ready() { return tile_state_granted() ? 1 : 0; }

// y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]; bias may be null), all bfloat16 bits, x and y
// contiguous, 1 <= m <= 32. Returns 0, -1 for a row count out of range, -3 where the kernel
// cannot get the tile state.
extern "C" int ladle_amx_linear(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t m,
                                int64_t k, int64_t n, int threads) {
  if (m < 1 || m > kMaxRows) return -1;
  if (!ladle_amx_ready()) return -3;
  const int m0 = static_cast<int>(m < kTile ? m : kTile), m1 = static_cast<int>(m - m0);
  const int64_t k_tiles = k / kTileK, blocks = n / kTile;
  uint16_t* packed0 = new uint16_t[std::max<int64_t>(1, k_tiles * kTile * m0 * 2)];
  uint16_t* packed1 = m1 ? new uint16_t[std::max<int64_t>(1, k_tiles * kTile * m1 * 2)] : nullptr;
  pack_half(x, k, 0, m0, k_tiles, packed0);
  if (m1) pack_half(x, k, m0, m1, k_tiles, packed1);
  const int64_t pairs = (blocks + 1) / 2;
  const int used = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, pairs)));
#pragma omp parallel num_threads(used) if (used > 1)
  {
#ifdef _OPENMP
    const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
#else
    const int64_t me = 0, team = 1;
#endif
    // contiguous shares of whole pairs of blocks, so each thread streams one stretch of W
    const int64_t first = 2 * (pairs * me / team), last = std::min(blocks, 2 * (pairs * (me + 1) / team));
    if (first < last) run_blocks(x, w, bias, packed0, packed1, m0, m1, k, n, first, last, y);
  }
  for (int64_t row = blocks * kTile; row < n; ++row)  // output rows past the last whole block
    for (int64_t j = 0; j < m; ++j) {
      float sum = 0.0f;
      for (int64_t c = 0; c < k; ++c) sum += to_float(x[j * k + c]) * to_float(w[row * k + c]);
      if (bias) sum += to_float(bias[row]);
      y[j * n + row] = to_bf16(sum);
    }
  delete[] packed0;
  delete[] packed1;
  return 0;
}

#else

extern "C" int ladle_amx_ready() { return 0; }

extern "C" int ladle_amx_linear(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                                int) {
  return -2;  // not built for AMX
}

#endif
