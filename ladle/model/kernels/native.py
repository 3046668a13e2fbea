"""Typed entry points into the native kernels' library (ctypes), one method per kernel: operands
are checked or shaped here, the C++ trusts them. ladle.model.kernels.loader builds and loads it."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

DOT_BLOCK = 32  # inputs per activation scale in int8_dot.cpp
# canonical_linear.cpp's WeightType by panel dtype: uint8 panels hold 4-bit weights, two to a byte
AMX_MAX_ROWS = 32  # rows per call of the AMX kernel: two tiles of 16
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}  # attention.cpp's kv_type


def exactly_fp16(t: torch.Tensor) -> bool:
    """Whether every value of `t` is an fp16 value (so fp16 holds it exactly)."""
    return torch.equal(t.half().float(), t.float())


def _sink_ptr(sinks: torch.Tensor | None, heads: int) -> int | None:
    """The kernels' pointer to one float32 sink logit per head, or None."""
    if sinks is None:
        return None
    if sinks.dtype != torch.float32 or sinks.shape != (heads,) or not sinks.is_contiguous() or not sinks.is_cpu:
        raise ValueError(f"sinks must be a contiguous float32 CPU tensor of {heads} logits, not {tuple(sinks.shape)} "
                         f"{sinks.dtype}")
    return sinks.data_ptr()


def _check_dot_panels(packed: torch.Tensor, k: int) -> None:
    if packed.shape[1] * 4 != k:
        raise ValueError(f"int8 dot panels of {packed.shape[1] * 4} inputs do not take rows of {k}")


def _in_tile_calls(kernel: str, isa: str, rows: int, call: Callable[[int, int], int]) -> None:
    """call(first, part) for `rows` rows in parts of AMX_MAX_ROWS; an AMX kernel's failure status raised
    with its reason."""
    for first in range(0, rows, AMX_MAX_ROWS):
        status = call(first, min(AMX_MAX_ROWS, rows - first))
        if status:
            why = {-2: f"the kernels were not built for {isa}", -3: "Linux did not grant the AMX tile state"}
            raise RuntimeError(f"{kernel}: {why.get(status, status)}")


