"""The canonical kernel by rows per call, beside torch's GEMM on the same weights.

One pass over a 0.5B-shaped Qwen2's linear layers (hidden 896, intermediate 4864, 24 layers: q/k/v,
o, gate/up and down; random float32 weights, 1.4 GB, so they stream from memory as a decode step's
do) for each row count: ms per pass, GFLOP/s, the weights' GB/s, and torch's F.linear (MKL) on the
same shapes as the peer. Decode batches are the row counts; the steps show where a row tile more
costs a pass more (6 rows per tile on AVX2, 12 on AVX-512).

--weights int8: int8 values with a float32 scale per output row (--quantization int8); q8_0: int8
values in groups of 32 with an fp16 scale each (GGUF's Q8_0); 4-bit: 4-bit values in groups of 32 with
an fp16 scale and minimum each (GGUF's Q4_1, the embedded model's format).
torch's peer runs on the same weights dequantised to float32.

Usage: python benchmarks/canonical_rows.py [--rows 1,4,6,8,12,16,24,32] [--layers 24] [--repeats 5]
       [--weights float32|int8|q8_0|4-bit] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402
from ladle.model.kernels import native_kernels  # noqa: E402
from ladle.model.kernels.routing import best_seconds  # noqa: E402

BYTES_PER_WEIGHT = {"float32": 4.0, "int8": 1.0, "q8_0": 1 + 2 / 32, "4-bit": 0.5 + 4 / 32}  # fp16s a group of 32
SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896)}  # (in, out)


def make_layer(native, out: int, k: int, kind: str, gen: torch.Generator):
    """(float32 weights for torch, (packed panels, scales, groups) for the canonical kernel)."""
    if kind == "float32":
        weight = torch.randn(out, k, generator=gen) * 0.02
        return weight, (native.pack_panels(weight), None, None)
    if kind == "int8":
        q = torch.randint(-127, 128, (out, k), generator=gen, dtype=torch.int8)
        scales = torch.rand(out, generator=gen) * 2e-4
        return q.float() * scales[:, None], (native.pack_panels(q), scales, None)
    if kind == "q8_0":
        q = torch.randint(-127, 128, (out, k), generator=gen, dtype=torch.int8)
        scales = (torch.rand(out, k // 32, generator=gen) * 2e-4).half()
        weight = q.float() * scales.float().repeat_interleave(32, 1)
        return weight, (native.pack_panels(q), None, (32, native.pack_groups(scales.float(), torch.float16), None))
    q = torch.randint(0, 16, (out, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(out, k // 32, generator=gen) * 0.004).half()
    mins = (torch.randn(out, k // 32, generator=gen) * 0.02).half()
    weight = q.float() * scales.float().repeat_interleave(32, 1) + mins.float().repeat_interleave(32, 1)
    groups = (32, native.pack_groups(scales.float(), torch.float16), native.pack_groups(mins.float(), torch.float16))
    return weight, (native.pack_panels(q, four_bit=True), None, groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,6,8,12,16,24,32")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--weights", default="float32", choices=BYTES_PER_WEIGHT)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 and 8 rows, 2 layers, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.layers, args.repeats = "1,8", 2, 1
    native = native_kernels()
    if native is None:
        sys.exit("the native kernels did not build here: nothing to measure")
    print(f"machine: {machine()}; kernels {native.isa}; torch threads {torch.get_num_threads()}", flush=True)
    gen = torch.Generator().manual_seed(0)
    layers = {name: [make_layer(native, out, k, args.weights, gen) for _ in range(args.layers)]
              for name, (k, out) in SHAPES.items()}
    weights = {name: [weight for weight, _ in ls] for name, ls in layers.items()}
    total = sum(w.numel() for ws in weights.values() for w in ws)
    weight_bytes = total * BYTES_PER_WEIGHT[args.weights]
    print(f"{weight_bytes / 1e6:.0f} MB of {args.weights} weights per pass\n", flush=True)
    print("| rows | canonical ms | GFLOP/s | GB/s | torch ms | canonical / torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {name: torch.randn(rows, k, generator=gen) for name, (k, _) in SHAPES.items()}

        def canonical() -> None:
            for name, (_, out) in SHAPES.items():
                for _, (packed, scales, groups) in layers[name]:
                    native.canonical_linear(xs[name], packed, out, scales=scales, groups=groups)

        def library() -> None:
            for name, ws in weights.items():
                for w in ws:
                    F.linear(xs[name], w)

        ours, theirs = best_seconds(canonical, args.repeats), best_seconds(library, args.repeats)
        print(f"| {rows} | {ours * 1e3:.1f} | {2 * rows * total / ours / 1e9:.1f} | {weight_bytes / ours / 1e9:.1f} "
              f"| {theirs * 1e3:.1f} | {ours / theirs:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
