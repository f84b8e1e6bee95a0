"""Hardening (SPEC 10, 11): block ids and page counts the kernels may never read past, the
wrapper's cache bound check by default, its score buffer checked at construction, numpy
integers on every backend, offsets errors naming the offsets, meta tensors; aliasing (outputs
overlapping inputs, plan() metadata that is a view of the wrapper's own buffers) and the
norm eps rounded to fp32 (SPEC 3).

Triton runs on CUDA tensors, or on CPU tensors under the interpreter (conftest); sizes are
small: W = 20 pages gives 19 history pages, so the kernels score pages (> 15).
"""

import numpy as np
import pytest
import torch

import nvfp4_indexer as ni
from nvfp4_indexer.triton.decode import runner as TD
from nvfp4_indexer.triton.prefill import gather as TG
from nvfp4_indexer.triton import scores as TS
from nvfp4_indexer.triton import device as DV  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", "triton"]
W = 20  # block-table width (pages)
NB = 48  # cache blocks the caller sees
POISON = 0x5A


def _parent_cache(seed=0):
    """A 64-block cache of random keys whose first ``NB`` blocks are the caller's cache; the
    16 blocks past it hold keys that outscore every real page (a kernel reading them would
    rank them first)."""
    g = torch.Generator().manual_seed(seed)
    parent = ni.new_index_cache(64, device=DEV)
    k = torch.randn(64 * 128, 128, generator=g)
    k[NB * 128:] = 40.0  # every dim large and positive: huge q . k for the query below
    ni.write_index_k(parent, k.to(DEV), torch.arange(64 * 128, device=DEV), backend="reference")
    return parent, parent[:NB]


def _batch(seed=0, q_len=1, h=2):
    g = torch.Generator().manual_seed(seed)
    bt = torch.randperm(NB, generator=g)[:W].to(torch.int32)[None].to(DEV)
    seq = torch.tensor([W * 128], dtype=torch.int32, device=DEV)
    q = (torch.rand(q_len, h, 128, generator=g) + 0.5).to(torch.float8_e4m3fn).to(DEV)
    return bt, seq, q