class NativeKernels:
    """Typed entry points into the library. Operands are float32 CPU tensors laid out as each
    method says: the caller checks, the kernels trust them (KV cache indices excepted)."""

    def __init__(self, lib: ctypes.CDLL):
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._linear = lib.ladle_small_linear
        self._linear.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        self._linear.restype = None
        self._rms_norm = lib.ladle_rms_norm
        self._rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
        self._rms_norm.restype = None
        self._rms_norm_bf16 = lib.ladle_rms_norm_bf16
        self._rms_norm_bf16.argtypes = self._rms_norm.argtypes
        self._rms_norm_bf16.restype = None
        self._decode_attention = lib.ladle_decode_attention
        self._decode_attention.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, ptr, ptr] + [i64] * 5 + [
            ctypes.c_float, i64, ptr, ctypes.c_int]
        self._decode_attention.restype = ctypes.c_int
        self._prompt_attention = lib.ladle_prompt_attention
        self._prompt_attention.argtypes = [ptr, i64, ptr, ptr, ctypes.c_int, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr,
                                           ptr] + [i64] * 6 + [ctypes.c_float, i64, ptr, ctypes.c_int]
        self._prompt_attention.restype = ctypes.c_int
        self._write_kv = lib.ladle_write_kv
        self._write_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64]
        self._write_kv.restype = ctypes.c_int
        self._write_kv_quantized = lib.ladle_write_kv_quantized
        self._write_kv_quantized.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64,
                                             ctypes.c_int]
        self._write_kv_quantized.restype = ctypes.c_int
        self._pack_panels = lib.ladle_pack_panels
        self._pack_panels.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
        self._pack_panels.restype = None
        self._canonical_linear = lib.ladle_canonical_linear
        self._canonical_linear.argtypes = [ptr, i64, ptr, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int, i64, ptr, ptr,
                                           i64, i64, i64, ctypes.c_int]
        self._canonical_linear.restype = None
        self._canonical_linear_bf16 = lib.ladle_canonical_linear_bf16
        self._canonical_linear_bf16.argtypes = self._canonical_linear.argtypes
        self._canonical_linear_bf16.restype = None
        self._widen_panels = lib.ladle_widen_panels
        self._widen_panels.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int, i64, i64, i64, i64, ptr, i64,
                                       ctypes.c_int]
        self._widen_panels.restype = None
        self._add_rms_norm = lib.ladle_add_rms_norm
        self._add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
        self._add_rms_norm.restype = None
        self._silu_and_mul = lib.ladle_silu_and_mul
        self._silu_and_mul.argtypes = [ptr, i64, i64, i64, ctypes.c_int]
        self._silu_and_mul.restype = None
        self._rotary = lib.ladle_rotary
        self._rotary.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_int]
        self._rotary.restype = ctypes.c_int
        for name in ("add_rms_norm", "silu_and_mul", "rotary"):  # the same signatures over bfloat16 bits
            fn, bf16 = getattr(self, f"_{name}"), getattr(lib, f"ladle_{name}_bf16")
            bf16.argtypes, bf16.restype = fn.argtypes, fn.restype
            setattr(self, f"_{name}_bf16", bf16)
        self._int8_dot_linear = lib.ladle_int8_dot_linear
        self._int8_dot_linear.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        self._int8_dot_linear.restype = None
        self._widen_dot_panels = lib.ladle_widen_dot_panels
        self._widen_dot_panels.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, ctypes.c_int]
        self._widen_dot_panels.restype = None
        self._lora_add = lib.ladle_lora_add
        self._lora_add.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr] + [i64] * 6 + [ctypes.c_int]
        self._lora_add.restype = ctypes.c_int
        self._keep_nucleus = lib.ladle_keep_nucleus
        self._keep_nucleus.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
        self._keep_nucleus.restype = None
        self._argmax = lib.ladle_argmax
        self._argmax.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
        self._argmax.restype = None
        self._decode_layers = lib.ladle_decode_layers
        self._decode_layers.argtypes = [ptr]
        self._decode_layers.restype = ctypes.c_int
        lib.ladle_isa.restype = ctypes.c_char_p
        self.isa: str = lib.ladle_isa().decode()
        self._amx_linear = lib.ladle_amx_linear
        self._amx_linear.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        self._amx_linear.restype = ctypes.c_int
        # the AMX build, and Linux granted the tile state: decode-sized bf16 matmuls may go to the tiles
        self.amx: bool = self.isa == "amx" and lib.ladle_amx_ready() == 1
        self._int8_amx_linear = lib.ladle_int8_amx_linear
        self._int8_amx_linear.argtypes = self._int8_dot_linear.argtypes
        self._int8_amx_linear.restype = ctypes.c_int
        # and AMX-INT8: decode-sized int8 dot products may go to the tiles (the same bits)
        self.amx_int8: bool = self.amx and lib.ladle_int8_amx_ready() == 1

    def pack_panels(self, weight: torch.Tensor, four_bit: bool = False) -> torch.Tensor:
        """weight [out, in] in the canonical kernel's layout: 16-column panels, [ceil(out / 16),
        in, 16], zero-padded; bf16 and int8 stay as they are (widened on the fly), anything
        else becomes float32 (exactly, for fp16). `four_bit`: int8 values 0..15 (in even) packed
        two to a byte, uint8 [ceil(out / 16), in / 2, 16]."""
        if four_bit:
            if weight.dtype != torch.int8 or weight.shape[1] % 2 or weight.min() < 0 or weight.max() > 15:
                raise ValueError("4-bit panels take int8 values 0..15 over an even number of inputs")
        elif weight.dtype not in WEIGHT_TYPES or weight.dtype == torch.uint8:
            weight = weight.float()
        weight = weight.contiguous()
        n, k = weight.shape
        dtype = torch.uint8 if four_bit else weight.dtype
        out = torch.empty(-(-n // 16), k // 2 if four_bit else k, 16, dtype=dtype)
        self._pack_panels(weight.data_ptr(), out.data_ptr(), n, k, WEIGHT_TYPES[dtype])
        return out

    @staticmethod
    def pack_groups(params: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-group scales or minimums [out, groups] in the panels' layout: [ceil(out / 16), groups, 16]
        in `dtype`, float32 or float16 (for values that are exactly fp16s: the kernel widens them
        exactly), zero-padded."""
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"group scales and minimums are float32 or float16, not {dtype}")
        if dtype == torch.float16 and not exactly_fp16(params):
            raise ValueError("these group parameters are not all exactly float16 values")
        n, groups = params.shape
        padded = torch.zeros(-(-n // 16) * 16, groups, dtype=dtype)
        padded[:n] = params
        return padded.view(-1, 16, groups).transpose(1, 2).contiguous()

    def canonical_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                         bias: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                         groups: tuple[int, torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """x[M, in] (float32, rows may be strided) @ W^T (+ bias) for W packed by `pack_panels`,
        each output a fixed chain of FMAs in input order: a row's bits never depend on M. A bfloat16
        x gives a bfloat16 y: x widened and the float32 sums rounded once, in the kernel.
        int8 panels need `scales` (float32, one per output): the sums are multiplied by them; or,
        grouped, `groups` = (group size, scales, minimums or None), each packed by `pack_groups`:
        each group's chain is folded in as fma(chain, scale, acc), then fma(x's group sum, min, acc)."""
        if (packed.dtype in (torch.int8, torch.uint8)) != (scales is not None or groups is not None) or (
                scales is not None and groups is not None):
            raise ValueError("int8 and 4-bit panels take scales or groups, and only they do")
        rows, k = x.shape
        size, group_scales, group_mins = groups or (0, None, None)
        if groups is not None and (size <= 0 or k % size or group_scales.shape[1] != k // size):
            raise ValueError(f"groups of {size} do not tile the {k} inputs")
        half = group_scales is not None and group_scales.dtype == torch.float16
        if group_mins is not None and group_mins.dtype != group_scales.dtype:
            raise ValueError("group scales and minimums must share a dtype")
        if packed.dtype == torch.uint8 and (groups is None or size % 2 or packed.shape[1] * 2 != k):
            raise ValueError(f"4-bit panels ({packed.shape[1] * 2} inputs) take groups of an even size and rows of "
                             f"as many inputs, not groups of {size} and {k}")
        y = torch.empty(rows, out_features, dtype=torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
        entry = self._canonical_linear_bf16 if x.dtype == torch.bfloat16 else self._canonical_linear
        entry(x.data_ptr(), x.stride(0), packed.data_ptr(), WEIGHT_TYPES[packed.dtype],
              None if scales is None else scales.data_ptr(),
              None if group_scales is None else group_scales.data_ptr(),
              None if group_mins is None else group_mins.data_ptr(), int(half), size,
              None if bias is None else bias.data_ptr(), y.data_ptr(), rows, k, out_features,
              torch.get_num_threads())
        return y

    def widen_panels(self, packed: torch.Tensor, k: int, out: torch.Tensor, first_panel: int = 0,
                     scales: torch.Tensor | None = None,
                     groups: tuple[int, torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """int8 or 4-bit panels (with `scales` or `groups` as `canonical_linear` takes them) widened
        to the float32 weights they hold, transposed: out[i, c] = W[16 * first_panel + c, i] for
        out's columns (a multiple of 16, row stride out.stride(0)), so that x @ out is x @ W^T."""
        panels = out.shape[1] // 16
        if (packed.dtype not in (torch.int8, torch.uint8) or out.dtype != torch.float32 or out.shape[0] != k
                or out.shape[1] % 16 or out.stride(1) != 1 or first_panel + panels > packed.shape[0]):
            raise ValueError("widen_panels takes int8 or 4-bit panels into float32 [k, 16 * panels]")
        size, group_scales, group_mins = groups or (0, None, None)
        if (scales is None) == (groups is None):
            raise ValueError("int8 and 4-bit panels take scales or groups")
        self._widen_panels(packed.data_ptr(), WEIGHT_TYPES[packed.dtype],
                           None if scales is None else scales.data_ptr(),
                           None if group_scales is None else group_scales.data_ptr(),
                           None if group_mins is None else group_mins.data_ptr(),
                           int(group_scales is not None and group_scales.dtype == torch.float16), size, k,
                           first_panel, first_panel + panels, out.data_ptr(), out.stride(0), torch.get_num_threads())
        return out

    @staticmethod
    def pack_dot(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row int8 weights q [out, in] (-127..127, `in` a multiple of 32) and their scales [out] in
        int8_dot.cpp's layout: uint8 q + 128 in 16-column panels of four inputs side by side,
        [ceil(out / 16), in / 4, 16, 4], and the scales zero-padded to as many columns."""
        n, k = q.shape
        if q.dtype != torch.int8 or k % DOT_BLOCK or q.min() < -127:
            raise ValueError(f"int8 dot panels take int8 values -127..127 over a multiple of {DOT_BLOCK} inputs")
        panels = -(-n // 16)
        u = torch.full((panels * 16, k), 128, dtype=torch.uint8)
        u[:n] = (q.to(torch.int16) + 128).to(torch.uint8)
        padded = torch.zeros(panels * 16, dtype=torch.float32)
        padded[:n] = scales
        return u.view(panels, 16, k // 4, 4).transpose(1, 2).contiguous(), padded

    def int8_dot_linear(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """x[M, in] (float32, rows may be strided) @ W^T (+ bias) for W packed by `pack_dot`, on integer
        dot products with each row of x quantised to 8 bits per block of 32 inputs (int8_dot.cpp):
        a row's bits never depend on M or the instruction set."""
        rows, k = x.shape
        _check_dot_panels(packed, k)  # (a decode step's every linear comes here: one check only)
        y = torch.empty(rows, out_features)
        self._int8_dot_linear(x.data_ptr(), x.stride(0), packed.data_ptr(), scales.data_ptr(),
                              None if bias is None else bias.data_ptr(), y.data_ptr(), rows, k, out_features,
                              torch.get_num_threads())
        return y

    def widen_dot_panels(self, packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                         first_panel: int = 0) -> torch.Tensor:
        """`pack_dot`'s panels widened to their float32 weights, transposed, as `widen_panels` does."""
        panels, k = out.shape[1] // 16, packed.shape[1] * 4
        if (out.dtype != torch.float32 or out.shape[0] != k or out.shape[1] % 16 or out.stride(1) != 1
                or first_panel + panels > packed.shape[0]):
            raise ValueError("widen_dot_panels takes int8 dot panels into float32 [k, 16 * panels]")
        self._widen_dot_panels(packed.data_ptr(), scales.data_ptr(), k, first_panel, first_panel + panels,
                               out.data_ptr(), out.stride(0), torch.get_num_threads())
        return out

    def lora_add(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                 ranks: torch.Tensor, cols: torch.Tensor) -> None:
        """Batched multi-LoRA, in place (lora.cpp): for each row t with slots[t] = s >= 0 and each part p,
        y[t, cols[p]:cols[p + 1]] += (a[s, p*R : p*R + n] @ x[t]) @ bt[s, p*R : p*R + n, cols[p]:cols[p + 1]]
        with n = ranks[s, p]; rows of slot -1 are left as they are. x [T, in] float32 (rows may be
        strided), y [T, out] float32 contiguous, slots int32 [T] in -1..S-1, a [S, P*R, in] and bt
        [S, P*R, out] (B transposed, scaling folded in) float32 contiguous, ranks int32 [S, P] in 0..R,
        cols int64 [P + 1] nondecreasing within 0..out. A row's bits never depend on the other rows,
        its place in the batch or the thread count. Bad operands raise ValueError, y untouched."""
        # Every LoRA projection of every decode step comes here: checks that cost no tensor ops.
        # The values (slots against S, ranks against R, cols against out) are checked by the
        # kernel before it writes anything.
        f32 = torch.float32
        if not (x.dtype == f32 and y.dtype == f32 and a.dtype == f32 and bt.dtype == f32
                and slots.dtype == torch.int32 and ranks.dtype == torch.int32 and cols.dtype == torch.int64):
            raise ValueError(f"lora_add takes float32 x, y, a, bt, int32 slots, ranks and int64 cols, not "
                             f"{x.dtype}, {y.dtype}, {a.dtype}, {bt.dtype}, {slots.dtype}, {ranks.dtype}, {cols.dtype}")
        if not (x.is_cpu and y.is_cpu and slots.is_cpu and a.is_cpu and bt.is_cpu and ranks.is_cpu and cols.is_cpu):
            raise ValueError("lora_add takes CPU tensors")
        if not (x.ndim == 2 and y.ndim == 2 and slots.ndim == 1 and a.ndim == 3 and bt.ndim == 3 and ranks.ndim == 2
                and cols.ndim == 1):
            raise ValueError("lora_add takes x [T, in], y [T, out], slots [T], a [S, P*R, in], bt [S, P*R, out], "
                             "ranks [S, P] and cols [P + 1]")
        rows, k = x.shape
        out = y.shape[1]
        num_slots, parts = ranks.shape
        if (y.shape[0] != rows or slots.shape[0] != rows or a.shape[0] != num_slots or a.shape[2] != k
                or bt.shape[:2] != a.shape[:2] or bt.shape[2] != out or cols.shape[0] != parts + 1
                or parts == 0 or a.shape[1] % parts):
            raise ValueError(f"lora_add: shapes do not agree: x {tuple(x.shape)}, y {tuple(y.shape)}, slots "
                             f"{tuple(slots.shape)}, a {tuple(a.shape)}, bt {tuple(bt.shape)}, ranks "
                             f"{tuple(ranks.shape)}, cols {tuple(cols.shape)}")
        if not ((x.stride(1) == 1 or k <= 1) and (x.stride(0) >= k or rows <= 1) and y.is_contiguous()
                and slots.is_contiguous() and a.is_contiguous() and bt.is_contiguous() and ranks.is_contiguous()
                and cols.is_contiguous()):
            raise ValueError("lora_add: x's rows must be contiguous, and y, slots, a, bt, ranks and cols contiguous")
        rank = a.shape[1] // parts
        status = self._lora_add(x.data_ptr(), x.stride(0), y.data_ptr(), slots.data_ptr(), a.data_ptr(),
                                bt.data_ptr(), ranks.data_ptr(), cols.data_ptr(), rows, k, out, num_slots, parts, rank,
                                torch.get_num_threads())
        if status == -1:
            raise ValueError(f"lora_add: slots must lie in -1..{num_slots - 1}, not {slots.min().item()}.."
                             f"{slots.max().item()}")
        if status == -2:
            raise ValueError(f"lora_add: ranks must lie in 0..{rank}, not {ranks.min().item()}..{ranks.max().item()}")
        if status:
            raise ValueError(f"lora_add: cols must rise (or stay) within 0..{out}, not {cols.tolist()}")

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x[M, in] @ weight[out, in]^T (+ bias), each weight row read once for all M rows."""
        rows, k = x.shape
        n = weight.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32)
        self._linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                     rows, k, n, torch.get_num_threads())
        return y

    def int8_amx_linear(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """int8_dot_linear's product, the same bits, on AMX tiles (int8_dot.cpp); rows in calls of
        AMX_MAX_ROWS."""
        rows, k = x.shape
        _check_dot_panels(packed, k)
        y = torch.empty(rows, out_features)
        _in_tile_calls("int8_amx_linear", "AMX-INT8", rows, lambda first, part: self._int8_amx_linear(
            x[first].data_ptr(), x.stride(0), packed.data_ptr(), scales.data_ptr(),
            None if bias is None else bias.data_ptr(), y[first].data_ptr(), part, k, out_features,
            torch.get_num_threads()))
        return y

    def amx_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x[M, in] @ weight[out, in]^T (+ bias) on AMX tiles, bfloat16 operands and result, contiguous
        (amx_linear.cpp); rows in calls of AMX_MAX_ROWS."""
        rows, k = x.shape
        n = weight.shape[0]
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        _in_tile_calls("amx_linear", "AMX", rows, lambda first, part: self._amx_linear(
            x[first].data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y[first].data_ptr(),
            part, k, n, torch.get_num_threads()))
        return y

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of a 2-D x; x and weight both float32 or both bfloat16."""
        y = torch.empty_like(x)
        fn = self._rms_norm_bf16 if x.dtype == torch.bfloat16 else self._rms_norm
        fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return y

    def add_rms_norm(self, h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """h += a in place, then RMSNorm(h) (returned): [M, N] operands, contiguous, all float32 or all
        bfloat16."""
        y = torch.empty_like(h)
        fn = self._add_rms_norm_bf16 if h.dtype == torch.bfloat16 else self._add_rms_norm
        fn(h.data_ptr(), a.data_ptr(), weight.data_ptr(), y.data_ptr(), h.shape[0], h.shape[1], eps,
           torch.get_num_threads())
        return y

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for float32 or bfloat16 gate_up [M, 2 * N] (rows may be strided), in place
        into the gate half, which is returned (activation.cpp)."""
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        fn = self._silu_and_mul_bf16 if gate_up.dtype == torch.bfloat16 else self._silu_and_mul
        fn(gate_up.data_ptr(), gate_up.stride(0), rows, n, torch.get_num_threads())
        return gate_up[:, :n]

    def decode_layers(self, step: ctypes.Structure) -> None:
        """A decode step's decoder layers (layer_loop.cpp), as ladle.model.decode_loop lays them out."""
        status = self._decode_layers(ctypes.byref(step))
        if status == -1:
            raise IndexError("decode_layers: a slot, block table or position points outside the KV cache")
        if status:
            raise ValueError("decode_layers: a head size, block size or cache dtype its kernels do not take")

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, -1) for float32 rows x [B, V] (rows may be strided; the first of equal values,
        a NaN first), in one vectorised pass a row (sampling.cpp)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or not x.is_cpu:
            raise ValueError(f"argmax takes float32 CPU rows with contiguous values, not {tuple(x.shape)} {x.dtype}")
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], tokens.data_ptr(), torch.get_num_threads())
        return tokens

    def keep_nucleus(self, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Each row of probs [B, V] (contiguous float32, non-negative) with its probabilities outside the
        nucleus of top_p [B] (1 or more, inf: off) set to 0, in place; returns probs (sampling.cpp)."""
        if probs.dtype != torch.float32 or probs.dim() != 2 or not probs.is_contiguous() or not probs.is_cpu:
            raise ValueError(f"probs must be a contiguous float32 CPU matrix, not {tuple(probs.shape)} {probs.dtype}")
        top_p = top_p.to(torch.float32).contiguous()
        if top_p.shape != probs.shape[:1]:
            raise ValueError(f"one top_p per row: {tuple(top_p.shape)} for {probs.shape[0]} rows")
        self._keep_nucleus(probs.data_ptr(), top_p.data_ptr(), probs.shape[0], probs.shape[1],
                           torch.get_num_threads())
        return probs

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (float32 or bfloat16, heads contiguous, rows may be strided) rotated in place
        by the [T, D] tables of RotaryEmbedding.tables in x's dtype; returns x."""
        t, heads, d = x.shape
        fn = self._rotary_bf16 if x.dtype == torch.bfloat16 else self._rotary
        if fn(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, heads, d, torch.get_num_threads()):
            raise ValueError(f"rotary: head size {d} must be even and at most 1024")
        return x

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One query token per sequence: q [B, H, D] (rows may be strided), one layer's caches
        [blocks, block_size, KVH, D], int64 block_tables [B, max_blocks] and context_lens [B];
        window: a sliding-window layer's, each query attending to its last `window` keys; sinks:
        float32 [H], a logit per head in its softmax's denominator (gpt-oss). Returns [B, H * D]."""
        batch, heads, d = q.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        out = torch.empty(batch, heads * d, dtype=torch.float32)
        if self._decode_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
                                  block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
                                  out.data_ptr(), batch, heads, kv_heads, d, block_size, scale, window or 0,
                                  _sink_ptr(sinks, heads), torch.get_num_threads()):
            raise IndexError("decode_attention: a block table or context length points outside the KV cache")
        return out

    def prompt_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, row_starts: torch.Tensor, row_counts: torch.Tensor,
                         first_positions: torch.Tensor, scale: float, out: torch.Tensor,
                         k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                         window: int | None = None, sinks: torch.Tensor | None = None) -> None:
        """Causal attention for prompt rows, each row on its own (row-invariant): sequence s owns
        rows [row_starts[s], + row_counts[s]) of q [T, H, D] (float32, rows may be strided) and of
        out [T, H * D] (float32, written), at positions first_positions[s] onwards, over the blocks
        of block_tables[s] (int64 [S, max_blocks]); caches in float32, bfloat16, or int8 / fp8 e4m3
        with their float32 scales [blocks, block_size, KVH]. D and the block size must be
        multiples of 8. window: a sliding-window layer's, each row attending to its last `window`
        keys (blocks below a sequence's first window are not read); sinks: float32 [H], a logit per
        head in its softmax's denominator (gpt-oss)."""
        num_blocks, block_size, kv_heads, d = k_cache.shape
        kv_type = KV_TYPES[k_cache.dtype]
        if (kv_type >= 2) != (k_scales is not None and v_scales is not None):
            raise ValueError("scales go with 8-bit caches, and only with them")
        status = self._prompt_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), kv_type,
            None if k_scales is None else k_scales.data_ptr(), None if v_scales is None else v_scales.data_ptr(),
            num_blocks, block_tables.data_ptr(),
            block_tables.shape[1], row_starts.data_ptr(), row_counts.data_ptr(), first_positions.data_ptr(),
            out.data_ptr(), out.stride(0), block_tables.shape[0], q.shape[1], kv_heads, d, block_size, scale,
            window or 0, _sink_ptr(sinks, q.shape[1]), torch.get_num_threads())
        if status == -1:
            raise IndexError("prompt_attention: a block table or position points outside the KV cache")
        if status:
            raise ValueError("prompt_attention: the head size and block size must be multiples of 8")

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """k_cache.view(-1, KVH, D)[slots] = k, and the same for v, all of one dtype; rows of k, v
        may be strided."""
        width = k.shape[1] * k.shape[2]
        if self._write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                          v_cache.data_ptr(), k_cache.numel() // width, slots.data_ptr(), k.shape[0], width,
                          k.element_size()):
            raise IndexError("write_kv: a slot is outside the KV cache")

    def write_kv_quantized(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k_scales: torch.Tensor, v_scales: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, KVH, D] (float32, rows may be strided) into an int8 or fp8 e4m3 cache at
        `slots`, each token's head scaled by its own max |x| (its scale into k_scales / v_scales
        [blocks, block_size, KVH])."""
        _, _, kv_heads, d = k_cache.shape
        if self._write_kv_quantized(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                                    v_cache.data_ptr(), k_scales.data_ptr(), v_scales.data_ptr(),
                                    k_scales.numel() // kv_heads, slots.data_ptr(), k.shape[0], kv_heads, d,
                                    int(k_cache.dtype == torch.float8_e4m3fn)):
            raise IndexError("write_kv: a slot is outside the KV cache")
