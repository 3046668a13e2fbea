"""Each weight format's batch-1 matmul against float32's, side by side: int8 per row on the integer
dot-product kernel (8-bit activations) and on the canonical kernel's float FMA chains
(LADLE_INT8_DOT=0), and how the canonical kernel reads each GGUF block layout. 24 layers of one shape (enough weights that they stream from memory, as a
decode step's do), timed in interleaved rounds, the best round kept; per format the bytes it
holds per weight, the ms per pass, the weight bytes read per second and the speed-up over
float32. Random values in each format's range, its scales held as ladle holds them (fp16 where
the file's one factor per block is, float32 where a k-quant's products are).

Usage: python benchmarks/block_formats.py [--out 4864] [--in 1024] [--layers 24] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from ladle.model.layers import Linear  # noqa: E402
from ladle.model.quantization import GroupedWeight, Int8Linear  # noqa: E402

# group size, value range, fp16 parameters, minimums: as gguf_blocks repacks each type
FORMATS = {
    "Q8_0": (32, (-127, 127), True, False),
    "Q5_0": (32, (-16, 15), True, False),
    "Q4_0": (32, (0, 15), True, True),
    "Q4_K": (32, (0, 15), False, True),
    "Q6_K": (16, (-32, 31), False, False),
}


def grouped(n: int, k: int, size: int, values: tuple[int, int], fp16: bool, mins: bool) -> GroupedWeight:
    q = torch.randint(values[0], values[1] + 1, (n, k), dtype=torch.int8)
    scales = torch.rand(n, k // size) * 1e-2 + 1e-3
    minimums = -torch.rand(n, k // size) * 1e-2 if mins else None
    if fp16:
        scales = scales.half().float()
        minimums = None if minimums is None else minimums.half().float()
    return GroupedWeight(q, scales, minimums)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=int, default=4864)
    ap.add_argument("--in", dest="inputs", type=int, default=1024, help="a multiple of 256 (the k-quants' blocks)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 layers of [256, 256], one round")
    args = ap.parse_args()
    if args.quick:
        args.out, args.inputs, args.layers, args.rounds = 256, 256, 2, 1
    n, k = args.out, args.inputs
    torch.manual_seed(0)
    print(f"{machine()}; {args.layers} layers of [{n}, {k}], batch 1\n", flush=True)
    layers = {"float32": [Linear(torch.randn(n, k) * 0.02) for _ in range(args.layers)]}
    floats = [lin.weight for lin in layers["float32"]]
    print("  quantising int8 per row ...", flush=True)
    layers["int8 per row (dot)"] = [Int8Linear(w) for w in floats]
    os.environ["LADLE_INT8_DOT"] = "0"  # the same weights on the canonical kernel's FMA chains
    layers["int8 per row (FMA)"] = [Int8Linear(w) for w in floats]
    del os.environ["LADLE_INT8_DOT"]
    for name, spec in FORMATS.items():
        print(f"  packing {name} ...", flush=True)
        layers[name] = [Int8Linear(grouped(n, k, *spec)) for _ in range(args.layers)]
    x = torch.randn(1, k)
    best = {name: float("inf") for name in layers}
    for r in range(args.rounds):
        print(f"  round {r + 1}/{args.rounds} ...", flush=True)
        for name, lins in layers.items():
            for lin in lins:  # warm: the kernels and this pass's page mappings
                lin(x)
            start = time.perf_counter()
            for lin in lins:
                lin(x)
            best[name] = min(best[name], time.perf_counter() - start)
    print("\n| format | bytes per weight | ms per pass | weight GB/s | vs float32 |")
    print("| --- | --- | --- | --- | --- |")
    for name, lins in layers.items():
        nbytes = sum(lin.nbytes for lin in lins)
        print(f"| {name} | {nbytes / (n * k * len(lins)):.3f} | {best[name] * 1e3:.2f} | "
              f"{nbytes / best[name] / 1e9:.1f} | {best['float32'] / best[name]:.2f}x |")


if __name__ == "__main__":
    main()
