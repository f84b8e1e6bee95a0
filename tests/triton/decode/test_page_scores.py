"""The page-score decode family (``triton.decode.page_scores``: the Gluon "mma", "wgflat" and
"wgmma" scorers and their plain-Triton "lut" twin) vs the reference (SPEC 4-6, 9, 10).

CPU (interpreter): the "lut" twin (same flat grid, scratch and select kernels) against the exact
reference, with poisoned outputs, NaN / negative-scale pages, exact ties and SPEC 10 clamps
(block ids outside the cache, seq_lens past the table width); the flat partition; host checks
of the Gluon launches. GPU (SM90): the same tests through the Gluon scorers (tie-aware, b = 15),
in CUDA-graph replays after in-place changes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_harness import (  # sets TRITON_INTERPRET before the kernels are imported
    DEV, HAS_CUDA, Batch, K, assert_guards, decode_check, decode_lens, offline_lines,
    poisoned_out, random_q)

from nvfp4_indexer import reference as ref  # noqa: E402
from nvfp4_indexer.triton import device as DV  # noqa: E402
from nvfp4_indexer.triton.config import DecodeConfig  # noqa: E402
from nvfp4_indexer.triton.decode.dispatch import plan_decode  # noqa: E402
from nvfp4_indexer.conformance.fixtures import OUT_POISON  # noqa: E402

DECODE = K["decode.runner"]
PS = K["decode.page_scores"]
# the page-score scorers a test runs: the Gluon kernels on a GPU that has them, else the twin
FAST_MODES = [m for m, ok in (("mma", HAS_CUDA and DV.mma_available(DEV)),
                              ("wgflat", HAS_CUDA and DV.wgmma_available(DEV)),
                              ("wgmma", HAS_CUDA and DV.wgmma_available(DEV))) if ok] or ["lut"]
FLAT_MODES = [m for m in FAST_MODES if m in ("mma", "wgflat", "lut")]  # the flat grid's

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


def page_score_launch(dequant, b, w, q_len, heads, programs=None):
    """``PageScoreLaunch`` of ``dequant`` with one split per request (the plan of this
    device; on the CPU a simulated SM90 for the Gluon modes: host checks only), on
    ``programs`` flat programs when given."""
    cap = DV.capability(DEV)
    if cap is None and dequant != "lut":
        cap = (9, 0)
    cfg = DecodeConfig(dequant=dequant, num_splits=1, dot="fp32" if dequant == "lut" else "fp16")
    plan = plan_decode(heads, b, w, q_len, cfg, capability=cap, num_sms=DV.num_sms(DEV))
    if programs:
        plan = dataclasses.replace(plan, programs=programs)
    return PS.PageScoreLaunch(plan)


def _special_pages(batch: Batch) -> None:
    """NaN pages, a partly NaN page, negative and saturating scales (corrupted caches)."""
    g = torch.Generator().manual_seed(9)
    for k, (r, j) in enumerate(((0, 3), (0, 11), (6, 2), (6, 14), (7, 4))):
        page = batch.page_bytes(int(batch.block_table[r, j]))
        if k < 2:
            page[8192:] = 0x7F  # all NaN
        elif k == 2:
            page[8192:8192 + 8 * 60] = 0xFF  # tokens 0..59 NaN
        elif k == 3:
            page[8192:] = (torch.randint(1, 0x7F, (1024,), generator=g) | 0x80).to(torch.uint8)
        else:
            page[8192:] = 0x7E  # 6 * 448 saturates


@pytest.mark.parametrize("dequant", FAST_MODES)
@pytest.mark.parametrize("q_len,heads,num_splits", [(1, 1, 1), (2, 2, 3), (8, 1, None),
                                                    (4, 4, 2)])
def test_decode_lut_twin_matches_reference(q_len, heads, num_splits, dequant):
    """The two-launch path (``FAST_MODES``: the plain-Triton twin here, each Gluon scorer on a
    GPU that has it): selections valid against the exact scores (tie-aware, b = 16; 15 on
    the GPU), exact ties (aliased blocks) by smaller id, NaN pages below every number,
    nothing written outside ``out``'s rows."""
    aliases = ((0, 2, 9), (7, 0, 5))
    batch = Batch(decode_lens(q_len), seed=20 + q_len, alias=list(aliases))
    _special_pages(batch)
    b = batch.seq_lens.shape[0]
    q = random_q(b * q_len, heads, seed=q_len + 1)
    big, out = poisoned_out(b * q_len, heads)
    cfg = DECODE.DecodeConfig(dequant=dequant, num_splits=num_splits,
                              dot=None if HAS_CUDA else "fp32")
    runner = DECODE.DecodeRunner(heads, b, batch.width, q_len, DEV, config=cfg)
    runner.run(q, batch.cache, batch.block_table, batch.seq_lens, out)
    assert_guards(big)
    decode_check(batch, q, q_len, out, runner.error_bits, aliases)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 70))
