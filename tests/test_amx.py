"""The AMX-BF16 tile kernel for decode-sized bf16 matmuls (ladle/model/kernels/amx_linear.cpp).

It runs only on CPUs with AMX (Sapphire Rapids and later), where it is checked against float64. On
every x86 machine: the source is compiled and assembled for Sapphire Rapids (the tile instructions
and our own ldtilecfg are really in the object); the same kernel, built on tiles emulated in software,
is checked against float64 (its packing, tile shapes, block pairs and tails); and the kernel is never
offered, routed to or forced where the CPU or the build lacks AMX.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ladle.model import kernels
from ladle.model.kernels import loader, routing

pytestmark = pytest.mark.isa
SOURCE = Path(loader.__file__).parent / "amx_linear.cpp"
HAS_AMX = "amx" in loader.supported_isas()


def test_amx_is_offered_only_where_the_cpu_has_it() -> None:
    if loader.platform.machine() != "x86_64":
        pytest.skip("x86 flags")
    avx512 = {"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl"}
    assert loader.supported_isas(avx512 | {"amx_tile", "amx_bf16"}) == ["amx", "avx512", "avx2", "scalar"]
    assert loader.supported_isas(avx512 | {"amx_tile"}) == ["avx512", "avx2", "scalar"]  # tiles without bf16
    assert loader.supported_isas({"avx", "avx2", "fma", "amx_tile", "amx_bf16"}) == ["avx2", "scalar"]


@pytest.mark.skipif(shutil.which("g++") is None or loader.platform.machine() != "x86_64", reason="needs g++ on x86")
def test_the_kernel_assembles_for_sapphire_rapids(tmp_path: Path) -> None:
    """The AMX branches, not the stubs, compiled for a Sapphire Rapids target: the objects hold the tile
    config load, the tile loads, the bf16 (and int8) dot products and the tile release."""
    obj = tmp_path / "amx_linear.o"
    done = subprocess.run(["g++", "-O3", "-march=sapphirerapids", "-ffp-contract=off", "-fopenmp", "-c", str(SOURCE),
                           "-o", str(obj)], capture_output=True, text=True)
    if done.returncode and "sapphirerapids" in done.stderr:
        pytest.skip(f"this g++ does not know Sapphire Rapids: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    listing = subprocess.run(["objdump", "-d", str(obj)], capture_output=True, text=True, check=True).stdout
    for instruction in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilezero", "tilerelease"):
        assert instruction in listing, instruction
    int8 = tmp_path / "int8_dot.o"
    subprocess.run(["g++", "-O3", "-march=sapphirerapids", "-std=c++20", "-ffp-contract=off", "-fopenmp", "-c",
                    str(SOURCE.parent / "int8_dot.cpp"), "-o", str(int8)], check=True, capture_output=True)
    int8_listing = subprocess.run(["objdump", "-d", str(int8)], capture_output=True, text=True, check=True).stdout
    assert "tdpbsud" in int8_listing and "ldtilecfg" in int8_listing  # the int8 path's tiles
    stub = subprocess.run(["g++", "-O2", "-march=x86-64-v3", "-c", str(SOURCE), "-o", str(tmp_path / "stub.o")],
                          capture_output=True, text=True)
    assert stub.returncode == 0, stub.stderr[-3000:]
    assert "tdpbf16ps" not in subprocess.run(["objdump", "-d", str(tmp_path / "stub.o")], capture_output=True,
                                             text=True, check=True).stdout


def within_bf16_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> bool:
    """Each output within bf16 rounding of the float64 product of the same bf16 operands (the sum
    runs in float32), bias included."""
    exact = x.double() @ w.double().T + bias.double()
    scale = (x.double().abs() @ w.double().abs().T + bias.double().abs())
    return bool(((y.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-5 * scale).all())


def bf16_operands(rows: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    return x, w, torch.randn(n, generator=gen).bfloat16()


def build_emulated(source: Path, tmp_path_factory: pytest.TempPathFactory, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """`source` compiled alone with LADLE_AMX_EMULATE (its AMX code on tiles in software), loaded."""
    if shutil.which("g++") is None or loader.platform.machine() != "x86_64":
        pytest.skip("needs g++ on x86")
    lib = tmp_path_factory.mktemp("amx_emulated") / f"lib{source.stem}.so"
    subprocess.run(["g++", "-O2", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", *flags,
                    "-DLADLE_AMX_EMULATE", str(source), "-o", str(lib)], check=True, capture_output=True)
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="module")
def emulated_amx(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """amx_linear.cpp built on tiles in software (LADLE_AMX_EMULATE): the kernel's own code, any CPU."""
    emulated = build_emulated(SOURCE, tmp_path_factory)
    emulated.ladle_amx_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    assert emulated.ladle_amx_ready() == 1
    return emulated


