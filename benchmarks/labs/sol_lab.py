"""GPU lab: speed-of-light variants of the gather and the insert at the suites' sizes.

Run (one H200, about a minute)::

    python -m benchmarks.labs.sol_lab               # both parts
    python -m benchmarks.labs.sol_lab --part gather # or insert

Every variant is timed as the suites time the real kernels (``benchmarks.timing``: CUDA-graph
replays over rotated slots, cold pages from one pool far larger than L2) and rated against the
2 GiB copy ceiling measured at the start, so the rows locate the bound at each size:

- gather (WORKLOADS.md prefill cases): the library's gather (default, and one page per
  program); "chain copy": the gather's grid and dependent chain (lengths / offsets -> block
  table -> page) with the page bytes stored widened but not dequantized; "flat copy xN": the
  same bytes read and written with no chain at all (N page parts of 1 152 B in / 2 048 B out
  per one-warp program); ``torch.Tensor.copy_`` of the same byte count (in a graph it is a
  memcpy node).
- insert (16 384 tokens): the fused insert at several tokens per program; "sol": per token the
  same loads (keys, position -> cos/sin row, slot) and the same 72 bytes stored, without the
  norm / RoPE / quantize work ("loads"), with only the keys ("keys") or only the cos/sin rows
  ("cos/sin"), only the slot load and the stores ("stores"), or nothing ("empty": the
  launch). "seqpos": each slot's positions one contiguous run, as in a prefill chunk (the
  suite draws them at random). "sol persistent": the "loads" (or "keys") variant on a grid of
  a few programs per SM, each looping over token blocks with the next block's loads in
  flight (no launch per block, no position -> cos/sin round trip in the loop).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nvfp4_indexer.triton.prefill.gather import _load_tile
from nvfp4_indexer.triton.layout import PAGE, WS_PAGE, num_history_pages
from nvfp4_indexer.triton.quantize import paged_token_bases

from . import knob_lab as kl
from .cli import gpu_args, lab_parser


@triton.jit
def _chain_copy_kernel(cache_ptr, page_stride, bt_ptr, bt_row_stride, len_ptr, off_ptr, ws_ptr,
                       ws_pages, width, num_blocks, PAGE_PARTS: tl.constexpr):
    """The gather's program (page part, request) and dependent chain, with the code pairs
    and scale bytes stored widened to uint32 instead of dequantized (not E4M3 bytes)."""
    PART: tl.constexpr = PAGE // PAGE_PARTS
    r = tl.program_id(1)
    j = tl.program_id(0) // PAGE_PARTS
    tok0 = (tl.program_id(0) % PAGE_PARTS) * PART
    num_pages = tl.minimum(num_history_pages(tl.load(len_ptr + r).to(tl.int64)), width)
    dst = tl.load(off_ptr + r).to(tl.int64) + j
    ok = (j < num_pages) & (dst >= 0) & (dst < ws_pages)
    if ok:
        block = tl.load(bt_ptr + r.to(tl.int64) * bt_row_stride + j)
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)
        codes, scales = _load_tile(cache_ptr + block * page_stride, tok0, ok, PART, "ptx", True)
        g = tl.arange(0, 8)[None, :, None]
        k = tl.arange(0, 4)[None, None, :]
        tok = (tok0 + tl.arange(0, PART))[:, None, None]
        optr = (ws_ptr + dst * WS_PAGE + tok * 128).to(tl.pointer_type(tl.uint32),
                                                       bitcast=True) + g * 4 + k
        tl.store(optr, codes.to(tl.uint32) | (scales.to(tl.uint32) << 16), cache_modifier=".cs")


@triton.jit
def _flat_copy_kernel(src, dst, PARTS: tl.constexpr):
    """No chain, no dequant: program p reads PARTS x 1 152 contiguous bytes (1 024 + 128, as
    uint64) and writes PARTS x 2 048 (each word twice), the gather's bytes per page part."""
    p = tl.program_id(0).to(tl.int64) * PARTS + tl.arange(0, PARTS)[:, None]
    s64 = src.to(tl.pointer_type(tl.uint64), bitcast=True) + p * 144
    a = tl.load(s64 + tl.arange(0, 128)[None, :], eviction_policy="evict_first")
    b = tl.load(s64 + 128 + tl.arange(0, 16)[None, :], eviction_policy="evict_first")
    v = a + tl.sum(b, axis=1)[:, None]
    w = tl.reshape(tl.join(v, v), [PARTS, 256])
    d64 = dst.to(tl.pointer_type(tl.uint64), bitcast=True) + p * 256
    tl.store(d64 + tl.arange(0, 256)[None, :], w, cache_modifier=".cs")


