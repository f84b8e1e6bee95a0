"""GPU probe: how ``mma.sync`` accumulates E4M3 (m16n8k32) and fp16 (m16n8k16) products.

Issue 13 asked whether E4M3 operands could feed the decode scorer's MMA without SM90 wgmma's
~13-bit FP8 accumulator (SPEC 9's b would fall from 15 to 5). This probe answers it for
``mma.sync`` on the current GPU, in two parts:

1. Random dot products (one m16n8 tile, values with exponents in +-0 / +-3) against the exact
   fp64 sum: the share equal to the correctly rounded fp32 value and the worst error relative
   to the sum of term magnitudes, with and without a nonzero accumulator C.
2. Alignment width: one large product 2^16 plus n small products 2^(16-k) (n = 31 for E4M3,
   15 for fp16), k = 8..33, in A x B and again with the large term in C: per k, "=" when the
   result is the correctly rounded fp32 sum, "T" when smaller (truncated), and the small
   terms' surviving count.

Run on a GPU: ``python -m benchmarks.labs.mma_precision_probe``; ``--sass`` (no GPU) compiles
the probe's tile kernel for sm_90a offline and counts its HMMA / F2FP / FADD instructions per
``mma.sync`` (``--sass-arch N`` for another target). H200 result
(``docs/results/mma-fp8-probe-h200-2026-12-01.txt``): both keep the small terms to k = 23 and
lose them from k = 24-26 on, the fp16 MMA's model (align to the largest addend, truncate to
the fp32 significand); but ``ptxas`` compiles the E4M3 ``mma.sync`` for sm_90a into F2FP
conversions to fp16, two HMMA.16816 and FADDs per instruction (it is not native on Hopper), so
it costs more than the fp16 path (docs/benchmarks.md, "Issue 13, fifth step"); so does
sm_100a, while sm_89 compiles it to one native QMMA.16832.F32.E4M3.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

M, N = 16, 8


@gluon.jit
def _tile_mma(a_ptr, b_ptr, c_ptr, out_ptr, K: gl.constexpr, KW: gl.constexpr):
    """out[16, 8] = A[16, K] @ B[K, 8] + C (one warp, ``mma_v2``; KW values per register)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])
    BLK: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
    m = gl.arange(0, 16, layout=gl.SliceLayout(1, BLK))
    k = gl.arange(0, K, layout=gl.SliceLayout(0, BLK))
    a = gl.load(a_ptr + gl.expand_dims(m, 1) * K + gl.expand_dims(k, 0))
    kk = gl.arange(0, K, layout=gl.SliceLayout(1, BLK))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, BLK))
    b = gl.load(b_ptr + gl.expand_dims(kk, 1) * 8 + gl.expand_dims(n, 0))
    mo = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    no = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    offs = gl.expand_dims(mo, 1) * 8 + gl.expand_dims(no, 0)
    acc = mma_v2(gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=MMA,
                                                          k_width=KW)),
                 gl.convert_layout(b, gl.DotOperandLayout(operand_index=1, parent=MMA,
                                                          k_width=KW)),
                 gl.load(c_ptr + offs))
    gl.store(out_ptr + offs, acc)


