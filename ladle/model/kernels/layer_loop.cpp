// A decode step's decoder layers in one call: the same kernels, with the same operands, that the
// Python forward calls one by one (ladle.model.decode_loop), so every output has the same bits; in
// float32, or in bfloat16 where the Python forward's conversions around attention are done here as
// torch does them (q widened exactly, the output rounded to nearest even).
// What it saves is the host's work between them: a step of a small model calls about ten kernels a
// layer, and at one row each call's Python and ctypes cost as much as its arithmetic.
//
// Per layer, for rows x of the residual stream h [rows, hidden] (updated in place):
//   x = rms_norm(h)                                 (the first layer's; later ones come from below)
//   qkv = x W_qkv^T + b;  rotary on q and k in place;  k, v written to the cache at their slots
//   attn = attention of each row's q over its sequence's cache (the prompt kernel, one row a span)
//   h += attn W_o^T;  x = rms_norm(h)
//   gate_up = x W_gu^T;  silu(gate) * up in place;  h += act W_down^T;  x = rms_norm(h) (the next norm)

#include "simd.h"

#include <chrono>
#include <cmath>
#include <cstdint>

extern "C" {
void ladle_rms_norm(const float* x, const float* w, float* y, int64_t m, int64_t n, float eps, int threads);
void ladle_rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t n, float eps,
                         int threads);
void ladle_add_rms_norm(float* h, const float* a, const float* w, float* y, int64_t m, int64_t n, float eps,
                        int threads);
void ladle_add_rms_norm_bf16(uint16_t* h, const uint16_t* a, const uint16_t* w, uint16_t* y, int64_t m, int64_t n,
                             float eps, int threads);
void ladle_silu_and_mul(float* gate_up, int64_t ld, int64_t m, int64_t n, int threads);
void ladle_silu_and_mul_bf16(uint16_t* gate_up, int64_t ld, int64_t m, int64_t n, int threads);
int ladle_rotary(float* x, int64_t ldx, const float* cos, const float* sin, int64_t t, int64_t heads, int64_t d,
                 int threads);
int ladle_rotary_bf16(uint16_t* x, int64_t ldx, const uint16_t* cos, const uint16_t* sin, int64_t t, int64_t heads,
                      int64_t d, int threads);
int ladle_write_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* k_cache, void* v_cache,
                   int64_t num_slots, const int64_t* slots, int64_t count, int64_t width, int64_t elem);
int ladle_write_kv_quantized(const float* k, int64_t k_stride, const float* v, int64_t v_stride, void* k_cache,
                             void* v_cache, float* k_scales, float* v_scales, int64_t num_slots, const int64_t* slots,
                             int64_t count, int64_t kv_heads, int64_t d, int fp8);
int ladle_prompt_attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache, int kv_type,
                           const float* k_scales, const float* v_scales, int64_t num_blocks,
                           const int64_t* block_tables, int64_t max_blocks, const int64_t* row_starts,
                           const int64_t* row_counts, const int64_t* first_positions, float* out, int64_t out_stride,
                           int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size,
                           float scale, int64_t window, const float* sinks, int threads);
void ladle_canonical_linear(const float* x, int64_t ldx, const void* packed, int wtype, const float* scales,
                            const void* group_scales, const void* group_mins, int half, int64_t group_size,
                            const float* bias, float* y, int64_t m, int64_t k, int64_t n, int threads);
void ladle_canonical_linear_bf16(const uint16_t* x, int64_t ldx, const void* packed, int wtype, const float* scales,
                                 const void* group_scales, const void* group_mins, int half, int64_t group_size,
                                 const float* bias, uint16_t* y, int64_t m, int64_t k, int64_t n, int threads);
void ladle_small_linear(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t k, int64_t n,
                        int threads);
void ladle_int8_dot_linear(const float* x, int64_t ldx, const uint8_t* packed, const float* scales,
                           const float* bias, float* y, int64_t m, int64_t k, int64_t n, int threads);
}