@triton.jit
def _store_token_bytes(ok, codes_at, scales_at, v):
    """Stores 64 code bytes and 8 scale bytes per token derived from ``v [BT]`` at the
    pointers ``quantize.paged_token_bases`` gives (rows where ``ok`` is false skipped)."""
    c = (v[:, None] + tl.arange(0, 64)[None, :]).to(tl.uint8)
    tl.store(codes_at[:, None] + tl.arange(0, 64)[None, :], c, mask=ok[:, None])
    sc = (v[:, None] + tl.arange(0, 8)[None, :]).to(tl.uint8)
    tl.store(scales_at[:, None] + tl.arange(0, 8)[None, :], sc, mask=ok[:, None])


@triton.jit
def _insert_sol_kernel(x_ptr, pos_ptr, cs_ptr, cache_ptr, slot_ptr, n, page_stride,
                       BT: tl.constexpr, LOADS: tl.constexpr):
    """Per token some of the insert's loads and its 72 stored bytes, no per-value work.
    LOADS: 1 = bf16 keys ``[n, 128]`` and position -> bf16 cos/sin row ``[., 64]``; 2 = keys
    only; 3 = position -> cos/sin only; 0 = none; always the slot and the stores; -1 = an
    empty program (the launch alone)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = t < n
    v = t * 0
    if LOADS == 1 or LOADS == 2:
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * 128 + tl.arange(0, 128)[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        v += tl.sum(x, 1).to(tl.int32, bitcast=True)
    if LOADS == 1 or LOADS == 3:
        pos = tl.load(pos_ptr + t, mask=ok, other=0)
        cs = tl.load(cs_ptr + pos[:, None] * 64 + tl.arange(0, 64)[None, :], mask=ok[:, None],
                     other=0.0).to(tl.float32)
        v += tl.sum(cs, 1).to(tl.int32, bitcast=True)
    if LOADS >= 0:
        good, codes_at, scales_at = paged_token_bases(cache_ptr, slot_ptr, page_stride, t, ok)
        _store_token_bytes(good, codes_at, scales_at, v)


@triton.jit
def _token_block_loads(x_ptr, pos_ptr, cache_ptr, slot_ptr, n, page_stride, t):
    """Tokens ``t [BT]``'s loads: ``(t < n, keys [BT, 128], positions, then
    ``quantize.paged_token_bases``' ok, code and scale pointers)``."""
    ok = t < n
    x = tl.load(x_ptr + t[:, None].to(tl.int64) * 128 + tl.arange(0, 128)[None, :],
                mask=ok[:, None], other=0.0)
    pos = tl.load(pos_ptr + t, mask=ok, other=0)
    good, codes_at, scales_at = paged_token_bases(cache_ptr, slot_ptr, page_stride, t, ok)
    return ok, x, pos, good, codes_at, scales_at