def tile_dot(op: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``A @ B + C`` on the GPU's ``mma.sync``: ``a`` [16, K] and ``b`` [K, 8] E4M3-exact
    float32 values, ``c`` float32 [16, 8]; ``op`` "e4m3" (K = 32) or "fp16" (K = 16)."""
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    assert torch.equal(a8.float(), a) and torch.equal(b8.float(), b), "values not E4M3"
    if op == "e4m3":
        aa, bb, kw = a8, b8, 4
    else:
        aa, bb, kw = a8.to(torch.float16), b8.to(torch.float16), 2
    out = torch.empty(M, N, device="cuda")
    _tile_mma[(1,)](aa.cuda(), bb.cuda(), c.cuda(), out, K=a.shape[1], KW=kw, num_warps=1)
    return out.cpu()


def _random_e4m3(shape, gen, spread: int) -> torch.Tensor:
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    mant = 1 + torch.randint(0, 8, shape, generator=gen) / 8
    e = torch.randint(-spread, spread + 1, shape, generator=gen)
    return (sign * mant * torch.pow(2.0, e.double())).float()


def random_dots(op: str, spread: int, with_c: bool, trials: int = 200) -> str:
    k = 32 if op == "e4m3" else 16
    gen = torch.Generator().manual_seed(1)
    exact = total = 0
    worst = 0.0
    for _ in range(trials):
        a, b = _random_e4m3((M, k), gen, spread), _random_e4m3((k, N), gen, spread)
        c = torch.randn(M, N, generator=gen) * 2.0 ** spread if with_c else torch.zeros(M, N)
        ref = a.double() @ b.double() + c.double()
        mag = a.double().abs() @ b.double().abs() + c.double().abs()
        got = tile_dot(op, a, b, c).double()
        exact += int((got == ref.float().double()).sum())
        total += got.numel()
        worst = max(worst, float(((got - ref).abs() / mag).max()))
    bits = f"2^{math.log2(worst):.1f}" if worst else "0"
    return (f"{op:5s} K={k} spread {spread} C={'rand' if with_c else 'zero'}: "
            f"{100 * exact / total:6.2f} % correctly rounded, worst err / sum|t| {bits}")


def alignment(op: str, big_in_c: bool) -> str:
    k_len = 32 if op == "e4m3" else 16
    n = k_len - 1
    cells = []
    for k in range(8, 34):
        e = 16 - k
        ea = max(-9, min(8, e // 2))
        x, y = 2.0 ** ea, 2.0 ** (e - ea)
        a, b, c = torch.zeros(M, k_len), torch.zeros(k_len, N), torch.zeros(M, N)
        if big_in_c:
            a[0, :n], b[:n, 0], c[0, 0] = x, y, 2.0 ** 16
        else:
            a[0, :n + 1] = torch.tensor([256.0] + [x] * n)
            b[:n + 1, 0] = torch.tensor([256.0] + [y] * n)
        got = float(tile_dot(op, a, b, c)[0, 0])
        want = float(torch.tensor(2.0 ** 16 + n * 2.0 ** e, dtype=torch.float64).float())
        mark = "=" if got == want else ("T" if got < want else ">")
        cells.append(f"{k}:{mark}{(got - 2.0 ** 16) / 2.0 ** e:.0f}")
    where = "big term in C" if big_in_c else "big term in A x B"
    return f"{op:5s} {where:17s} " + " ".join(cells)


def offline_sass(arch: int = 90) -> list[str]:
    """Per operand type, the SASS opcodes ``ptxas`` emits for the probe's one ``mma.sync``
    (offline compile for ``sm_<arch>``, no GPU)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from benchmarks.sass_stats import _tool
    lines = []
    for op, dt, k, kw in (("e4m3", "fp8e4nv", 32, 4), ("fp16", "fp16", 16, 2)):
        sig = dict(a_ptr=f"*{dt}", b_ptr=f"*{dt}", c_ptr="*fp32", out_ptr="*fp32",
                   K="constexpr", KW="constexpr")
        kern = triton.compile(GluonASTSource(_tile_mma, sig, constexprs=dict(K=k, KW=kw)),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": 1})
        ptx = kern.asm["ptx"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kern.asm["cubin"])
            f.flush()
            sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True,
                                  text=True, check=True).stdout
        ops = {o: len(re.findall(rf"\b{o}\b", sass)) for o in ("QMMA", "HMMA", "F2FP", "FADD")}
        lines.append(f"sm_{arch} {op}: {ptx.count('mma.sync.aligned')} mma.sync in PTX -> SASS "
                     + ", ".join(f"{n} {o}" for o, n in ops.items()))
    return lines


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m benchmarks.labs.mma_precision_probe",
                                 description="How mma.sync accumulates E4M3 and fp16 products "
                                 "on the current GPU (module docstring).")
    ap.add_argument("--sass", action="store_true",
                    help="no GPU: compile the tile kernel offline, count its SASS per mma.sync")
    ap.add_argument("--sass-arch", type=int, default=None, metavar="N",
                    help="the --sass target sm_N (default 90; implies --sass)")
    args = ap.parse_args(argv)
    if args.sass or args.sass_arch is not None:
        for line in offline_sass(90 if args.sass_arch is None else args.sass_arch):
            print(line)
        return 0
    if not torch.cuda.is_available():
        print("mma_precision_probe: needs a CUDA GPU")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for spread in (0, 3):
        for with_c in (False, True):
            for op in ("e4m3", "fp16"):
                print(random_dots(op, spread, with_c), flush=True)
    print("alignment (k: mark, small terms kept; n = 31 E4M3 / 15 fp16 terms of 2^(16-k))")
    for op in ("e4m3", "fp16"):
        for big_in_c in (False, True):
            print(alignment(op, big_in_c), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