namespace {

// The layouts of decode_loop.py's ctypes structures: 8-byte fields only, so no padding differs.
enum Kernel : int64_t { kCanonical = 0, kSmall = 1, kDot = 2 };

struct LoopLinear {
  int64_t kernel;                // which kernel the Python Linear takes at this step's row count
  const void* weights;           // packed panels (canonical, dot) or W [n, k] (small)
  int64_t weight_type;           // canonical: the panels' element type
  const float* scales;           // int8 panels' per-output scales, or the dot kernel's
  const void* group_scales;      // grouped panels' scales and minimums (canonical)
  const void* group_mins;
  int64_t half;                  // group parameters in fp16
  int64_t group_size;
  const float* bias;
  int64_t k, n;
};

struct LoopLayer {
  const void* input_norm;        // norm weights in the step's dtype
  const void* post_attn_norm;
  LoopLinear qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
  float* k_scales;               // 8-bit caches: a scale per token and KV head
  float* v_scales;
  int64_t window;                // a sliding-window layer's (0: the whole context)
};

struct LoopStep {
  // the model's
  int64_t layers;
  const LoopLayer* layer;
  const void* final_norm;
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  double eps, scale;
  int64_t bf16;                  // the step's activations, norms and tables in bfloat16 (else float32)
  int64_t kv_type;               // prompt_attention's: 0 float32, 1 bfloat16, 2 int8, 3 fp8 e4m3
  int64_t num_blocks, block_size;
  // this step's
  int64_t rows;
  const void* cos;               // [rows, head_dim] rotary tables
  const void* sin;
  const int64_t* slots;          // [rows] each new token's cache slot
  const int64_t* block_tables;   // [rows, max_blocks]
  int64_t max_blocks;
  const int64_t* row_starts;     // the decodes as one-row spans
  const int64_t* row_counts;
  const int64_t* first_positions;
  void* h;                       // [rows, hidden] the residual stream, in place
  void* x;                       // [rows, hidden] the normed input of what comes next; the result
  void* qkv;                     // [rows, (heads + 2 kv_heads) head_dim]
  void* attn;                    // [rows, heads head_dim]
  void* out;                     // [rows, hidden] a sublayer's output
  void* gate_up;                 // [rows, 2 intermediate]
  float* q32;                    // bfloat16: [rows, heads head_dim] float32, the queries and then the
  float* attn32;                 // attention's output as the float32 kernel takes and gives them
  int64_t threads;
  double* seconds;               // null, or [matmul, attention] seconds this step adds to (benchmarks)
};

// Adds the time from its construction to its destruction to *total, where total is not null.
class Timer {
 public:
  explicit Timer(double* total) : total_(total) {
    if (total_) start_ = std::chrono::steady_clock::now();
  }
  ~Timer() {
    if (total_) *total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  double* total_;
  std::chrono::steady_clock::time_point start_;
};

// The per-dtype kernels, by overload: float32 or bfloat16 bits (uint16_t).
void rms_norm(const float* x, const void* w, float* y, int64_t m, int64_t n, float eps, int threads) {
  ladle_rms_norm(x, static_cast<const float*>(w), y, m, n, eps, threads);
}
void rms_norm(const uint16_t* x, const void* w, uint16_t* y, int64_t m, int64_t n, float eps, int threads) {
  ladle_rms_norm_bf16(x, static_cast<const uint16_t*>(w), y, m, n, eps, threads);
}
void add_rms_norm(float* h, const float* a, const void* w, float* y, int64_t m, int64_t n, float eps, int threads) {
  ladle_add_rms_norm(h, a, static_cast<const float*>(w), y, m, n, eps, threads);
}
void add_rms_norm(uint16_t* h, const uint16_t* a, const void* w, uint16_t* y, int64_t m, int64_t n, float eps,
                  int threads) {
  ladle_add_rms_norm_bf16(h, a, static_cast<const uint16_t*>(w), y, m, n, eps, threads);
}
void silu_and_mul(float* gate_up, int64_t ld, int64_t m, int64_t n, int threads) {
  ladle_silu_and_mul(gate_up, ld, m, n, threads);
}
void silu_and_mul(uint16_t* gate_up, int64_t ld, int64_t m, int64_t n, int threads) {
  ladle_silu_and_mul_bf16(gate_up, ld, m, n, threads);
}
int rotary(float* x, int64_t ldx, const void* cos, const void* sin, int64_t t, int64_t heads, int64_t d, int threads) {
  return ladle_rotary(x, ldx, static_cast<const float*>(cos), static_cast<const float*>(sin), t, heads, d, threads);
}
int rotary(uint16_t* x, int64_t ldx, const void* cos, const void* sin, int64_t t, int64_t heads, int64_t d,
           int threads) {
  return ladle_rotary_bf16(x, ldx, static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin), t, heads,
                           d, threads);
}

void linear(const LoopLinear& lin, const float* x, int64_t ldx, float* y, int64_t rows, int threads,
            double* seconds) {
  const Timer timer(seconds);
  switch (lin.kernel) {
    case kSmall:
      ladle_small_linear(x, static_cast<const float*>(lin.weights), lin.bias, y, rows, lin.k, lin.n, threads);
      return;
    case kDot:
      ladle_int8_dot_linear(x, ldx, static_cast<const uint8_t*>(lin.weights), lin.scales, lin.bias, y, rows, lin.k,
                            lin.n, threads);
      return;
    default:
      ladle_canonical_linear(x, ldx, lin.weights, int(lin.weight_type), lin.scales, lin.group_scales, lin.group_mins,
                             int(lin.half), lin.group_size, lin.bias, y, rows, lin.k, lin.n, threads);
  }
}

// bfloat16 rows take the canonical kernel only: widened exactly, the float32 sums rounded once.
void linear(const LoopLinear& lin, const uint16_t* x, int64_t ldx, uint16_t* y, int64_t rows, int threads,
            double* seconds) {
  const Timer timer(seconds);
  ladle_canonical_linear_bf16(x, ldx, lin.weights, int(lin.weight_type), lin.scales, lin.group_scales,
                              lin.group_mins, int(lin.half), lin.group_size, lin.bias, y, rows, lin.k, lin.n,
                              threads);
}

// float32 to bfloat16 as torch's .to(torch.bfloat16): to_bf16's rounding, a NaN as torch's quiet one.
uint16_t torch_bf16(float f) { return std::isnan(f) ? uint16_t{0x7FC0} : to_bf16(f); }

int write_kv(const LoopStep& s, const LoopLayer& layer, const void* k, const void* v, int64_t width, int64_t elem) {
  const int64_t num_slots = s.num_blocks * s.block_size, kv_size = s.kv_heads * s.head_dim;
  if (s.kv_type <= 1)
    return ladle_write_kv(k, width, v, width, layer.k_cache, layer.v_cache, num_slots, s.slots, s.rows, kv_size,
                          elem);
  return ladle_write_kv_quantized(static_cast<const float*>(k), width, static_cast<const float*>(v), width,
                                  layer.k_cache, layer.v_cache, layer.k_scales, layer.v_scales, num_slots, s.slots,
                                  s.rows, s.kv_heads, s.head_dim, s.kv_type == 3);
}

int prompt_attention(const LoopStep& s, const LoopLayer& layer, const float* q, int64_t q_stride, float* out,
                     int threads) {
  return ladle_prompt_attention(q, q_stride, layer.k_cache, layer.v_cache, int(s.kv_type), layer.k_scales,
                                layer.v_scales, s.num_blocks, s.block_tables, s.max_blocks, s.row_starts,
                                s.row_counts, s.first_positions, out, s.heads * s.head_dim, s.rows, s.heads,
                                s.kv_heads, s.head_dim, s.block_size, float(s.scale), layer.window, nullptr, threads);
}

// The new K/V written to the cache, and each row's attention into `attn` [rows, heads head_dim].
// Status: 0, or the failing kernel's (-1: a slot or block outside the cache; -2: shapes it cannot take).
int attend(const LoopStep& s, const LoopLayer& layer, float* qkv, float* attn, int threads) {
  const int64_t width = (s.heads + 2 * s.kv_heads) * s.head_dim, q_size = s.heads * s.head_dim;
  const int64_t kv_size = s.kv_heads * s.head_dim;
  if (write_kv(s, layer, qkv + q_size, qkv + q_size + kv_size, width, sizeof(float))) return -1;
  return prompt_attention(s, layer, qkv, width, attn, threads);
}

int attend(const LoopStep& s, const LoopLayer& layer, uint16_t* qkv, uint16_t* attn, int threads) {
  const int64_t width = (s.heads + 2 * s.kv_heads) * s.head_dim, q_size = s.heads * s.head_dim;
  const int64_t kv_size = s.kv_heads * s.head_dim;
  if (s.kv_type != 1) return -2;  // a bfloat16 step writes a bfloat16 cache only
  if (write_kv(s, layer, qkv + q_size, qkv + q_size + kv_size, width, sizeof(uint16_t))) return -1;
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t i = 0; i < q_size; ++i) s.q32[r * q_size + i] = to_float(qkv[r * width + i]);
  const int status = prompt_attention(s, layer, s.q32, q_size, s.attn32, threads);
  for (int64_t i = 0; i < s.rows * q_size; ++i) attn[i] = torch_bf16(s.attn32[i]);
  return status;
}