@triton.jit
def _insert_sol_persistent_kernel(x_ptr, pos_ptr, cs_ptr, cache_ptr, slot_ptr, n, page_stride,
                                  iters, BT: tl.constexpr, KEYS_ONLY: tl.constexpr):
    """``_insert_sol_kernel``'s loads and stores (LOADS 1, or 2 with KEYS_ONLY) on a
    persistent grid: program p takes token blocks p, p + P, ... (``iters`` of them), with the
    next block's keys, position and slot loaded before the current block's cos/sin row, sum
    and stores (the position is a block ahead: no dependent round trip in the loop)."""
    nprog = tl.num_programs(0)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    ok, x, pos, good, codes_at, scales_at = _token_block_loads(
        x_ptr, pos_ptr, cache_ptr, slot_ptr, n, page_stride, t)
    for _ in range(iters):
        tn = t + nprog * BT
        okn, xn, posn, goodn, codesn, scalesn = _token_block_loads(
            x_ptr, pos_ptr, cache_ptr, slot_ptr, n, page_stride, tn)
        v = tl.sum(x.to(tl.float32), 1).to(tl.int32, bitcast=True)
        if not KEYS_ONLY:
            cs = tl.load(cs_ptr + pos[:, None] * 64 + tl.arange(0, 64)[None, :],
                         mask=ok[:, None], other=0.0).to(tl.float32)
            v += tl.sum(cs, 1).to(tl.int32, bitcast=True)
        _store_token_bytes(good, codes_at, scales_at, v)
        t, ok, x, pos = tn, okn, xn, posn
        good, codes_at, scales_at = goodn, codesn, scalesn


GATHER_CASES = [(1_024, 32_768, 4), (4_096, 131_072, 1), (16_384, 32_768, 4),
                (16_384, 131_072, 4), (1_024, 32_768, 1)]


