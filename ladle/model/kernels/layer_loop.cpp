// A decode step's decoder layers in one call: the same kernels, with the same operands, that the
// Python forward calls one by one (ladle.model.decode_loop), so every output has the same bits.
// What it saves is the host's work between them: a step of a small model calls about ten kernels a
// layer, and at one row each call's Python and ctypes cost as much as its arithmetic.
//
// Per layer, for rows x of the residual stream h [rows, hidden] (updated in place):
//   x = rms_norm(h)                                 (the first layer's; later ones come from below)
//   qkv = x W_qkv^T + b;  rotary on q and k in place;  k, v written to the cache at their slots
//   attn = attention of each row's q over its sequence's cache (the prompt kernel, one row a span)
//   h += attn W_o^T;  x = rms_norm(h)
//   gate_up = x W_gu^T;  silu(gate) * up in place;  h += act W_down^T;  x = rms_norm(h) (the next norm)

#include <chrono>
#include <cstdint>

extern "C" {
void ladle_rms_norm(const float* x, const float* w, float* y, int64_t m, int64_t n, float eps, int threads);
void ladle_add_rms_norm(float* h, const float* a, const float* w, float* y, int64_t m, int64_t n, float eps,
                        int threads);
void ladle_silu_and_mul(float* gate_up, int64_t ld, int64_t m, int64_t n, int threads);
int ladle_rotary(float* x, int64_t ldx, const float* cos, const float* sin, int64_t t, int64_t heads, int64_t d,
                 int threads);
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
  const float* input_norm;
  const float* post_attn_norm;
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
  const float* final_norm;
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  double eps, scale;
  int64_t kv_type;               // prompt_attention's: 0 float32, 2 int8, 3 fp8 e4m3
  int64_t num_blocks, block_size;
  // this step's
  int64_t rows;
  const float* cos;              // [rows, head_dim] rotary tables
  const float* sin;
  const int64_t* slots;          // [rows] each new token's cache slot
  const int64_t* block_tables;   // [rows, max_blocks]
  int64_t max_blocks;
  const int64_t* row_starts;     // the decodes as one-row spans
  const int64_t* row_counts;
  const int64_t* first_positions;
  float* h;                      // [rows, hidden] the residual stream, in place
  float* x;                      // [rows, hidden] the normed input of what comes next; the result
  float* qkv;                    // [rows, (heads + 2 kv_heads) head_dim]
  float* attn;                   // [rows, heads head_dim]
  float* out;                    // [rows, hidden] a sublayer's output
  float* gate_up;                // [rows, 2 intermediate]
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

// Status: 0, or the failing kernel's (-1: a slot or block outside the cache; -2: shapes it cannot take).
int attention(const LoopStep& s, const LoopLayer& layer, int threads) {
  const int64_t width = (s.heads + 2 * s.kv_heads) * s.head_dim, q_size = s.heads * s.head_dim;
  const int64_t kv_size = s.kv_heads * s.head_dim;
  linear(layer.qkv, s.x, s.hidden, s.qkv, s.rows, threads, s.seconds);
  int status = ladle_rotary(s.qkv, width, s.cos, s.sin, s.rows, s.heads + s.kv_heads, s.head_dim, threads);
  if (status) return -2;
  const float* k = s.qkv + q_size;
  const float* v = s.qkv + q_size + kv_size;
  const int64_t num_slots = s.num_blocks * s.block_size;
  const Timer timer(s.seconds ? s.seconds + 1 : nullptr);
  if (s.kv_type == 0)
    status = ladle_write_kv(k, width, v, width, layer.k_cache, layer.v_cache, num_slots, s.slots, s.rows, kv_size, 4);
  else
    status = ladle_write_kv_quantized(k, width, v, width, layer.k_cache, layer.v_cache, layer.k_scales,
                                      layer.v_scales, num_slots, s.slots, s.rows, s.kv_heads, s.head_dim,
                                      s.kv_type == 3);
  if (status) return -1;
  return ladle_prompt_attention(s.qkv, width, layer.k_cache, layer.v_cache, int(s.kv_type), layer.k_scales,
                                layer.v_scales, s.num_blocks, s.block_tables, s.max_blocks, s.row_starts,
                                s.row_counts, s.first_positions, s.attn, q_size, s.rows, s.heads, s.kv_heads,
                                s.head_dim, s.block_size, float(s.scale), layer.window, nullptr, threads);
}

}  // namespace

extern "C" int ladle_decode_layers(const LoopStep* step) {
  const LoopStep& s = *step;
  const int threads = int(s.threads);
  const float eps = float(s.eps);
  if (s.layers == 0) {
    ladle_rms_norm(s.h, s.final_norm, s.x, s.rows, s.hidden, eps, threads);
    return 0;
  }
  ladle_rms_norm(s.h, s.layer[0].input_norm, s.x, s.rows, s.hidden, eps, threads);
  for (int64_t i = 0; i < s.layers; ++i) {
    const LoopLayer& layer = s.layer[i];
    if (const int status = attention(s, layer, threads)) return status;
    linear(layer.o, s.attn, s.heads * s.head_dim, s.out, s.rows, threads, s.seconds);
    ladle_add_rms_norm(s.h, s.out, layer.post_attn_norm, s.x, s.rows, s.hidden, eps, threads);
    linear(layer.gate_up, s.x, s.hidden, s.gate_up, s.rows, threads, s.seconds);
    ladle_silu_and_mul(s.gate_up, 2 * s.intermediate, s.rows, s.intermediate, threads);
    linear(layer.down, s.gate_up, 2 * s.intermediate, s.out, s.rows, threads, s.seconds);
    const float* following = i + 1 < s.layers ? s.layer[i + 1].input_norm : s.final_norm;
    ladle_add_rms_norm(s.h, s.out, following, s.x, s.rows, s.hidden, eps, threads);
  }
  return 0;
}
