"""Shared inputs and checks of the codec kernel tests (not a test module): ``encode``,
``quantize`` (and its paged write), ``dequantize``, ``insert`` and ``query`` of
``nvfp4_indexer/triton/``, tested in ``tests/triton/test_<module>.py``.

How the CPU run works: Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a
function, i.e. when a kernel module is imported (it is not re-read at launch). Importing this
module imports ``kernel_harness`` first, which sets ``TRITON_INTERPRET=1`` when no CUDA device
is present before any ``nvfp4_indexer.triton`` module is imported; if another test module
imported them earlier in compiled mode, ``kernel_harness.load_kernels`` reloads them (numerics
first) so their kernels become interpreted. With a GPU the same tests run compiled on CUDA
tensors, plus the ``gpu``-marked tests at realistic sizes.

- ``K``: the codec kernel modules by name (``numerics``, ``encode``, ``quantize``,
  ``dequantize``, ``insert``, ``query``).
- Inputs: ``generator``, ``random_bits_f32``, ``all_16bit``, ``edge_rows`` (SPEC 1.3's
  corners), ``quant_inputs``, ``norm_inputs``, ``device_rope_cache``.
- Caches: ``poisoned_cache`` (every byte ``POISON``, padded page stride ``PAD_STRIDE``),
  ``gpu_tokens`` (keys and slots at realistic sizes), ``token_bytes`` (the written tokens'
  code and scale bytes).
- SPEC 3 band: ``key_unexplained`` / ``query_unexplained`` (the harness's judges,
  ``conformance.judges``, as per-token / per-element rejections).
- ``compile_offline_sm90``: compile kernel configurations to SM90 in a subprocess (no GPU).
"""

from __future__ import annotations

import torch

from kernel_harness import (  # sets TRITON_INTERPRET before the kernels are imported
    DEV, as_bytes, load_kernels, offline_stdout)

from nvfp4_indexer import api
from nvfp4_indexer.reference import paging as P
from nvfp4_indexer.conformance.fixtures import cache_storage, rope_cache
from nvfp4_indexer.conformance.judges import explain_keys, explain_queries

PAD_STRIDE = 9216 + 64  # a page stride with padding (SPEC 2)
POISON = 0x5A
NAN, INF = float("nan"), float("inf")

K = load_kernels(("numerics", "encode", "quantize", "dequantize", "insert", "query"))


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def poisoned_cache(num_blocks: int, page_stride: int = PAD_STRIDE) -> torch.Tensor:
    """A cache of ``num_blocks`` pages on ``DEV``, every byte (padding too) ``POISON``."""
    cache = api.new_index_cache(num_blocks, device=DEV, page_stride=page_stride)
    cache_storage(cache).fill_(POISON)
    return cache


def random_bits_f32(n: int, gen) -> torch.Tensor:
    """``n`` fp32 values of uniformly random bit patterns (NaN, inf, subnormals included)."""
    return torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64) \
        .to(torch.int32).view(torch.float32)


def all_16bit(dtype) -> torch.Tensor:
    """Every bit pattern of the 16-bit float ``dtype``."""
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


# ---------------------------------------------------------------------------------------------
# Inputs with edge values
# ---------------------------------------------------------------------------------------------