def gather_part(ctx) -> None:
    from nvfp4_indexer.triton.prefill import gather as tg
    from nvfp4_indexer.triton.config import GatherConfig

    from .. import workloads as wl
    for n, c, r in GATHER_CASES:
        case = wl.PrefillCase(n, c, r)
        tr, slots, width, tables, seq, offsets, max_pages = kl.gather_inputs(ctx, case)
        pages, cache, reqs = tr.history_pages, ctx.pool.cache, len(seq)
        wss = [torch.empty((pages, 128, 128), dtype=torch.uint8, device=ctx.device)
               for _ in range(slots)]

        def rec(name, fns):
            kl._record_gbps(ctx, "gather", case.name, name, ctx.time_capturable(fns),
                            tr.bytes_moved, "-", slots)

        for name, cfg in (("gather", None), ("gather pages1", GatherConfig(pages_per_program=1))):
            kl._attempt(ctx, name, lambda name=name, cfg=cfg: rec(name, [functools.partial(
                tg.gather_into, cache, tables[i], seq, offsets, wss[i], max_pages, config=cfg)
                for i in range(slots)]))

        def chain(i):
            grid = (min(max_pages, width) * 8, reqs)
            _chain_copy_kernel[grid](cache, cache.stride(0), tables[i], tables[i].stride(0), seq,
                                     offsets, wss[i], pages, width, cache.shape[0],
                                     PAGE_PARTS=8, num_warps=1)
        kl._attempt(ctx, "chain copy", lambda: rec("chain copy", [
            functools.partial(chain, i) for i in range(slots)]))
        wss = None  # noqa: F841 (frees the workspaces)
        bufs = [(torch.empty(pages * 9216, dtype=torch.uint8, device=ctx.device),
                 torch.empty(pages * 16384, dtype=torch.uint8, device=ctx.device))
                for _ in range(slots)]
        for parts in (1, 2, 4):
            def flat(i, parts=parts):
                s, d = bufs[i]
                _flat_copy_kernel[(pages * 8 // parts,)](s, d, PARTS=parts, num_warps=1)
            kl._attempt(ctx, f"flat x{parts}", lambda parts=parts, flat=flat: rec(
                f"flat copy x{parts}", [functools.partial(flat, i) for i in range(slots)]))
        bufs = None  # noqa: F841
        half = tr.bytes_moved // 2
        tb = [(torch.empty(half, dtype=torch.uint8, device=ctx.device),
               torch.empty(half, dtype=torch.uint8, device=ctx.device)) for _ in range(slots)]
        kl._attempt(ctx, "torch copy_", lambda: rec("torch copy_", [
            functools.partial(d.copy_, s) for s, d in tb]))
        tb = None  # noqa: F841
        torch.cuda.empty_cache()


def insert_part(ctx) -> None:
    from nvfp4_indexer.triton import insert as ti
    from nvfp4_indexer.triton.config import InsertConfig

    from .. import workloads as wl
    from ..insert_suite import insert_inputs
    case = wl.InsertCase()
    tr, slots, pool, weight, cos_sin, inputs = insert_inputs(ctx, case)
    n = case.tokens
    assert case.rotary_dim == 64 and cos_sin.is_contiguous() and cos_sin.shape[1] == 64

    def rec(name, fns):
        kl._record_gbps(ctx, "insert", case.name, name, ctx.time_capturable(fns),
                        tr.bytes_moved, "-", slots)

    # the same keys and slots with each slot's positions one contiguous run (a prefill chunk)
    gen = torch.Generator().manual_seed(ctx.seed + 29)
    seq_inputs = [(k, (torch.randint(0, case.max_position - n, (1,), generator=gen)
                       + torch.arange(n)).to(pos.device, pos.dtype), slot)
                  for k, pos, slot in inputs]
    for bt, nw in ((4, None), (8, None), (16, None), (32, None), (16, 1)):
        cfg = InsertConfig(block_t=bt, num_warps=nw)
        for label, xs in (("", inputs), (" seqpos", seq_inputs)):
            name = f"insert bt{bt}" + (f" w{nw}" if nw else "") + label
            kl._attempt(ctx, name, lambda name=name, cfg=cfg, xs=xs: rec(
                name, [functools.partial(ti.insert_index_k, pool.cache, *x, weight,
                                         cos_sin, case.rotary_dim, 1e-6, config=cfg)
                       for x in xs]))
    modes = {1: "loads", 2: "keys", 3: "cos/sin", 0: "stores", -1: "empty"}
    for bt, nw in ((4, 1), (16, 1), (32, 1), (64, 2), (64, 4)):
        for mode, what in modes.items():
            for label, xs in (("", inputs), (" seqpos", seq_inputs)):
                if label and mode not in (1, 3):
                    continue

                def f(x, bt=bt, nw=nw, mode=mode):
                    k, pos, slot = x
                    _insert_sol_kernel[(triton.cdiv(n, bt),)](
                        k, pos, cos_sin, pool.cache, slot, n, pool.cache.stride(0), BT=bt,
                        LOADS=mode, num_warps=nw)
                name = f"sol bt{bt} w{nw} {what}{label}"
                kl._attempt(ctx, name, lambda name=name, f=f, xs=xs: rec(
                    name, [functools.partial(f, x) for x in xs]))
    # one warp per program: Triton 3.6 fails to compile this loop at 2 and 4 warps
    # ("PassManager::run failed", results/sol-lab-insert-h200-2026-12-02.txt)
    for bt, nw in ((16, 1), (32, 1)):
        for iters in (2, 4, 8):  # token blocks per program: grid = blocks / iters
            grid = triton.cdiv(triton.cdiv(n, bt), iters)
            for keys_only in (False, True):
                def f(x, bt=bt, nw=nw, grid=grid, iters=iters, keys_only=keys_only):
                    k, pos, slot = x
                    _insert_sol_persistent_kernel[(grid,)](
                        k, pos, cos_sin, pool.cache, slot, n, pool.cache.stride(0), iters,
                        BT=bt, KEYS_ONLY=keys_only, num_warps=nw)
                name = (f"sol persistent bt{bt} w{nw} x{iters} ({grid} programs) "
                        f"{'keys' if keys_only else 'loads'}")
                kl._attempt(ctx, name, lambda name=name, f=f: rec(
                    name, [functools.partial(f, x) for x in inputs]))


def main(argv=None) -> int:
    ap = lab_parser(__doc__)
    ap.add_argument("--part", choices=("all", "gather", "insert"), default="all")
    args = gpu_args(ap, argv, "sol_lab")
    ctx = kl.make_context(600)
    kl.ensure_pool(ctx, 40_000)
    if args.part in ("all", "gather"):
        gather_part(ctx)
    if args.part in ("all", "insert"):
        kl._attempt(ctx, "insert", functools.partial(insert_part, ctx))
    kl.print_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
