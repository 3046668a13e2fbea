// Intel AMX tiles for the kernels that use them (amx_linear.cpp: bf16; int8_dot.cpp: int8), on the
// CPU's tiles where the compiler targets AMX, or emulated in software under LADLE_AMX_EMULATE, so a
// kernel's packing, tile shapes and tails are tested on any CPU (tests/test_amx.py; never in ladle's
// own build). LADLE_AMX_TILES is 1 (the CPU's) or 2 (emulated) where tiles exist; LADLE_AMX_INT8
// where the int8 dot products do too.
//
// TILE_ZERO, TILE_LOAD, TILE_STORE, TILE_DOT_BF16 (TDPBF16PS), TILE_DOT_SU (TDPBSUD: signed A,
// unsigned B), TILE_RELEASE; load_config (our own ldtilecfg on a 64-byte operand: GCC 12.2's
// _tile_loadconfig is miscompiled); tile_state_granted (Linux's permission, asked once).

#pragma once

#include "simd.h"

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LADLE_AMX_TILES 1  // the CPU's tiles
#elif defined(LADLE_AMX_EMULATE)
#define LADLE_AMX_TILES 2  // tiles in software: the kernel's logic checked on CPUs without AMX (tests only)
#endif

#ifdef LADLE_AMX_TILES

namespace {

constexpr int kTileRows = 16;  // rows of a tile
constexpr int kTileBytes = 64;  // bytes of a tile row

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// Palette 1, every tile unused: a kernel sets the rows and bytes of the tiles it uses.
inline TileConfig blank_config() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  return cfg;
}

}  // namespace

#if LADLE_AMX_TILES == 1
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::: "memory")
#define TILE_LOAD(t, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define TILE_STORE(t, base, stride) \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
// C += A . B; AT&T order: B, A, C
#define TILE_DOT_BF16(c, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")
#define TILE_DOT_SU(c, a, b) asm volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")
#define TILE_RELEASE() asm volatile("tilerelease" ::: "memory")

namespace {

inline void load_config(const TileConfig& cfg) {
  asm volatile("ldtilecfg %0" ::"m"(*reinterpret_cast<const char(*)[64]>(&cfg)));
}

// Asks Linux for the AMX tile state (once per process); true if granted.
bool tile_state_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

}  // namespace

#else
// Each instruction as Intel's pseudocode states it, on eight tiles of 16 rows x 64 bytes a thread:
// a load or store moves the configured rows and bytes, and TDPBF16PS adds to each float32 of C the
// two products of its row of A's bf16 pairs with B's, one after the other, as that pseudocode does
// (the hardware's flushing of denormals left out).

namespace {

struct Tiles {
  TileConfig config;
  alignas(64) uint8_t data[8][kTileRows][kTileBytes];
};
thread_local Tiles tiles;

inline void load_config(const TileConfig& cfg) {
  tiles.config = cfg;
  std::memset(tiles.data, 0, sizeof tiles.data);
}

void tile_zero(int t) { std::memset(tiles.data[t], 0, sizeof tiles.data[t]); }

void tile_load(int t, const void* base, int64_t stride) {
  tile_zero(t);
  for (int r = 0; r < tiles.config.rows[t]; ++r)
    std::memcpy(tiles.data[t][r], static_cast<const char*>(base) + r * stride, tiles.config.colsb[t]);
}

void tile_store(int t, void* base, int64_t stride) {
  for (int r = 0; r < tiles.config.rows[t]; ++r)
    std::memcpy(static_cast<char*>(base) + r * stride, tiles.data[t][r], tiles.config.colsb[t]);
}

// C[m][n] += A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] over k, in A's and C's configured shapes.
void tile_dot_bf16(int c, int a, int b) {
  const int m_rows = tiles.config.rows[c], n_cols = tiles.config.colsb[c] / 4, pairs = tiles.config.colsb[a] / 4;
  for (int m = 0; m < m_rows; ++m)
    for (int k = 0; k < pairs; ++k)
      for (int n = 0; n < n_cols; ++n) {
        uint16_t a2[2], b2[2];
        float acc;
        std::memcpy(a2, tiles.data[a][m] + 4 * k, 4);
        std::memcpy(b2, tiles.data[b][k] + 4 * n, 4);
        std::memcpy(&acc, tiles.data[c][m] + 4 * n, 4);
        acc += to_float(a2[0]) * to_float(b2[0]);
        acc += to_float(a2[1]) * to_float(b2[1]);
        std::memcpy(tiles.data[c][m] + 4 * n, &acc, 4);
      }
}

// TDPBSUD: C[m][n] (int32) += A[m][4k + i] (signed) B[k][4n + i] (unsigned) over k and i < 4.
void tile_dot_su(int c, int a, int b) {
  const int m_rows = tiles.config.rows[c], n_cols = tiles.config.colsb[c] / 4, quads = tiles.config.colsb[a] / 4;
  for (int m = 0; m < m_rows; ++m)
    for (int n = 0; n < n_cols; ++n) {
      int32_t acc;
      std::memcpy(&acc, tiles.data[c][m] + 4 * n, 4);
      for (int k = 0; k < quads; ++k)
        for (int i = 0; i < 4; ++i)
          acc += int32_t(static_cast<int8_t>(tiles.data[a][m][4 * k + i])) * int32_t(tiles.data[b][k][4 * n + i]);
      std::memcpy(tiles.data[c][m] + 4 * n, &acc, 4);
    }
}

bool tile_state_granted() { return true; }

}  // namespace

#define TILE_ZERO(t) tile_zero(t)
#define TILE_LOAD(t, base, stride) tile_load(t, base, stride)
#define TILE_STORE(t, base, stride) tile_store(t, base, stride)
#define TILE_DOT_BF16(c, a, b) tile_dot_bf16(c, a, b)
#define TILE_DOT_SU(c, a, b) tile_dot_su(c, a, b)
#define TILE_RELEASE() std::memset(&tiles.config, 0, sizeof tiles.config)
#endif

#endif  // LADLE_AMX_TILES

#if defined(LADLE_AMX_TILES) && (LADLE_AMX_TILES == 2 || defined(__AMX_INT8__))
#define LADLE_AMX_INT8 1
#endif
