"""``triton.prefill.gather``: the gather of history pages into the FP8 workspace against the
bit-exact reference (SPEC 7, 9, 10).

CPU (interpreter): every tuning writes the reference's bytes at the requests' offsets,
pages outside the workspace or past ``min(max_pages, W)`` are skipped, the poison around
them stays, ragged requests with block ids outside the cache (clamped) and seq lens past
the table width (clamped to W pages); tuning checks; launches split over the grid's y
limit. GPU: the "ptx" and "triton" dequantization modes on every (code, scale byte) pair,
misaligned workspaces, realistic sizes. Offline: the kernel compiles for SM90 in both modes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvfp4_indexer.conformance.fixtures import cache_storage
from kernel_harness import DEV, HAS_CUDA, as_bytes, assert_bytes_equal, offline_lines, random_cache
from nvfp4_indexer import api
from nvfp4_indexer.reference import formats as F
from nvfp4_indexer.reference import paging as P
from nvfp4_indexer.triton.prefill import gather as G

POISON = 0x5A
PAD_STRIDE = 9216 + 64  # a page stride with padding (SPEC 2)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gather_case(gen):
    num_blocks = 7
    cache = random_cache(num_blocks, gen, PAD_STRIDE)
    seq_lens = torch.tensor([0, 1, 129, 385, 256, 128], dtype=torch.int32)
    width = 4
    full = torch.full((6, 9), -1, dtype=torch.int32)
    full[:, 5:] = 10**6  # garbage past the width
    for r, n in enumerate(P.pages_needed(seq_lens).tolist()):
        full[r, :n] = torch.randint(0, num_blocks, (n,), generator=gen, dtype=torch.int32)
    block_table = full.to(DEV)[:, :width]  # row stride 9: a view
    return cache, block_table, seq_lens.to(DEV)


def test_gather_index_k_fp8_bit_exact():
    cache, block_table, seq_lens = _gather_case(_gen(9))
    before = cache_storage(cache).clone()
    ws, offsets = api.gather_index_k_fp8(cache, block_table, seq_lens, backend="triton")
    rws, roffsets = api.gather_index_k_fp8(cache, block_table, seq_lens, backend="reference")
    assert ws.dtype == torch.float8_e4m3fn and ws.shape == (5, 128, 128)
    assert offsets.dtype == torch.int32 and torch.equal(offsets.cpu(), roffsets.cpu())
    assert_bytes_equal(ws, rws)
    assert_bytes_equal(cache_storage(cache), before)  # read-only
    # No history pages at all: an empty workspace.
    ws0, off0 = api.gather_index_k_fp8(cache, block_table[:2], seq_lens[:2], backend="triton")
    assert ws0.shape == (0, 128, 128) and off0.tolist() == [0, 0, 0]


@pytest.mark.parametrize("from_seq_lens,tuning", [(True, {}),
                                                  (False, dict(tok_block=64, num_warps=2)),
                                                  (True, dict(page_parts=4)),
                                                  (False, dict(page_parts=8, tok_block=128)),
                                                  (True, dict(pages_per_program=1)),
                                                  (False, dict(pages_per_program=2,
                                                               page_parts=2, tok_block=32))])
def test_gather_into_offsets_and_untouched_pages(from_seq_lens, tuning):
    cache, block_table, seq_lens = _gather_case(_gen(10))
    rws, roffsets = api.gather_index_k_fp8(cache, block_table, seq_lens, backend="reference")
    total = rws.shape[0]
    ws = torch.full((total + 4, 128, 128), POISON, dtype=torch.uint8, device=DEV)
    offsets = (roffsets + 2).to(DEV)  # pages land at [2, 2 + total)
    lengths = seq_lens if from_seq_lens else P.history_pages(seq_lens).to(torch.int32)
    G.gather_into(cache, block_table, lengths, offsets, ws.view(torch.float8_e4m3fn),
                            max_pages=6, lengths_are_seq_lens=from_seq_lens,
                            config=G.GatherConfig(**tuning))
    assert_bytes_equal(ws[2:2 + total], rws)
    assert bool((ws[:2] == POISON).all()) and bool((ws[2 + total:] == POISON).all())


@pytest.mark.parametrize("pages_per_program", [1, 2])
@pytest.mark.parametrize("layout", [[0, 0, 5, -1, 2, 9], [0, 0, 0, 2, 1, 0]])
def test_gather_into_pages_at_the_workspace_edges(pages_per_program, layout):
    """Each page is kept or skipped on its own (SPEC 7): with 2 pages per program, a page
    whose workspace slot lies outside ``[0, P)`` is skipped while its program's other page is
    written (request 3 at slot -1: its page 0 skipped, page 1 written; or at slot 2: page 0
    written, page 1 past the end), odd page counts leave the second page of a program
    alone, and nothing else is touched."""
    cache, block_table, seq_lens = _gather_case(_gen(11))
    rws, roffsets = api.gather_index_k_fp8(cache, block_table, seq_lens, backend="reference")
    counts = P.history_pages(seq_lens.cpu()).tolist()  # [0, 0, 1, 3, 1, 0]
    offsets = torch.tensor(layout, dtype=torch.int32)
    ws_pages = 3
    ws = torch.full((ws_pages, 128, 128), POISON, dtype=torch.uint8, device=DEV)
    G.gather_into(cache, block_table, seq_lens, offsets.to(DEV),
                            ws.view(torch.float8_e4m3fn), max_pages=6,
                            config=G.GatherConfig(pages_per_program=pages_per_program))
    want = torch.full_like(ws, POISON)
    for r, n in enumerate(counts):
        for j in range(n):
            dst = int(offsets[r]) + j
            if 0 <= dst < ws_pages:
                want[dst] = rws[int(roffsets[r]) + j].view(torch.uint8)
    assert counts == [0, 0, 1, 3, 1, 0]
    assert_bytes_equal(ws, want)


def test_gather_into_rejects_bad_tuning():
    """The tuning overrides are validated before any launch (even for an empty batch), and
    dequant "ptx" is refused where it cannot run (interpreter / CPU / portable)."""
    g = G
    cache, block_table, seq_lens = _gather_case(_gen(12))
    ws = torch.empty((0, 128, 128), dtype=torch.float8_e4m3fn, device=DEV)
    off = torch.zeros(7, dtype=torch.int32, device=DEV)
    bad = [dict(dequant="bogus"), dict(tok_block=48), dict(tok_block=256), dict(tok_block=32.0),
           dict(tok_block=True), dict(num_warps=3), dict(num_warps=32), dict(num_warps="4"),
           dict(page_parts=3), dict(page_parts=16), dict(page_parts=0),
           dict(dequant="ptx", portable=True), dict(streaming=1), dict(streaming="yes"),
           dict(pages_per_program=0), dict(pages_per_program=3), dict(pages_per_program=2.0)]
    if not HAS_CUDA:
        bad.append(dict(dequant="ptx"))
    for kw in bad:
        with pytest.raises(ValueError, match=next(iter(kw))):
            portable = kw.pop("portable", None)
            g.gather_into(cache, block_table, seq_lens, off, ws, 6, portable=portable,
                          config=g.GatherConfig(**kw))


@pytest.mark.parametrize("config", [dict(pages_per_program=1), dict(pages_per_program=2),
                                    dict(pages_per_program=2, page_parts=2, tok_block=32)])
def test_gather_pages_past_an_odd_max_pages_stay_untouched(config):
    """Device page counts past an odd host ``max_pages`` (3 here; the counts are read on the
    device): every PAGES writes request r's pages ``< min(max_pages, W)`` only,
    the reference's bytes, so a two-page program whose second page is page ``max_pages``
    leaves that slot (poison here; another request's in a packed layout) untouched."""
    gen = _gen(17)
    nb = 5
    cache = random_cache(nb, gen)
    counts = torch.tensor([4, 5, 2], dtype=torch.int32)  # host bound: 3 pages
    block_table = torch.randint(0, nb, (3, 6), generator=gen, dtype=torch.int32)
    offsets = torch.tensor([0, 4, 8], dtype=torch.int32)
    ws = torch.full((11, 128, 128), POISON, dtype=torch.uint8, device=DEV)
    G.gather_into(cache, block_table.to(DEV), counts.to(DEV), offsets.to(DEV),
                            ws.view(torch.float8_e4m3fn), 3, lengths_are_seq_lens=False,
                            config=G.GatherConfig(**config))
    seq = (counts.clamp(max=3) * 128 + 1).to(DEV)
    rws, _ = api.gather_index_k_fp8(cache, block_table.to(DEV), seq, backend="reference")
    want = torch.full_like(ws, POISON)
    want[0:3], want[4:7], want[8:10] = (rws[:3].view(torch.uint8), rws[3:6].view(torch.uint8),
                                        rws[6:8].view(torch.uint8))
    assert_bytes_equal(ws, want)


def test_gather_into_max_pages_numpy_int_or_refused():
    """``max_pages`` reaches the kernel as a Python int (a numpy integer is taken, as the
    launchers' other ints; Triton's GPU launch refuses numpy ints, and ``CachedLaunch`` checks
    every argument with that type check, under the interpreter too): the same bytes as a
    Python int; a float or a tensor is refused naming ``max_pages`` before anything is
    written."""
    cache, block_table, seq_lens = _gather_case(_gen(18))
    rws, roff = api.gather_index_k_fp8(cache, block_table, seq_lens, backend="reference")
    cfg = G.GatherConfig(pages_per_program=2)
    ws = torch.full((rws.shape[0], 128, 128), POISON, dtype=torch.uint8, device=DEV)
    G.gather_into(cache, block_table, seq_lens, roff.to(DEV), ws, np.int64(3), config=cfg)
    assert_bytes_equal(ws, rws)  # 3 < W = 4: max_pages bounds the kernel's page counts
    ws.fill_(POISON)
    for bad in (3.0, torch.tensor(3), "3", None):
        with pytest.raises(ValueError, match="max_pages"):
            G.gather_into(cache, block_table, seq_lens, roff.to(DEV), ws, bad, config=cfg)
    assert bool((ws == POISON).all())


def _gather_default(cache, block_table, lengths, offsets, ws_pages, max_pages,
                    from_seq_lens, page_parts):
    """A poisoned workspace of ``ws_pages`` pages gathered with ``page_parts`` programs per
    page."""
    ws = torch.full((ws_pages, 128, 128), POISON, dtype=torch.uint8, device=DEV)
    G.gather_into(cache, block_table, lengths, offsets, ws.view(torch.float8_e4m3fn), max_pages,
                  lengths_are_seq_lens=from_seq_lens, config=G.GatherConfig(page_parts=page_parts))
    return ws


@pytest.mark.parametrize("from_seq_lens,page_parts", [(True, 1), (False, 4), (True, 2)])
def test_gather_ragged_requests_clamped(from_seq_lens, page_parts):
    """The reference's bytes (SPEC 7, 9) on ragged requests with zero-history ones (seq_len 0,
    1, 128), block ids outside the cache (clamped into it) and a seq_len past the table width
    (clamped to its W pages, SPEC 10); the poison before, between and after the gathered
    pages stays."""
    gen = _gen(14)
    nb, width = 7, 4
    cache = random_cache(nb, gen, PAD_STRIDE)
    seq_lens = torch.tensor([0, 385, 1, 129, 5000, 128, 256, 513], dtype=torch.int32)
    full = torch.randint(-3, nb + 3, (len(seq_lens), 9), generator=gen, dtype=torch.int32)
    block_table = full.to(DEV)[:, :width]  # a view (row stride 9), garbage past the width
    ok_seq = seq_lens.clamp(max=128 * width + 1)  # the pages the kernel may read
    # the reference checks its table covers the current page too: one column more
    rws, _ = api.gather_index_k_fp8(cache, full[:, :width + 1].clamp(0, nb - 1).contiguous()
                                    .to(DEV), ok_seq.to(DEV), backend="reference")
    assert rws.shape[0] == 3 + 1 + 4 + 1 + 4 and int((full[:, :width] >= nb).sum()) > 0
    pages = P.history_pages(seq_lens)  # unclamped counts: the offsets leave request 4 room
    offsets = torch.zeros(len(seq_lens), dtype=torch.int32)
    offsets[1:] = torch.cumsum(pages, 0)[:-1]
    offsets += 2
    lengths = seq_lens if from_seq_lens else pages.to(torch.int32)
    ws_pages = int(offsets[-1]) + int(pages[-1]) + 3
    ws = _gather_default(cache, block_table, lengths.to(DEV), offsets.to(DEV), ws_pages, 39,
                         from_seq_lens, page_parts)
    got = torch.cat([ws[o:o + n] for o, n in
                     zip(offsets.tolist(), P.history_pages(ok_seq).tolist())])
    assert_bytes_equal(got, rws)
    assert bool((ws[:2] == POISON).all())
    assert bool((ws[int(offsets[4]) + width:int(offsets[5])] == POISON).all())
    assert bool((ws[ws_pages - 3:] == POISON).all())


def test_gather_skips_counts_and_offsets_outside():
    """Page counts (lengths_are_seq_lens=False) that are 0 or negative, a request whose
    offset is negative and one that runs past the workspace's end: exactly the pages inside
    the workspace are written (the others stay poison), and a batch with no page to gather
    writes nothing."""
    gen = _gen(15)
    cache = random_cache(6, gen, PAD_STRIDE)
    counts = torch.tensor([2, -3, 3, 0, 2, 3], dtype=torch.int32)
    block_table = torch.randint(0, 6, (6, 3), generator=gen, dtype=torch.int32).to(DEV)
    offsets = torch.tensor([0, 1, -2, 5, 5, 8], dtype=torch.int32)  # [-2, 1) and [8, 11)
    ws = _gather_default(cache, block_table, counts.to(DEV), offsets.to(DEV), 10, 3, False, 2)
    written = [0, 1, 5, 6, 8, 9]  # request 0, 2 (its page 2), 4, 5 (pages 0, 1)
    assert not bool((ws[written] == POISON).all(dim=(1, 2)).any())
    rest = [p for p in range(10) if p not in written]
    assert bool((ws[rest] == POISON).all())
    zero = _gather_default(cache, block_table, torch.zeros_like(counts).to(DEV),
                           offsets.to(DEV), 10, 3, False, 1)
    assert bool((zero == POISON).all())


def test_gather_honours_max_pages():
    """Device page counts past the host ``max_pages`` (metadata edited after planning: the
    counts are read on the device): the grid covers pages ``< min(max_pages, W)`` only."""
    gen = _gen(16)
    cache = random_cache(5, gen, PAD_STRIDE)
    counts = torch.tensor([4, 1, 3], dtype=torch.int32)
    block_table = torch.randint(0, 5, (3, 4), generator=gen, dtype=torch.int32).to(DEV)
    offsets = torch.tensor([0, 4, 5], dtype=torch.int32)
    ws = _gather_default(cache, block_table, counts.to(DEV), offsets.to(DEV), 8, 2, False, 2)
    written = [0, 1, 4, 5, 6]
    assert not bool((ws[written] == POISON).all(dim=(1, 2)).any())
    assert bool((ws[[2, 3, 7]] == POISON).all())


def test_gather_launcher_splits_requests_over_launches():
    """More requests than a launch's y axis takes (2 here, ``max_reqs``) are gathered over
    several launches, each request's pages at its own offsets; ``gather_into`` plans the
    same way with ``MAX_GRID_Y``."""
    cache, block_table, seq_lens = _gather_case(_gen(13))
    rws, roffsets = api.gather_index_k_fp8(cache, block_table, seq_lens, backend="reference")
    ws = torch.full((rws.shape[0], 128, 128), POISON, dtype=torch.uint8, device=DEV)
    launcher = G.gather_launcher(cache.device)
    n, width = block_table.shape
    pages, launches = launcher.plan(n, block_table, seq_lens, roffsets.to(DEV), 6, width,
                                    cache.device, max_reqs=2)
    assert [g[1] for g, _ in launches] == [2, 2, 2] and n == 6
    launcher.run(launcher.kernels(cache, ws)[pages], launches, cache, ws, min(width, 6))
    assert_bytes_equal(ws, rws)
    assert [g[1] for g, _ in launcher.plan(n, block_table, seq_lens, roffsets, 6, width)[1]] \
        == [n]


_COMPILE = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from benchmarks.sass_stats import GATHER_TYPES
from nvfp4_indexer.triton.prefill.gather import gather_kernel

for consts in (dict(FROM_SEQ_LENS=False, PORTABLE=False, TOK_BLOCK=16, DEQUANT="ptx",
                    PAGE_PARTS=2, STREAM=True, PAGES=2),
               *(dict(FROM_SEQ_LENS=True, PORTABLE=p, TOK_BLOCK=32, DEQUANT="triton",
                      PAGE_PARTS=1, STREAM=False, PAGES=1) for p in (True, False))):
    sig = {n: "constexpr" if n in consts else GATHER_TYPES[n] for n in gather_kernel.arg_names}
    ptx = triton.compile(ASTSource(gather_kernel, sig, constexprs=consts),
                         target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    bad = [b for b in ("div.full", "div.approx", "rsqrt.approx", "sqrt.approx", ".ftz")
           if b in ptx]
    native = "cvt.rn.satfinite.e4m3x2.f32" in ptx
    asm = "cvt.rn.satfinite.e4m3x2.f16x2" in ptx and "prmt.b32" in ptx and "lop3.b32" in ptx
    print(consts["DEQUANT"], int(consts["PORTABLE"]), int(native), int(asm), len(bad))
'''


def test_gather_kernel_compiles_offline_for_sm90():
    """The gather kernel compiles to SM90 PTX + cubin (no GPU): no approximate division /
    sqrt, no flush-to-zero; "ptx": the f16x2 cvt of its inline asm, no fp32 one; "triton":
    the native E4M3 cvt only when PORTABLE=False."""
    assert offline_lines(_COMPILE) == ["ptx 0 0 1 0", "triton 1 0 0 0", "triton 0 1 0 0"]


def _all_pairs_cache(num_blocks: int, gen) -> torch.Tensor:
    """A padded cache of random code and scale bytes whose pages cover, in each of the 8 dim
    positions of a ``nvfp4_dequant_ptx_bytes`` call (dims 8m .. 8m + 7), every (E2M1 code,
    scale byte) pair: NaN scales 0x7F / 0xFF, negative, zero and subnormal scales, code 8."""
    cache = random_cache(num_blocks, gen)
    codes, scales = P.read_blocks(cache, torch.arange(num_blocks, device=DEV))
    nib = F.unpack_e2m1(codes.cpu()).long()  # [blocks, 128, 128] codes in dim order
    sb = as_bytes(scales).cpu().long().repeat_interleave(16, dim=-1)  # scale byte per dim
    pos = torch.arange(128) % 8
    for k in range(8):
        pairs = (nib[..., pos == k] * 256 + sb[..., pos == k]).unique()
        assert pairs.numel() == 16 * 256, f"dim position {k}: {pairs.numel()} pairs covered"
    return cache


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", [dict(dequant="ptx"),
                                    dict(dequant="ptx", tok_block=128, num_warps=8),
                                    dict(dequant="ptx", tok_block=8, num_warps=1),
                                    dict(dequant="ptx", tok_block=16, num_warps=16),
                                    dict(dequant="ptx", tok_block=8, num_warps=16),
                                    dict(dequant="ptx", page_parts=4, num_warps=2),
                                    dict(dequant="ptx", page_parts=8, num_warps=1),
                                    dict(dequant="ptx", streaming=False),
                                    dict(dequant="triton", page_parts=2),
                                    dict(dequant="triton"), dict()])
def test_gpu_gather_dequant_modes_bit_exact(tuning):
    """The gather's dequantization modes on the GPU (inline PTX "ptx" with several tunings,
    down to layouts with fewer elements than threads (8 tokens x 32 pairs on 16 warps),
    "triton", the default) against the reference, byte for byte, on a cache whose pages hold
    every (code, scale byte) pair in every dim position of an asm call (NaN scales must give
    0x7F, code 8 0x80 / 0x00 by the scale's sign). A wrong element or nibble order inside the
    packed uint32 words (e.g. Triton packing the two outputs of a ``pack=2`` call the other
    way) moves codes to other dims, which random codes show at once. The workspace is
    poisoned: pages before the offsets, past the gathered ones and those a request's
    out-of-range offset skips must stay poison."""
    g = _gen(43)
    nb = 64
    cfg = G.GatherConfig(**tuning)
    cache = _all_pairs_cache(nb, g)
    counts = [0, 20, 1, 40, 3]  # 64 pages: every page once (a permutation of the cache)
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    bt = torch.full((len(counts), 48), -1, dtype=torch.int32)
    starts = [0] + torch.tensor(counts).cumsum(0).tolist()
    for r, n in enumerate(counts):
        bt[r, :n] = perm[starts[r]:starts[r] + n]
    bt = bt.cuda()
    seq_lens = torch.tensor([128 * n + 1 for n in counts], dtype=torch.int32, device="cuda")
    rws, roff = api.gather_index_k_fp8(cache, bt, seq_lens, backend="reference")
    assert rws.shape[0] == nb
    for from_seq_lens in (True, False):
        ws = torch.full((nb + 5, 128, 128), POISON, dtype=torch.uint8, device="cuda")
        off = (roff + 2).cuda()
        lengths = seq_lens if from_seq_lens else torch.tensor(counts, device="cuda")
        G.gather_into(cache, bt, lengths, off, ws.view(torch.float8_e4m3fn),
                                max_pages=48, lengths_are_seq_lens=from_seq_lens, config=cfg)
        torch.cuda.synchronize()
        assert_bytes_equal(ws[2:2 + nb], rws)
        assert bool((ws[:2] == POISON).all()) and bool((ws[2 + nb:] == POISON).all())
    # the last request starts 2 pages before the end: its third page lies outside and is skipped
    ws = torch.full((8, 128, 128), POISON, dtype=torch.uint8, device="cuda")
    off = torch.tensor([0, 0, 0, 0, 6], dtype=torch.int32, device="cuda")
    G.gather_into(cache, bt[4:], seq_lens[4:], off[4:], ws.view(torch.float8_e4m3fn),
                            max_pages=3, config=cfg)
    torch.cuda.synchronize()
    assert_bytes_equal(ws[6:], rws[61:63])
    assert bool((ws[:6] == POISON).all())


@pytest.mark.gpu
def test_gpu_gather_misaligned_workspace():
    """A workspace view that is not 4-byte aligned: the default falls back to the byte path
    (still exact, neighbours untouched), an explicit dequant="ptx" is refused (no misaligned
    uint32 store)."""
    cache, block_table, seq_lens = _gather_case(_gen(44))
    rws, roff = api.gather_index_k_fp8(cache, block_table, seq_lens, backend="reference")
    n = rws.shape[0] * 128 * 128
    flat = torch.full((n + 8,), POISON, dtype=torch.uint8, device="cuda")
    ws = flat[2:2 + n].view(-1, 128, 128)
    with pytest.raises(ValueError, match="aligned"):
        G.gather_into(cache, block_table, seq_lens, roff, ws, 6,
                                config=G.GatherConfig(dequant="ptx"))
    G.gather_into(cache, block_table, seq_lens, roff, ws, 6)
    torch.cuda.synchronize()
    assert_bytes_equal(ws, rws)
    assert bool((flat[:2] == POISON).all()) and bool((flat[2 + n:] == POISON).all())


@pytest.mark.gpu
def test_gpu_gather_realistic_sizes():
    """6 requests of up to 20k tokens (an empty one, one of 1 token) from a padded 1000-block
    random cache: the reference's workspace bytes and offsets."""
    g = _gen(42)
    cache = random_cache(1000, g, PAD_STRIDE)
    seq_lens = torch.tensor([20000, 1, 0, 129, 7777, 16384], dtype=torch.int32)
    width = -(-20000 // 128)
    bt = torch.randint(0, 1000, (6, width), generator=g, dtype=torch.int32)
    ws_t, off_t = api.gather_index_k_fp8(cache, bt.cuda(), seq_lens.cuda(), backend="triton")
    ws_r, off_r = api.gather_index_k_fp8(cache, bt.cuda(), seq_lens.cuda(), backend="reference")
    assert torch.equal(off_t, off_r)
    assert_bytes_equal(ws_t, ws_r)