def _wrapper(bt, seq, h, backend, **kw):
    return ni.DecodeIndexerWrapper(h, block_table_buffer=bt.clone(), seq_lens_buffer=seq.clone(),
                                   backend=backend, use_cuda_graph=False, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_checks_block_ids_against_the_cache_by_default(backend):
    """Block id 60 in a 48-block cache: plan() raises once the wrapper knows the cache's
    block count, from the constructor or from an earlier run() (before: unchecked)."""
    parent, cache = _parent_cache()
    bt, seq, q = _batch()
    bad = bt.clone()
    bad[0, 3] = 60
    w = _wrapper(bt, seq, 2, backend, num_blocks=NB)
    with pytest.raises(ValueError, match=r"block_table: expected block ids in \[0, 48\)"):
        w.plan(bad, seq, 1)
    assert torch.equal(w.block_table, bt) and w.query_len is None  # nothing copied
    w2 = _wrapper(bt, seq, 2, backend)  # learns the count from the cache of its first run
    w2.plan(bt, seq, 1)
    out = torch.full((1, 2, 16), POISON, dtype=torch.int32, device=DEV)
    w2.run(q, cache, out)
    assert torch.equal(out, ni.decode_indexer(q, cache, bt, seq, 1, backend="reference"))
    with pytest.raises(ValueError, match="block_table"):
        w2.plan(bad, seq, 1)
    with pytest.raises(ValueError, match="cache: expected at least 48 blocks"):
        w2.run(q, cache[:40], out)  # smaller than what plan() checked against
    for nb in (-1, 2.0, True):
        with pytest.raises(ValueError, match="num_blocks"):
            _wrapper(bt, seq, 2, backend, num_blocks=nb)


def test_triton_run_never_reads_block_ids_outside_the_cache():
    """Block ids edited after plan() to 60 (past the 48-block cache) and -5: the kernel reads
    blocks clamped into the cache (47, 0), never the outscoring blocks behind the view."""
    parent, cache = _parent_cache()
    bt, seq, q = _batch()
    w = _wrapper(bt, seq, 2, "triton")
    w.plan(bt, seq, 1, num_blocks=NB)
    w.block_table[0, 3] = 60
    w.block_table[0, 5] = -5
    out = torch.full((1, 2, 16), POISON, dtype=torch.int32, device=DEV)
    w.run(q, cache, out)
    clamped = bt.clone()
    clamped[0, 3], clamped[0, 5] = NB - 1, 0
    want = ni.decode_indexer(q, cache, clamped, seq, 1, backend="reference")
    assert torch.equal(out, want)
    # the read past the cache would have ranked page 3 first
    reads_past = ni.decode_indexer(q, parent, torch.where(clamped == NB - 1, 60, clamped)
                                   .to(torch.int32), seq, 1, backend="reference")
    assert int(reads_past[0, 0, 0]) == 3 and not torch.equal(out, reads_past)


def test_reference_run_with_edited_block_ids_raises_a_clear_error():
    """The reference run() syncs anyway: block ids outside the cache give a ValueError naming
    the buffer (before: a bare IndexError)."""
    _, cache = _parent_cache()
    bt, seq, q = _batch()
    w = _wrapper(bt, seq, 2, "reference")
    w.plan(bt, seq, 1)
    w.block_table[0, 3] = 60
    out = torch.full((1, 2, 16), POISON, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"block_table_buffer: expected block ids in \[0, 48\)"):
        w.run(q, cache, out)
    assert bool((out == POISON).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len", [1, 3])
def test_seq_lens_edited_past_the_table_width_give_in_range_pages(backend, q_len):
    """seq_lens edited after plan() to 5000 > W * 128 = 2560: the run reads only the block-table
    row (seq_len clamped to the width): pages as for seq_len 2560, no -1 among the 15 history
    slots, no page id >= W (before: Triton wrote -1 and ids >= W, the reference page 39)."""
    _, cache = _parent_cache(1)
    bt, seq, q = _batch(1, q_len=q_len)
    w = _wrapper(bt, seq, 2, backend)
    w.plan(bt, torch.full_like(seq, 1000), q_len)
    w.seq_lens.fill_(5000)
    out = torch.full((q_len, 2, 16), POISON, dtype=torch.int32, device=DEV)
    w.run(q, cache, out)
    assert int(out.min()) >= 0 and int(out.max()) < W
    assert bool((out[..., 15] == W - 1).all())
    assert torch.equal(out, ni.decode_indexer(q, cache, bt, seq, q_len, backend="reference"))


@pytest.mark.parametrize("page_scores", [False, True])
@pytest.mark.parametrize("bad", [-2 ** 31, -2 ** 31 + 2, -1])
def test_negative_device_seq_lens_give_padding_rows(page_scores, bad):
    """A negative device seq_len (INT32_MIN included, where ``seq_len - 1`` and
    ``seq_len - Q + i`` would wrap to huge positions) is a padding request on both Triton
    decode paths (the one-launch kernel; the page-score path: "mma" on an SM89+ GPU, its
    "lut" twin elsewhere): rows ``[0, -1 x 15]``, nothing read outside the block-table row or
    the score scratch (SPEC 10; before: the wrapped page counts ran off the row)."""
    _, cache = _parent_cache(2)
    q_len, b = 3, 1
    bt, seq, q = _batch(2, q_len=q_len)
    dequant = None
    if page_scores:
        dequant = "mma" if DV.mma_available(DEV) else "lut"
    cfg = TD.DecodeConfig(dequant=dequant, dot=None if DEV == "cuda" else "fp32")
    runner = TD.DecodeRunner(2, b, W, q_len, DEV, config=cfg)
    out = torch.full((q_len, 2, 16), POISON, dtype=torch.int32, device=DEV)
    runner.run(q, cache, bt, torch.full_like(seq, bad), out)
    want = torch.full_like(out, -1)
    want[..., 0] = 0
    assert torch.equal(out, want)


def test_gather_kernel_clamps_pages_to_the_width_and_blocks_to_the_cache():
    """``gather_into`` given seq_lens past the table width and a block id past the cache:
    only the row's W pages are written, each from a block inside the cache."""
    parent, cache = _parent_cache(2)
    bt = torch.tensor([[5, 60, 7], [9, 10, 11]], dtype=torch.int32, device=DEV)
    seq = torch.tensor([5000, 300], dtype=torch.int32, device=DEV)  # 39 and 2 pages
    ws = torch.full((10, 128, 128), POISON, dtype=torch.uint8, device=DEV)
    offsets = torch.tensor([0, 5], dtype=torch.int32, device=DEV)
    TG.gather_into(cache, bt, seq, offsets, ws.view(torch.float8_e4m3fn), max_pages=39)
    ok_bt = torch.tensor([[5, NB - 1, 7, 0], [9, 10, 11, 0]], dtype=torch.int32, device=DEV)
    want, _ = ni.gather_index_k_fp8(cache, ok_bt, torch.tensor([385, 257], dtype=torch.int32,
                                                               device=DEV), backend="reference")
    assert torch.equal(ws[:3], want[:3].view(torch.uint8))  # request 0: W = 3 pages, clamped
    assert bool((ws[3:5] == POISON).all())  # nothing past the row's width
    assert torch.equal(ws[5:7], want[3:5].view(torch.uint8))
    assert bool((ws[7:] == POISON).all())


def test_page_scores_kernel_stays_inside_the_row_and_the_cache():
    """The page-scores launcher with request 0's seq_len past its table width and a block id
    past the cache: request 1's rows keep -inf past their history (before: request 0's rows
    spilled into them) and every score comes from a block inside the cache."""
    parent, cache = _parent_cache(3)
    g = torch.Generator().manual_seed(3)
    bt = torch.randperm(NB, generator=g)[:8].view(2, 4).to(torch.int32).to(DEV)
    bt[0, 1] = 60
    q = (torch.rand(2, 2, 128, generator=g) + 0.5).to(torch.float8_e4m3fn).to(DEV)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
    got = TS.page_scores(q, cache, bt, torch.tensor([5000, 300], dtype=torch.int32,
                                                    device=DEV), qsl)
    ok_bt = bt.clone()
    ok_bt[0, 1] = NB - 1
    ref = ni.page_scores(q, cache, ok_bt, torch.tensor([512, 300], dtype=torch.int32,
                                                       device=DEV), qsl, backend="reference")
    assert torch.equal(got[1], ref[1])  # request 1: pages 0, 1, then -inf
    assert torch.isfinite(got[0]).all()  # request 0: its W = 4 pages, block 60 read as 47
    assert torch.allclose(got[0, :, :3], ref[0, :, :3], rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_score_buffer_checked_at_construction(backend):
    """A bad ``score_buffer`` is refused by the constructor on both backends (before: ignored
    by the reference, checked at the first plan() by Triton)."""
    bt = torch.zeros(1, 64, dtype=torch.int32, device=DEV)
    seq = torch.zeros(1, dtype=torch.int32, device=DEV)
    need = min(TD.score_buffer_size(1, 64, 2, q, num_sms=DV.num_sms(torch.device(DEV)))
               for q in range(1, 9))
    assert need > 10
    for bad in ("junk", torch.zeros(need, dtype=torch.float16, device=DEV),
                torch.empty(10, device=DEV), torch.zeros(2, need, device=DEV),
                torch.zeros(2 * need, device=DEV)[::2], torch.zeros(need + 1, device=DEV)[1:]):
        with pytest.raises((ValueError, TypeError), match="score_buffer"):
            _wrapper(bt, seq, 2, backend, score_buffer=bad)
    enough = max(TD.score_buffer_size(1, 64, 2, q, num_sms=DV.num_sms(torch.device(DEV)))
                 for q in range(1, 9))
    w = _wrapper(bt, seq, 2, backend, score_buffer=torch.zeros(enough, device=DEV))
    w.plan(bt, seq, 1)


def test_numpy_integers_accepted_bools_refused_on_triton():
    """SPEC 11: numpy integers wherever ints are taken, on every backend (before: the Triton
    launchers refused them or died in the interpreter); bools never."""
    _, cache = _parent_cache(4)
    bt, seq, q = _batch(4, q_len=2)
    want = ni.decode_indexer(q, cache, bt, seq, 2, backend="reference")
    assert torch.equal(ni.decode_indexer(q, cache, bt, seq, np.int64(2), backend="triton"),
                       want)
    w = _wrapper(bt, seq, np.int64(2), "triton", num_blocks=np.int32(NB))
    w.plan(bt, seq, np.int32(2))
    out = torch.full((2, 2, 16), POISON, dtype=torch.int32, device=DEV)
    assert torch.equal(w.run(q, cache, out), want)
    assert torch.equal(TD.DecodeRunner(np.int64(2), np.int64(1), np.int64(W), np.int64(2),
                                       DEV, config=TD.DecodeConfig(num_splits=np.int64(4)),
                                       warmup=False)
                       .run(q, cache, bt, seq, out.fill_(POISON)), want)
    x = torch.randn(3, 2, 128)
    pos = torch.arange(3)
    cs = torch.randn(8, 64)
    wq = torch.zeros(128)
    ref_q = ni.prepare_index_q(x.to(DEV), pos.to(DEV), wq.to(DEV), cs.to(DEV), backend="triton")
    got = ni.prepare_index_q(x.to(DEV), pos.to(DEV), wq.to(DEV), cs.to(DEV),
                             rotary_dim=np.int64(64), eps=np.float32(1e-6), backend="triton")
    assert torch.equal(got.view(torch.uint8), ref_q.view(torch.uint8))
    c1 = ni.new_index_cache(np.int64(2), device=DEV)
    c2 = ni.new_index_cache(2, device=DEV)
    ni.insert_index_k(c1, x[:, 0].to(DEV), pos.to(DEV), pos.to(DEV), wq.to(DEV), cs.to(DEV),
                      rotary_dim=np.int64(64), backend="triton")
    ni.insert_index_k(c2, x[:, 0].to(DEV), pos.to(DEV), pos.to(DEV), wq.to(DEV), cs.to(DEV),
                      backend="triton")
    assert torch.equal(c1, c2)
    assert ni.max_gather_pages(np.int64(4096), np.int32(8)) == 32
    for bad in (True, np.bool_(True)):
        with pytest.raises(ValueError, match="query_len"):
            ni.decode_indexer(q, cache, bt, seq, bad, backend="triton")
        with pytest.raises(ValueError, match="num_heads"):
            _wrapper(bt, seq, bad, "triton")
        with pytest.raises(ValueError, match="rotary_dim"):
            ni.prepare_index_q(x, pos, wq, cs, rotary_dim=bad)
        with pytest.raises(ValueError, match="num_heads"):
            TD.DecodeRunner(bad, 1, W, 1, DEV, warmup=False)


def test_meta_tensors_are_refused_naming_the_argument():
    """Meta tensors have no data: refused with the argument's name (before: write_index_k
    died inside torch.nonzero)."""
    cache = ni.new_index_cache(2)
    meta_cache = torch.empty_like(cache, device="meta")
    k = torch.randn(3, 128)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="cache: expected a tensor with data"):
        ni.write_index_k(meta_cache, k.to("meta"), slots.to("meta"))
    with pytest.raises(ValueError, match="k: expected a tensor with data"):
        ni.write_index_k(cache, k.to("meta"), slots)
    with pytest.raises(ValueError, match="x: expected a tensor with data"):
        ni.encode_e4m3(torch.empty(4, device="meta"))


# --------------------------------------------------------------------------------- aliasing

def _two_requests(seed=5):
    """Two requests of W pages each (block table ``[2, W]``), seq lens [2300, 2560], Q = 2."""
    g = torch.Generator().manual_seed(seed)
    bt = torch.randperm(NB, generator=g)[:2 * W].view(2, W).to(torch.int32).to(DEV)
    seq = torch.tensor([2300, 2560], dtype=torch.int32, device=DEV)
    q = (torch.rand(4, 2, 128, generator=g) + 0.5).to(torch.float8_e4m3fn).to(DEV)
    return bt, seq, q


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_copies_views_of_its_own_buffers_it_is_not(backend):
    """plan() given ``seq_lens_buffer[:1].expand(2)`` (the buffer's first address, not the
    buffer) validates [2300, 2300], and run() uses that (before: the copy was skipped and
    run() used [2300, 2560]); a block table overlapping its buffer one row down is copied
    from a clone (before: torch refused the overlapping copy with a RuntimeError)."""
    _, cache = _parent_cache()
    bt, seq, q = _two_requests()
    w = _wrapper(bt, seq, 2, backend)
    w.plan(bt, seq, 2)
    w.plan(bt, w.seq_lens[:1].expand(2), 2)
    assert w.seq_lens.tolist() == [2300, 2300]
    out = torch.full((4, 2, 16), POISON, dtype=torch.int32, device=DEV)
    w.run(q, cache, out)
    same = torch.tensor([2300, 2300], dtype=torch.int32, device=DEV)
    assert torch.equal(out, ni.decode_indexer(q, cache, bt, same, 2, backend="reference"))
    wide = torch.cat([bt.view(-1), bt[0]])  # rows bt[0], bt[1], bt[0]
    w2 = ni.DecodeIndexerWrapper(2, block_table_buffer=wide[:2 * W].view(2, W),
                                 seq_lens_buffer=seq.clone(), backend=backend,
                                 use_cuda_graph=False)
    shifted = wide[W:].view(2, W)  # rows (bt[1], bt[0]), overlapping the buffer's row 1
    w2.plan(shifted, seq, 2)
    swapped = bt.flip(0).contiguous()
    assert torch.equal(w2.block_table, swapped)
    out.fill_(POISON)
    w2.run(q, cache, out)
    assert torch.equal(out, ni.decode_indexer(q, cache, swapped, seq, 2, backend="reference"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_overlapping_inputs_are_refused_before_writing(backend):
    """SPEC 10: ``out`` whose memory overlaps an input is refused on every op with an
    ``out=`` (before: decode_indexer with ``seq_lens=out.view(-1)[:2]`` gave 68 wrong
    elements on Triton), nothing written."""
    _, cache = _parent_cache()
    bt, seq, q = _two_requests()
    out = torch.full((4, 2, 16), POISON, dtype=torch.int32, device=DEV)
    out.view(-1)[:2] = seq
    snap = out.clone()
    with pytest.raises(ValueError, match="out: expected memory that overlaps no input .* "
                       "seq_lens"):
        ni.decode_indexer(q, cache, bt, out.view(-1)[:2], 2, out=out, backend=backend)
    assert torch.equal(out, snap)
    # index_q and out in one buffer: index_q's bytes cover out's
    both = torch.full((2 * 4 * 2 * 16,), 0x3A3A3A3A, dtype=torch.int32, device=DEV)
    q_view = both.view(torch.float8_e4m3fn).view(4, 2, 128)
    out_view = both[:4 * 2 * 16].view(4, 2, 16)
    snap = both.clone()
    with pytest.raises(ValueError, match="out: .*index_q"):
        ni.decode_indexer(q_view, cache, bt, seq, 2, out=out_view, backend=backend)
    # prefill: cu_seqlens_q inside out
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEV)
    out.view(-1)[-3:] = cu
    with pytest.raises(ValueError, match="out: .*cu_seqlens_q"):
        ni.prefill_indexer(q, cache, bt, out.view(-1)[-3:], seq, out=out, backend=backend)
    with pytest.raises(ValueError, match="out: .*index_q"):
        ni.prefill_indexer(q_view, cache, bt, cu, seq, out=out_view, backend=backend)
    assert torch.equal(both, snap)
    # the wrapper: out over its seq_lens buffer
    out.fill_(POISON)
    w = ni.DecodeIndexerWrapper(2, block_table_buffer=bt.clone(),
                                seq_lens_buffer=out.view(-1)[:2], backend=backend,
                                use_cuda_graph=False)
    w.plan(bt, seq, 2)
    snap = out.clone()
    with pytest.raises(ValueError, match="out: .*seq_lens_buffer"):
        w.run(q, cache, out)
    assert torch.equal(out, snap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_writes_overlapping_their_inputs_are_refused(backend):
    """SPEC 10: a cache write whose cache overlaps ``k``, ``slot_mapping`` or a norm input
    is refused before any byte changes."""
    cache = ni.new_index_cache(4, device=DEV)
    pages = cache.as_strided((4, 9216), (9216, 1))
    pages.fill_(POISON & 0xFF)
    k = pages[3, :2 * 128 * 4].view(torch.float32).view(2, 128)  # block 3's bytes
    k.copy_(torch.randn(2, 128))
    slots = torch.tensor([0, 1], device=DEV)
    snap = pages.clone()
    with pytest.raises(ValueError, match="cache: .*overlapping k's"):
        ni.write_index_k(cache, k, slots, backend=backend)
    pos, wt, cs = (torch.arange(2, device=DEV), torch.zeros(128, device=DEV),
                   torch.randn(4, 64, device=DEV))
    with pytest.raises(ValueError, match="cache: .*overlapping k's"):
        ni.insert_index_k(cache, k, pos, slots, wt, cs, backend=backend)
    cs_in = pages[2, :4 * 64 * 4].view(torch.float32).view(4, 64)
    snap = pages.clone()
    with pytest.raises(ValueError, match="cache: .*cos_sin_cache"):
        ni.insert_index_k(cache, k.clone(), pos, slots, wt, cs_in, backend=backend)
    assert torch.equal(pages, snap)


# ------------------------------------------------------------------------ eps (SPEC 3)

def _norm_inputs():
    """Two tokens x two heads, token 0 all zeros (its norm is rsqrt(eps) * 0)."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 2, 128, generator=g)
    q[0] = 0.0
    return (q.to(DEV), torch.arange(2, device=DEV), torch.zeros(128, device=DEV),
            torch.randn(4, 64, generator=g).to(DEV))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eps", [1e-300, 1e-46, 1e39, float("inf"), float("nan"), 0.0, -1e-6])
def test_eps_not_positive_and_finite_in_fp32_is_refused(backend, eps):
    """SPEC 3: eps is rounded to fp32 first and must be finite and > 0 after that: 1e-300 and
    1e-46 round to 0, 1e39 to inf (before: accepted; Triton encoded the all-zero row as NaN,
    0x7F, the reference as 0x00). Nothing is written to the cache."""
    q, pos, wt, cs = _norm_inputs()
    with pytest.raises(ValueError, match=r"eps: expected a real number .*fp32"):
        ni.prepare_index_q(q, pos, wt, cs, eps=eps, backend=backend)
    cache = ni.new_index_cache(1, device=DEV).fill_(POISON & 0xFF)
    with pytest.raises(ValueError, match=r"eps: expected a real number .*fp32"):
        ni.insert_index_k(cache, q[:, 0], pos, pos, wt, cs, eps=eps, backend=backend)
    assert bool((cache == (POISON & 0xFF)).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eps", [1e-40, np.float32(1e-6), 1])
def test_eps_positive_in_fp32_is_accepted(backend, eps):
    """An fp32 subnormal eps (1e-40) is > 0 once rounded: accepted, and the all-zero row
    encodes as zeros (0x00 or 0x80, SPEC 3) on both backends, never NaN (0x7F)."""
    q, pos, wt, cs = _norm_inputs()
    got = ni.prepare_index_q(q, pos, wt, cs, eps=eps, backend=backend).view(torch.uint8)
    assert bool((got[0] & 0x7F == 0).all())
    k1, k2 = ni.new_index_cache(1, device=DEV), ni.new_index_cache(1, device=DEV)
    ni.insert_index_k(k1, q[:1, 0], pos[:1], pos[:1], wt, cs, eps=eps, backend=backend)
    ni.insert_index_k(k2, q[:1, 0], pos[:1], pos[:1], wt, cs, eps=eps, backend="reference")
    assert torch.equal(k1, k2)  # the all-zero key: codes 0, scale byte 0x01