def emulated_linear(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                    threads: int = 1) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    code = lib.ladle_amx_linear(x.data_ptr(), w.data_ptr(), bias.data_ptr(), y.data_ptr(), *x.shape, w.shape[0],
                                threads)
    assert code == 0, code
    return y


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32])
@pytest.mark.parametrize("k, n, threads", [(896, 1152, 2), (100, 37, 1), (64, 16, 1), (96, 48, 2)])
def test_the_kernel_on_emulated_tiles_against_float64(emulated_amx, rows: int, k: int, n: int, threads: int) -> None:
    """One or two x halves (rows 1-16, 17-32), whole and odd block pairs (48 outputs: a pair and one
    block), inputs and outputs past the last whole tile, shared over two threads; a row alone gives
    the same bits as in its batch."""
    x, w, bias = bf16_operands(rows, k, n)
    y = emulated_linear(emulated_amx, x, w, bias, threads)
    assert within_bf16_rounding(y, x, w, bias)
    assert torch.equal(emulated_linear(emulated_amx, x[-1:].contiguous(), w, bias), y[-1:])
    assert emulated_amx.ladle_amx_linear(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), 33, k, n, 1) == -1


@pytest.fixture(scope="module")
def emulated_int8(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """int8_dot.cpp built with its AMX path on emulated tiles, beside its own dot-product path (AVX2)."""
    emulated = build_emulated(SOURCE.parent / "int8_dot.cpp", tmp_path_factory, ("-march=native", "-mno-avx512f"))
    for name in ("ladle_int8_amx_linear", "ladle_int8_dot_linear"):
        getattr(emulated, name).argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4 + \
            [ctypes.c_int64] * 3 + [ctypes.c_int]
    assert emulated.ladle_int8_amx_ready() == 1
    return emulated


@pytest.mark.parametrize("rows", [1, 4, 16, 17, 32])
@pytest.mark.parametrize("k, n, threads", [(896, 1152, 2), (96, 37, 1), (32, 16, 1), (64, 48, 2)])
def test_the_int8_kernel_on_emulated_tiles_gives_the_dot_products_bits(emulated_int8, rows: int, k: int, n: int,
                                                                        threads: int) -> None:
    """TDPBSUD's sums of x's quantised blocks with the packed weights, folded as the dot-product kernel
    folds its own: the same bits as that kernel (here and as ladle's build has it), for one and two x
    halves, panel pairs and an odd panel, a column tail, two threads; and the float64 product of the
    quantised operands."""
    gen = torch.Generator().manual_seed(rows * 100 + k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    w_scales = torch.rand(n, generator=gen) / 64 + 1e-3
    packed, scales = kernels.NativeKernels.pack_dot(q, w_scales)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)

    def run(name: str) -> torch.Tensor:
        y = torch.empty(rows, n)
        code = getattr(emulated_int8, name)(x.data_ptr(), k, packed.data_ptr(), scales.data_ptr(), bias.data_ptr(),
                                            y.data_ptr(), rows, k, n, threads)
        assert code in (0, None), code
        return y

    y = run("ladle_int8_amx_linear")
    assert torch.equal(y, run("ladle_int8_dot_linear"))
    native = kernels.native_kernels()
    if native is not None:
        assert torch.equal(y, native.int8_dot_linear(x, packed, scales, n, bias))
    amax = x.view(rows, -1, 32).abs().amax(-1, keepdim=True)  # x as the kernel quantises it, per block of 32
    xq = (x.view(rows, -1, 32) * (127 / amax)).round() * (amax / 127)
    exact = xq.view(rows, k).double() @ (q.double() * w_scales.double()[:, None]).T + bias.double()
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(HAS_AMX, reason="this CPU has AMX")
def test_never_routed_to_without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    if not loader.enabled():
        pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
    monkeypatch.delenv("LADLE_MATMUL", raising=False)
    native = kernels.native_kernels()
    assert native.isa != "amx" and not native.amx and not native.amx_int8
    weights = [torch.randn(96, 64).bfloat16(), torch.randn(64, 96).bfloat16()]
    measured = routing.choose_routing(native, weights)
    assert "amx" not in measured.measured and "amx" not in measured.by_rows
    with pytest.raises(RuntimeError, match="not built for AMX"):
        native.amx_linear(torch.randn(2, 64).bfloat16(), weights[0])
    monkeypatch.setenv("LADLE_MATMUL", "amx:torch")
    with pytest.raises(ValueError, match="amx kernel needs a CPU with AMX-BF16"):
        routing.choose_routing(native, weights)


@pytest.fixture
def amx_kernels(monkeypatch: pytest.MonkeyPatch):
    if not HAS_AMX:
        pytest.skip("no AMX-BF16 on this CPU")
    monkeypatch.setenv("LADLE_ISA", "amx")
    loader.reset()
    k = loader.native_kernels()
    assert k is not None and k.isa == "amx" and k.amx
    yield k
    monkeypatch.undo()
    loader.reset()


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 45])
@pytest.mark.parametrize("k, n", [(896, 1152), (100, 37), (64, 16)])  # a model's shape; tails of K and N; one tile
def test_amx_linear_against_float64(amx_kernels, rows: int, k: int, n: int) -> None:
    """Within bf16 rounding of float64 (see within_bf16_rounding); a row alone gives the same bits as
    in its batch."""
    x, w, bias = bf16_operands(rows, k, n)
    y = amx_kernels.amx_linear(x, w, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert within_bf16_rounding(y, x, w, bias)
    assert torch.equal(amx_kernels.amx_linear(x[-1:].contiguous(), w, bias), y[-1:])


def test_amx_is_measured_for_bf16_decode_buckets(amx_kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LADLE_MATMUL", raising=False)
    weights = [torch.randn(1152, 896).bfloat16(), torch.randn(896, 1152).bfloat16()]
    measured = routing.choose_routing(amx_kernels, weights)
    parts = measured.measured.split("; ")
    assert all("amx" in p for p in parts[:-1]) and "amx" not in parts[-1]
    assert "amx" not in routing.choose_routing(amx_kernels, [w.float() for w in weights]).measured


def test_int8_decode_rows_take_the_tiles_with_the_dot_products_bits(amx_kernels,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from ladle.model.quantization import AMX_INT8_ROWS, Int8Linear

    assert amx_kernels.amx_int8, "the int8 AMX kernel failed its self-check at load"
    layer = Int8Linear(torch.randn(200, 128, generator=torch.Generator().manual_seed(9)))
    assert layer._dot and layer._kernels is amx_kernels
    calls = []
    real = amx_kernels.int8_amx_linear
    monkeypatch.setattr(amx_kernels, "int8_amx_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(40, 128)
    for rows in (1, 8, 32, 40):
        y = layer(x[:rows])
        assert torch.equal(y, amx_kernels.int8_dot_linear(x[:rows], layer._int8_panels, layer.scales, 200))
    assert calls == [r for r in (1, 8, 32) if r in AMX_INT8_ROWS]  # 40 rows: more than the tiles take