def edge_rows() -> torch.Tensor:
    """fp32 ``[N, 128]`` rows hitting SPEC 1.3's corners."""
    g = generator(1)
    rows = [torch.zeros(128), torch.full((128,), -0.0)]
    r = torch.randn(128, generator=g)
    r[5], r[20], r[40], r[77] = NAN, INF, -INF, -0.0
    rows.append(r)
    r = torch.full((128,), NAN)
    r[17] = 1.0  # group 0 all NaN (amax 0 -> scale floor), group 1 one value
    r[40] = -INF
    rows.append(r)
    rows += [torch.randn(128, generator=g) * 1e30, torch.full((128,), 3.4e38),
             torch.full((128,), -3.4e38), torch.randn(128, generator=g) * 1e-30,
             torch.randn(128, generator=g) * 1e-40]  # fp32 subnormals
    # E2M1 decision points (and their neighbours) with exact power-of-two scales 2^(g-4).
    mids = torch.tensor([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5,
                         -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
    pow2 = 2.0 ** (torch.arange(8) - 4.0)
    exact = (mids[None, :] * pow2[:, None]).reshape(128)
    rows.append(exact)
    rows.append(torch.nextafter(exact, torch.full_like(exact, INF)))
    rows.append(torch.nextafter(exact, torch.full_like(exact, -INF)))
    # amax 6.3125 (amax/6 rounds down to scale 1, values above 6 saturate), E4M3 tie of amax/6
    # (6.375/6 = 1.0625 -> 1.0), outlier 3000 (scale 500 saturates to 448), 2688 = 6 * 448,
    # 2784 = 6 * 464 (tie at the top), amax just above 6e-12 (scale floor).
    for amax in (6.3125, 6.375, 3000.0, 2688.0, 2784.0, 2785.0, 6.1e-12, 0.0234375):
        r = torch.randn(128, generator=g).clamp(-2, 2) * (amax / 4)
        r[::16] = amax
        r[7::16] = -amax / 2
        rows.append(r)
    r = torch.randn(128, generator=g)
    r[3] = 3000.0
    rows.append(r)
    return torch.stack(rows)


def quant_inputs(dtype) -> torch.Tensor:
    """``edge_rows``, random bit patterns and rows over 24 decades, in ``dtype`` on ``DEV``."""
    g = generator(2)
    parts = [edge_rows(), random_bits_f32(48 * 128, g).view(48, 128),
             torch.randn(48, 128, generator=g) * torch.logspace(-12, 12, 48)[:, None]]
    return torch.cat(parts).to(dtype).to(DEV)


def norm_inputs(t: int, gen):
    """Keys with edge rows: random, zeros, NaN, inf, huge, tiny, -0.0, mixed magnitudes."""
    x = torch.randn(t, 128, generator=gen) * 3
    x[0] = 0.0
    x[1, 9] = NAN
    x[2, 70] = INF
    x[3] *= 1e30
    x[4] *= 1e-30
    x[5] = -0.0
    x[6, :64] *= 1e4
    return x


def device_rope_cache(max_pos: int, rot: int, dtype, transposed: bool = False) -> torch.Tensor:
    """The harness's ``[max_pos, rot]`` cos|sin cache on ``DEV`` (optionally a column-major
    view)."""
    cs = rope_cache(max_pos, rot, dtype)
    if transposed:
        cs = cs.t().contiguous().t()
    return cs.to(DEV)


def gpu_tokens(gen, num_blocks: int, t: int):
    """``(k bf16 [t, 128], slots int64 [t])`` on the GPU: random keys and distinct random
    slots in ``num_blocks`` pages, every 13th slot -1 (skipped)."""
    k = (torch.randn(t, 128, generator=gen) * 5).to(torch.bfloat16).cuda()
    slots = torch.randperm(num_blocks * 128, generator=gen)[:t]
    slots[::13] = -1
    return k, slots.cuda()


def token_bytes(cache, slots):
    """``(codes [T, 64], scales [T, 8])`` uint8: the page bytes of the tokens at the
    non-negative ``slots`` (SPEC 2)."""
    s = slots[slots >= 0].long()
    pages = P.page_bytes(cache)
    blk, off = s // 128, s % 128
    return pages[blk[:, None], P.code_byte_index(off)], pages[blk[:, None], P.scale_byte_index(off)]


# ---------------------------------------------------------------------------------------------
# SPEC 3 band: the harness's judges (conformance.judges), as per-token / per-element rejections
# ---------------------------------------------------------------------------------------------

def key_unexplained(codes: torch.Tensor, scales: torch.Tensor, value: torch.Tensor,
                    magnitude: torch.Tensor) -> torch.Tensor:
    """Per-token bool ``[T]``: ``explain_keys`` rejects the token's ``codes uint8 [T, 64]`` /
    ``scales [T, 8]`` against the exact float64 ``value`` and ``magnitude`` (SPEC 1.3, 3)."""
    c, s = codes.cpu(), as_bytes(scales).cpu()
    return ~explain_keys(value.cpu(), magnitude.cpu(), c, s, c, s)[0]


def query_unexplained(q_bytes: torch.Tensor, value: torch.Tensor,
                      magnitude: torch.Tensor) -> torch.Tensor:
    """Per-element bool: ``explain_queries`` rejects the E4M3 byte (SPEC 1.1, 3)."""
    return ~explain_queries(value.cpu(), magnitude.cpu(), as_bytes(q_bytes).cpu())


# ---------------------------------------------------------------------------------------------
# Offline compile for SM90 (no GPU needed): catches compiled-mode-only errors
# ---------------------------------------------------------------------------------------------

_COMPILE_HEAD = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nvfp4_indexer.triton import encode, quantize, dequantize, insert, query
from benchmarks.sass_stats import INSERT_TYPES, QUANT_TYPES, QUERY_TYPES
'''

_COMPILE_CHECK = r'''
for fn, types, consts in cases:
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, sig, constexprs=consts),
                         target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    name = f"{fn.__name__}{consts}"
    for bad in ("div.full", "div.approx", "rsqrt.approx", "sqrt.approx", ".ftz"):
        assert bad not in ptx, f"{name}: {bad} in PTX"
    native = "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert native == (not consts["PORTABLE"]), f"{name}: native fp8 cvt present={native}"
print("compiled", len(cases))
'''


# per kernel module: Python source of its ``(kernel, argument types, constexprs)`` list for one
# ``PORTABLE`` value ``P``
_COMPILE_CASES = {
    "encode": '[(encode._encode_e4m3_kernel, dict(x_ptr="*bf16", out_ptr="*u8", n="i32"), '
              'dict(PORTABLE=P, BLOCK=1024))]',
    "quantize": "[(quantize._quantize_nvfp4_kernel, QUANT_TYPES, "
                "dict(PAGED=True, PORTABLE=P, BLOCK_T=8))]",
    "dequantize": '[(dequantize._dequantize_nvfp4_kernel, dict(codes_ptr="*u8", '
                  'scales_ptr="*u8", out_ptr="*u8", n_rows="i32"), '
                  'dict(PORTABLE=P, OUT_F32=False, BLOCK_T=16))]',
    "insert": "[(insert._insert_index_k_kernel, INSERT_TYPES, "
              "dict(ROT=rot, PORTABLE=P, BLOCK_T=bt)) for rot, bt in ((64, 8), (128, 4), (96, 4))]",
    "query": "[(query._prepare_index_q_kernel, QUERY_TYPES, "
             "dict(ROT=64, PORTABLE=P, BLOCK_R=4))]",
}


def compile_offline_sm90(module: str) -> int:
    """Compile the kernel configurations of codec kernel module ``module`` (``encode``:
    the encoder; ``quantize``: the paged form ``write_index_k`` launches; ``dequantize``;
    ``insert``: rotary dims 64, 128 and 96, off the vectorized path; ``query``), each with
    ``PORTABLE`` True and False, to SM90 PTX + cubin (Triton's bundled ptxas, no GPU) in a
    subprocess (this process's kernels may be interpreted); return how many compiled.

    Each PTX must have no approximate division / sqrt and no flush-to-zero, and the native
    E4M3 cvt exactly when ``PORTABLE=False``. Skips without Triton's NVIDIA backend or ptxas.
    """
    cases = _COMPILE_CASES[module]
    script = f"{_COMPILE_HEAD}cases = [c for P in (True, False) for c in {cases}]\n{_COMPILE_CHECK}"
    out = offline_stdout(script, gluon=False, timeout=600)
    return int(out.split("compiled")[-1])