// One layer's attention, from its normed input s.x to its output projection in s.out.
template <typename T>
int attention(const LoopStep& s, const LoopLayer& layer, int threads) {
  const int64_t width = (s.heads + 2 * s.kv_heads) * s.head_dim;
  T* qkv = static_cast<T*>(s.qkv);
  linear(layer.qkv, static_cast<const T*>(s.x), s.hidden, qkv, s.rows, threads, s.seconds);
  if (rotary(qkv, width, s.cos, s.sin, s.rows, s.heads + s.kv_heads, s.head_dim, threads)) return -2;
  {
    const Timer timer(s.seconds ? s.seconds + 1 : nullptr);
    if (const int status = attend(s, layer, qkv, static_cast<T*>(s.attn), threads)) return status;
  }
  linear(layer.o, static_cast<const T*>(s.attn), s.heads * s.head_dim, static_cast<T*>(s.out), s.rows, threads,
         s.seconds);
  return 0;
}

template <typename T>
int decode_layers(const LoopStep& s) {
  const int threads = int(s.threads);
  const float eps = float(s.eps);
  T *h = static_cast<T*>(s.h), *x = static_cast<T*>(s.x), *out = static_cast<T*>(s.out);
  T* gate_up = static_cast<T*>(s.gate_up);
  rms_norm(h, s.layers ? s.layer[0].input_norm : s.final_norm, x, s.rows, s.hidden, eps, threads);
  for (int64_t i = 0; i < s.layers; ++i) {
    const LoopLayer& layer = s.layer[i];
    if (const int status = attention<T>(s, layer, threads)) return status;
    add_rms_norm(h, out, layer.post_attn_norm, x, s.rows, s.hidden, eps, threads);
    linear(layer.gate_up, x, s.hidden, gate_up, s.rows, threads, s.seconds);
    silu_and_mul(gate_up, 2 * s.intermediate, s.rows, s.intermediate, threads);
    linear(layer.down, gate_up, 2 * s.intermediate, out, s.rows, threads, s.seconds);
    const void* following = i + 1 < s.layers ? s.layer[i + 1].input_norm : s.final_norm;
    add_rms_norm(h, out, following, x, s.rows, s.hidden, eps, threads);
  }
  return 0;
}

}  // namespace

extern "C" int ladle_decode_layers(const LoopStep* step) {
  return step->bf16 ? decode_layers<uint16_t>(*step) : decode_layers<float>(*step);
}