def test_flat_partition_scores_every_page_once(counts, programs):
    """The flat partition of the "mma" / "wgflat" / "lut" scorers (``flat_partition``): every page of
    every request in exactly one program's segments, segments inside their request, program
    loads differing by at most one page, each program's segments in request order."""
    parts = PS.flat_partition(counts, programs)
    assert len(parts) == programs
    seen = [[0] * n for n in counts]
    loads = []
    for segs in parts:
        assert [b for b, _, _ in segs] == sorted({b for b, _, _ in segs})
        loads.append(sum(hi - lo for _, lo, hi in segs))
        for b, lo, hi in segs:
            assert 0 <= lo < hi <= counts[b]
            for j in range(lo, hi):
                seen[b][j] += 1
    assert all(c == 1 for row in seen for c in row)
    assert max(loads) - min(loads) <= 1


@pytest.mark.parametrize("q_len,heads,rows", [(2, 2, 16), (8, 4, 32)])
@pytest.mark.parametrize("dequant", FLAT_MODES)
def test_flat_score_kernel_writes_exactly_the_scored_pages(dequant, q_len, heads, rows):
    """The score kernels on the flat grid ("mma" and "wgflat" on a GPU that has them, else the
    twin): with 1, 3, 7, 40 and more programs than pages (for "wgflat": groups of four pages
    whose idle warps store nothing), the page-score scratch holds the
    same bits, written at ``[b, n, j]`` for every scored page j < n_b of every row n < N
    and nowhere else (NaN-poisoned): requests of 0, short (<= 15 pages: none scored), and
    long histories, a padding request, programs spanning several requests; 16 and 32 rows
    (the rows "wgflat" is the default at)."""
    lens = [17 * 128 + 5, 0, 3 * 128, 24 * 128 + 1, 16 * 128 + 1, 20 * 128]
    batch = Batch(lens, seed=31)
    b, w = batch.block_table.shape
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    seq[1] = -5  # a padding request
    q = random_q(b * q_len, heads, seed=5)
    n_pages = [(max(s, 1) - 1) // 128 if s > 0 else 0 for s in seq.tolist()]
    n_pages = [n if n > 15 else 0 for n in n_pages]
    assert sum(n_pages) > 40
    results = []
    for programs in (1, 3, 7, 40, 4 * sum(n_pages)):
        scores = torch.full((b * rows * w,), float("nan"), device=DEV)
        big, out = poisoned_out(b * q_len, heads)
        page_score_launch(dequant, b, w, q_len, heads, programs)(
            q, batch.cache, batch.block_table, seq, out, scores, num_blocks=batch.cache.shape[0])
        assert_guards(big)
        sc = scores.view(b, rows, w).cpu()
        written = ~sc.isnan()
        want = torch.zeros_like(written)
        for r, n in enumerate(n_pages):
            want[r, :, :n] = True  # padding rows n >= Q*H too (zero queries)
        assert torch.equal(written, want), programs
        results.append(sc)
    for sc in results[1:]:
        assert torch.equal(sc.view(torch.int32), results[0].view(torch.int32))


def _run_edited_metadata(batch, bt, seq, q_len, heads, dequant, q_seed):
    """Decode ``batch.cache`` with a runner planned for ``batch``'s shape but run on block
    table ``bt`` and seq_lens ``seq`` (metadata edited after planning; 2 splits) into a
    poisoned buffer; its guards checked, the rows on the CPU."""
    b, w = batch.block_table.shape
    q = random_q(b * q_len, heads, seed=q_seed)
    big, out = poisoned_out(b * q_len, heads)
    cfg = DECODE.DecodeConfig(dequant=dequant, num_splits=2, dot=None if HAS_CUDA else "fp32")
    runner = DECODE.DecodeRunner(heads, b, w, q_len, DEV, config=cfg)
    runner.run(q, batch.cache, bt, seq, out)
    assert_guards(big)
    return out.cpu()


@pytest.mark.parametrize("dequant", FAST_MODES)
def test_decode_lut_spec10_clamps(dequant):
    """SPEC 10: block ids outside the cache and seq_lens past the table width (metadata edited
    after planning) never read outside the cache or the table row: output ids stay in [0, W)
    with the local page clamped to W - 1, and history slots hold real ids."""
    q_len, heads = 2, 2
    batch = Batch([2400, 2300], seed=4)
    b, w = batch.block_table.shape
    bt = batch.block_table.clone()
    bt[0, 5] = 10 ** 6  # far outside the cache
    bt[1, 7] = -3
    seq = torch.tensor([w * 128 + 5000, 2300], dtype=torch.int32, device=DEV)
    o = _run_edited_metadata(batch, bt, seq, q_len, heads, dequant, q_seed=2)
    assert int(o.min()) >= 0 and int(o.max()) < w
    assert (o[0:2, :, 15] == w - 1).all()  # request 0: local page clamped to the width
    for row in o[0:2].reshape(-1, 16):  # 15 distinct history pages
        assert len(set(row[:15].tolist())) == 15


@pytest.mark.parametrize("dequant", FAST_MODES)
def test_decode_lut_int32_min_seq_lens_are_padding(dequant):
    """SPEC 10: seq_lens near INT32_MIN (edited after planning) must not wrap around: with
    only the upper clamp, ``seq_len - Q + i`` (select) and ``seq_len - 1`` (scorer) overflow
    int32 to huge positive values and the kernels read far outside the score row / the
    block-table row (a segfault under the interpreter). They select like padding rows."""
    q_len, heads = 2, 1
    batch = Batch([2400, 2300], seed=6)
    b, w = batch.block_table.shape
    seq = torch.tensor([-2 ** 31, -2 ** 31 + 1], dtype=torch.int32, device=DEV)
    o = _run_edited_metadata(batch, batch.block_table, seq, q_len, heads, dequant, q_seed=3)
    pad = torch.tensor([0] + [-1] * 15, dtype=torch.int32)
    assert bool((o == pad).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dequant", ["mma", "wgflat", "wgmma", "wgflat-fp8"])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_gpu_page_score_decode_graph_replays(num_splits, dequant):
    """The Gluon scorers: tie-aware vs the exact reference (b = 15; "wgflat-fp8": dot "fp8",
    b = 5), captured once in a CUDA graph and replayed after in-place changes of seq_lens."""
    dot = "fp8" if dequant.endswith("-fp8") else None
    dequant = dequant.removesuffix("-fp8")
    if dequant not in FAST_MODES:
        pytest.skip(f"{dequant!r} is not available on this GPU (mma: SM89+, wgflat and "
                    f"wgmma: SM90)")
    q_len, heads = 8, 4
    lens = [40_000, 0, 129, 2050, 16_500, 12_345, 33_000, 19_999]
    batch = Batch(lens, seed=31)
    _special_pages(batch)
    b = len(lens)
    q = random_q(b * q_len, heads, seed=5)
    runner = DECODE.DecodeRunner(heads, b, batch.width, q_len, DEV,
                                 config=DECODE.DecodeConfig(dequant=dequant, dot=dot,
                                                            num_splits=num_splits))
    assert runner.error_bits == (5 if dot else 15)
    bt, seq = batch.block_table.clone(), batch.seq_lens.clone()
    big, out = poisoned_out(b * q_len, heads)
    runner.run(q, batch.cache, bt, seq, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runner.run(q, batch.cache, bt, seq, out)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        new = [max(q_len, s - int(torch.randint(0, 3000, (1,), generator=g))) if s else 0
               for s in lens]
        seq.copy_(torch.tensor(new, dtype=torch.int32))
        batch.seq_lens.copy_(seq)
        out.fill_(OUT_POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert_guards(big)
        decode_check(batch, q, q_len, out, runner.error_bits)
        want = ref.decode_indexer(q, batch.cache, bt, seq, q_len)
        # ties aside, the same pages (fp8: accumulation errors of ~2^-13 reorder close pages)
        assert (out == want).all(-1).float().mean() > (0.9 if dot else 0.95)


@pytest.mark.gpu
@pytest.mark.parametrize("dequant", ["mma", "wgflat", "wgflat-fp8"])
@pytest.mark.parametrize("programs", [None, 7])
def test_gpu_flat_scorers_many_requests(dequant, programs):
    """The flat-grid Gluon scorers on a batch of 200 requests (the flat partition's request
    vector holds more than one element per thread: BB = 256), Q8 H4 (32 rows): tie-aware vs
    the exact reference (b = 15; "wgflat-fp8": b = 5), every scored page written and nothing
    else, with the default grid and with 7 programs (each spanning ~30 requests)."""
    dot = "fp8" if dequant.endswith("-fp8") else None
    dequant = dequant.removesuffix("-fp8")
    if dequant not in FAST_MODES:
        pytest.skip(f"{dequant!r} is not available on this GPU (mma: SM89+, wgflat: SM90)")
    q_len, heads, rows = 8, 4, 32
    g = torch.Generator().manual_seed(11)
    lens = [int(x) for x in torch.randint(8, 40 * 128, (200,), generator=g)]
    lens[5], lens[77], lens[150] = 0, 16 * 128 + 1, 40 * 128
    lens[0], lens[6], lens[7] = 30 * 128, 25 * 128, 20 * 128  # _special_pages' pages
    batch = Batch(lens, seed=13)
    _special_pages(batch)
    b, w = batch.block_table.shape
    q = random_q(b * q_len, heads, seed=3)
    poison = -3.0e38  # no dot product of E4M3 keys and queries (NaN pages score NaN)
    scores = torch.full((b * rows * w,), poison, device=DEV)
    big, out = poisoned_out(b * q_len, heads)
    runner = DECODE.DecodeRunner(heads, b, w, q_len, DEV,
                                 config=DECODE.DecodeConfig(dequant=dequant, dot=dot),
                                 score_buffer=scores)
    launch = PS.PageScoreLaunch(dataclasses.replace(runner.plan,
                                                    programs=programs or runner.plan.programs))
    scores.fill_(poison)  # after the runner's warmup launch
    launch(q, batch.cache, batch.block_table, batch.seq_lens, out, scores,
           num_blocks=batch.cache.shape[0])
    torch.cuda.synchronize()
    assert_guards(big)
    decode_check(batch, q, q_len, out, runner.error_bits)
    n_pages = [(max(s, 1) - 1) // 128 if s > 0 else 0 for s in lens]
    n_pages = [n if n > 15 else 0 for n in n_pages]
    written = (scores.view(b, rows, w) != poison).cpu()
    want = torch.zeros_like(written)
    for r, n in enumerate(n_pages):
        want[r, :, :n] = True
    assert torch.equal(written, want)


@pytest.mark.parametrize("dequant,offset,stride", [("mma", 8, 9216), ("mma", 0, 9224),
                                                   ("wgflat", 8, 9216), ("wgflat", 0, 9224),
                                                   ("wgmma", 4, 9216), ("wgmma", 0, 9220)])
def test_gluon_launch_refuses_a_misaligned_cache(dequant, offset, stride):
    """A cache view whose base or page stride the Gluon scorer cannot read ("mma", "wgflat":
    16-byte cp.async, which failed to compile on such a base; "wgmma": int64 loads, a misaligned
    address fault) is refused by name before any launch, nothing written (SPEC 10). Host
    checks only: runs without a GPU."""
    nb, w, q_len, heads = 2, 20, 1, 1
    backing = torch.zeros(nb * stride + 64, dtype=torch.uint8)
    base = backing[offset:]
    cache = base.as_strided((nb, 128, 72), (stride, 72, 1))
    assert (cache.data_ptr() % 16 != 0) == (offset % 16 != 0)
    bt = torch.zeros((1, w), dtype=torch.int32)
    sl = torch.tensor([w * 128], dtype=torch.int32)
    q = random_q(q_len, heads, seed=1, device="cpu")
    scores = torch.full((w * 16,), float("nan"))
    big, out = poisoned_out(q_len, heads, device="cpu")
    plan = plan_decode(heads, 1, w, q_len, DecodeConfig(dequant=dequant, num_splits=1,
                                                        dot="fp16"),
                       capability=(9, 0), num_sms=132)
    with pytest.raises(ValueError, match=r"cache: .*aligned base and page stride"):
        PS.PageScoreLaunch(plan)(q, cache, bt, sl, out, scores, num_blocks=nb)
    assert_guards(big)
    assert bool((out == OUT_POISON).all()) and bool(scores.isnan().all())


_SPECIALIZATION = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import create_function_from_signature
from nvfp4_indexer.reference.paging import new_index_cache
from nvfp4_indexer.triton.decode import mma, wgflat, wgmma
from nvfp4_indexer.triton.decode.dispatch import MMA_STAGES, WGFLAT_STAGES
mma_score_kernel = mma.mma_score_kernel
wgflat_score_kernel = wgflat.wgflat_score_kernel
wgmma_score_kernel = wgmma.wgmma_score_kernel
backend = CUDABackend(GPUTarget("cuda", 90, 32))
for name, fn in (("mma", mma_score_kernel), ("wgflat", wgflat_score_kernel),
                 ("wgmma", wgmma_score_kernel)):
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    if name == "mma":
        cl, mma_l, ql, scl = mma.layouts(32)
        consts = dict(BB=32, CL=cl, MMA=mma_l, QL=ql, SCL=scl, STAGES=MMA_STAGES)
        flat = (16, 1584)  # num_reqs, num_programs
    elif name == "wgflat":
        cl, mma_l, ql, scl, b_sl = wgflat.layouts(32)
        consts = dict(BB=32, CL=cl, MMA=mma_l, QL=ql, SCL=scl, B_SL=b_sl, STAGES=WGFLAT_STAGES)
        flat = (16, 528)
    else:
        cl, mma_l, ql, b_sl = wgmma.layouts(32)
        consts = dict(NUM_SPLITS=8, CL=cl, MMA=mma_l, QL=ql, B_SL=b_sl)
        flat = ()

    def key(cache, b, w, bt_cols, q_heads):
        # the arguments PageScoreLaunch passes (q may be a head slice of a wider tensor)
        q = torch.zeros((b * 8, q_heads, 128), dtype=torch.uint8)[:, :4]
        bt = torch.zeros((b, bt_cols), dtype=torch.int32)[:, :w]
        args = (q, q.stride(0), q.stride(1), cache, cache.stride(0) // 16, cache.shape[0], bt,
                bt.stride(0), w, torch.zeros(b, dtype=torch.int32),
                torch.zeros(256, dtype=torch.int64), torch.zeros(b * 32 * w)) + flat
        return binder(*args, Q=8, H=4, N=32, **consts)[1]
    warm = key(new_index_cache(1), 16, 200, 200, 4)  # DecodeRunner._warmup's launch
    for nb, stride, cols, heads in ((5000, 9216, 200, 4), (4096, 9216 + 16, 256, 4),
                                    (97, 9216 + 48, 200, 6)):
        real = key(new_index_cache(nb, page_stride=stride), 16, 200, cols, heads)
        print(name, nb, stride, cols, heads, real == warm)
# the Gluon select / merge: warm-up buffers against views at 4-byte offsets, other widths
from nvfp4_indexer.triton.decode.redux import redux_merge_kernel, redux_select_kernel
for name, fn, consts in (("select", redux_select_kernel, dict(N=32, K=8)),
                         ("merge", redux_merge_kernel, dict(BLOCK_M=32, C=64, K=2))):
    binder = create_function_from_signature(fn.signature, fn.params, backend)

    def key(off, w, dt):
        first = torch.zeros(4096 + off, dtype=dt)[off:]  # scores (fp32) / candidates (int64)
        seq = torch.zeros(17, dtype=torch.int32)[off:off + 16]
        out = torch.zeros(16 * 32 * 16 + off, dtype=torch.int32)[off:]
        args = (first, seq, w, out) if name == "select" else (first, seq, out, w)
        return binder(*args, Q=8, H=4, ROWS=4, **consts)[1]
    dt = torch.float32 if name == "select" else torch.int64
    warm = key(0, 200, dt)
    for off, w in ((1, 200), (1, 1), (0, 256)):
        print(name, off, w, key(off, w, dt) == warm)
'''


def test_gluon_scorers_warmup_compiles_what_real_launches_run():
    """``DecodeRunner``'s warmup (a 1-block cache, contiguous q and block table) must compile
    the variant real launches run, or the first real run compiles and loads a kernel, inside
    CUDA-graph capture if that run is captured (SPEC 6: run is capturable). Triton keys a
    compile on int values (1 is a constant, multiples of 16 a divisibility): the Gluon
    scorers take no value specialization of their ints (block count, page stride, strides,
    width), and the Gluon select / merge none of the width nor of pointer alignment (views
    of seq_lens / out at 4-byte offsets). Checked on the JIT's own binder, offline."""
    lines = offline_lines(_SPECIALIZATION)
    assert len(lines) == 15 and all(ln.endswith(" True") for ln in lines), lines


@pytest.mark.gpu
@pytest.mark.parametrize("dequant", ["mma", "wgflat", "wgmma"])
def test_gpu_page_score_first_run_captured(dequant):
    """The Gluon scorers' first real run may be the captured one (the runner's warmup
    compiled it): a padded page stride and many blocks, no eager run before capture."""
    if dequant not in FAST_MODES:
        pytest.skip(f"{dequant!r} is not available on this GPU (mma: SM89+, wgflat and "
                    f"wgmma: SM90)")
    q_len, heads = 4, 4
    lens = [30_000, 0, 3_000, 17_000]
    batch = Batch(lens, seed=41, spare=40)  # PAD_STRIDE pages
    b = len(lens)
    q = random_q(b * q_len, heads, seed=7)
    runner = DECODE.DecodeRunner(heads, b, batch.width, q_len, DEV,
                                 config=DECODE.DecodeConfig(dequant=dequant))
    big, out = poisoned_out(b * q_len, heads)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runner.run(q, batch.cache, batch.block_table, batch.seq_lens, out)
    graph.replay()
    torch.cuda.synchronize()
    assert_guards(big)
    decode_check(batch, q, q_len, out, runner.error_bits)
