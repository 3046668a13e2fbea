"""The canonical kernel by rows per call, beside torch's GEMM on the same weights.

One pass over a 0.5B-shaped Qwen2's linear layers (hidden 896, intermediate 4864, 24 layers: q/k/v,
o, gate/up and down; random float32 weights, 1.4 GB, so they stream from memory as a decode step's
do) for each row count: ms per pass, GFLOP/s, the weights' GB/s, and torch's F.linear (MKL) on the
same shapes as the peer. Decode batches are the row counts; the steps show where a row tile more
costs a pass more (6 rows per tile on AVX2, 12 on AVX-512).

Usage: python benchmarks/canonical_rows.py [--rows 1,4,6,8,12,16,24,32] [--layers 24] [--repeats 5] [--quick]
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

SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896)}  # (in, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,6,8,12,16,24,32")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 and 8 rows, 2 layers, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.layers, args.repeats = "1,8", 2, 1
    native = native_kernels()
    if native is None:
        sys.exit("the native kernels did not build here: nothing to measure")
    print(f"machine: {machine()}; kernels {native.isa}; torch threads {torch.get_num_threads()}", flush=True)
    gen = torch.Generator().manual_seed(0)
    weights = {name: [torch.randn(out, k, generator=gen) * 0.02 for _ in range(args.layers)]
               for name, (k, out) in SHAPES.items()}
    panels = {name: [native.pack_panels(w) for w in ws] for name, ws in weights.items()}
    total = sum(w.numel() for ws in weights.values() for w in ws)
    print(f"{total * 4 / 1e6:.0f} MB of float32 weights per pass\n", flush=True)
    print("| rows | canonical ms | GFLOP/s | GB/s | torch ms | canonical / torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {name: torch.randn(rows, k, generator=gen) for name, (k, _) in SHAPES.items()}

        def canonical() -> None:
            for name, (_, out) in SHAPES.items():
                for p in panels[name]:
                    native.canonical_linear(xs[name], p, out)

        def library() -> None:
            for name, ws in weights.items():
                for w in ws:
                    F.linear(xs[name], w)

        ours, theirs = best_seconds(canonical, args.repeats), best_seconds(library, args.repeats)
        print(f"| {rows} | {ours * 1e3:.1f} | {2 * rows * total / ours / 1e9:.1f} | {total * 4 / ours / 1e9:.1f} "
              f"| {theirs * 1e3:.1f} | {ours / theirs:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
