"""Triton scoring and top-k kernels vs the reference (SPEC 4-7, 9).

Kernels: ``page_scores``, the page operands, the top-k device functions, and every dot mode
through decode and prefill on a GPU (the decode and prefill kernels' own tests:
``tests/triton/decode``, ``tests/triton/prefill``). The harness (batches, checks, the
interpreter switch): ``kernel_harness``. Under the interpreter the scorers use an IEEE fp32 dot
of exactly decoded E4M3 values; on a GPU the default fp16 MMA (and the bf16, fp8 and fp32
comparison modes) run in the ``gpu`` tests.

Checks (SPEC 9): output structure bit-exact (local slot, -1 padding, ascending when L <= 15,
padding rows, no duplicates, ids in [0, L)); scores tie-aware against the exact reference
scores with e = 2^-b * max_t sum_d |q_d K_d| (b = ``SCORE_ERROR_BITS`` of the dot mode); NaN
pages exactly (below every number, by id among themselves); exact ties (two logical pages on
one physical block) by smaller id; and, where the scores are identical by construction, the
selection bit-exact (decode == reference ``select_pages`` of the kernel's own page scores).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_harness import (  # noqa: F401  (sets TRITON_INTERPRET before the kernels)
    BITS, DECODE, DEV, EMPTY, HAS_CUDA, PAD_STRIDE, PREFILL, SCORES, Batch, assert_guards,
    cache_storage, cache_to_device, check_scores, check_selection, decode_qsl, empty_topk,
    load_candidates, local_pages, nvfp4_page_operands, pack_candidate, poisoned_out,
    prefill_batch, random_q, realistic_lens, store_candidates, topk_insert, write_selection)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import nvfp4_indexer as ni  # noqa: E402
from nvfp4_indexer import reference as ref  # noqa: E402
from nvfp4_indexer.triton.prefill.dispatch import TOKENS_ON_N_DOTS  # noqa: E402

from nvfp4_indexer.conformance.fixtures import selection_out  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


# ----------------------------------------------------------------------- top-k device functions

@triton.jit
def _select_kernel(scores_ptr, local_ptr, cand_ptr, out_ptr, C: tl.constexpr, R: tl.constexpr,
                   NS: tl.constexpr, NS_PAD: tl.constexpr):
    """Per row: NS splits of the C columns, each a running top-16, stored, merged, written."""
    rows = tl.arange(0, R)
    local = tl.load(local_ptr + rows)
    per = tl.cdiv(C, NS)
    for s in tl.static_range(NS):
        top = empty_topk(R)
        for c in range(s * per, tl.minimum(s * per + per, C)):
            score = tl.load(scores_ptr + rows * C + c)
            cand = pack_candidate(score, c + tl.zeros([R], tl.int32))
            top = topk_insert(top, tl.where(c < local, cand, EMPTY))
        store_candidates(cand_ptr, rows.to(tl.int64), top, s, NS)
    tl.debug_barrier()
    keys = load_candidates(cand_ptr, rows.to(tl.int64), rows < R, NS, NS_PAD)
    write_selection(keys, tl.maximum(local, 0), out_ptr + rows * 16, rows < R)


@pytest.mark.parametrize("seed,num_splits", [(0, 1), (1, 3), (2, 4)])
def test_topk_selection_bit_exact(seed, num_splits):
    """Selection given identical scores is bit-exact (SPEC 5, 9): heavy ties, -0.0 vs +0.0,
    +-inf, NaN pages, every L from padding to W."""
    g = torch.Generator().manual_seed(seed)
    r, c = 32, 40
    palette = torch.tensor([-2.0, -0.0, 0.0, 1.0, 1.5, 1e30, -1e-30, math.inf, -math.inf,
                            math.nan, 3.0, 3.0000002])
    scores = palette[torch.randint(0, len(palette), (r, c), generator=g)]
    scores[:4] = torch.randn((4, c), generator=g)  # some rows without ties
    scores[4] = math.nan
    local = torch.randint(-1, c + 1, (r,), generator=g, dtype=torch.int32)
    local[:8] = torch.tensor([-1, 0, 1, 15, 16, 17, c, c - 1], dtype=torch.int32)
    cand = torch.empty(r * num_splits * 16, dtype=torch.int64)
    big, out = poisoned_out(r, 1, "cpu")
    if HAS_CUDA:
        scores, local, cand, big = scores.cuda(), local.cuda(), cand.cuda(), big.cuda()
        out = big[1:r + 1]
    _select_kernel[(1,)](scores, local, cand, out, C=c, R=r, NS=num_splits,
                         NS_PAD=triton.next_power_of_2(num_splits))
    want = ref.select_pages(scores.cpu()[:, None, :], local.cpu().long())
    assert torch.equal(out.cpu(), want)
    assert_guards(big)


# ---------------------------------------------------------------- in-register page dequantization

@triton.jit
def _page_operands_kernel(cache_ptr, page_stride, blocks_ptr, out_ptr, DOT: tl.constexpr):
    """The scorers' dequantized keys of page ``blocks[pid]``, stored as fp32 [128, 128]."""
    pid = tl.program_id(0)
    block = tl.load(blocks_ptr + pid).to(tl.int64)
    k_a, k_b = nvfp4_page_operands(cache_ptr + block * page_stride, DOT)
    t = tl.arange(0, 128)[:, None]
    base = out_ptr + pid * (128 * 128) + t * 128
    if DOT == "fp32":
        tl.store(base + tl.arange(0, 128)[None, :], k_a)
    else:
        i = tl.arange(0, 64)[None, :]
        tl.store(base + 2 * i, k_a.to(tl.float32))
        tl.store(base + 2 * i + 1, k_b.to(tl.float32))


@pytest.mark.parametrize("dot", ["fp32"] if not HAS_CUDA else ["fp16", "bf16", "fp8", "fp32"])
def test_page_operands_bit_exact(dot):
    """What the scorers multiply is dequant_e4m3 (SPEC 1.4), bit for bit, for all 16 x 256
    (code, scale byte) pairs in both nibbles (NaN and negative scales included)."""
    cache = ref.new_index_cache(3, device="cpu", page_stride=PAD_STRIDE)
    raw = cache_storage(cache).view(3, PAD_STRIDE)
    raw[:, 9216:] = 0xFF
    group = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)
    raw[0, :8192] = group.repeat(1024)  # low nibbles even codes, high nibbles odd codes
    raw[2, :8192] = ((group << 4) | (group >> 4)).repeat(1024)  # and the other way round
    scales = torch.arange(1024) % 256
    raw[0, 8192:9216] = scales.to(torch.uint8)
    raw[2, 8192:9216] = ((scales * 37 + 11) % 256).to(torch.uint8)
    raw[1, :9216] = 0xAB  # never read
    blocks = torch.tensor([2, 0], dtype=torch.int32)
    want = ref.decode_e4m3(ref.dequantize_nvfp4(*ref.read_blocks(cache, blocks.long())))
    cache = cache if DEV == "cpu" else cache_to_device(cache)
    blocks = blocks.to(DEV)
    got = torch.full((2, 128, 128), -7.0, device=DEV)
    _page_operands_kernel[(2,)](cache, cache.stride(0), blocks, got, DOT=dot)
    got = got.cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    keep = ~torch.isnan(want)
    assert torch.equal(got[keep].view(torch.int32), want[keep].view(torch.int32))


# ---------------------------------------------------------------------------------- page scores

def test_page_scores_matches_reference():
    # Mixed layout: a decode padding request with rows, a request with no rows, prefill rows.
    batch = Batch([0, 2100, 300, 2180], seed=61)
    qsl = torch.tensor([0, 2, 5, 5, 9], dtype=torch.int32, device=DEV)
    q = random_q(9, 2, seed=8)
    got = ni.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                         backend="triton")
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    assert got.shape == exact.shape and got.dtype == torch.float32
    check_scores(got, exact, mag, BITS)


# ------------------------------------------------------------------------------ GPU (realistic)


@pytest.mark.gpu
@pytest.mark.parametrize("dot", ["fp16", "bf16", "fp8", "fp32"])
def test_gpu_dot_modes(dot):
    """Every dot mode on the GPU: observed score error within SCORE_ERROR_BITS; decode and
    prefill selections valid under that bound. Prints the observed worst error in bits."""
    bits = DECODE.SCORE_ERROR_BITS[dot]
    b, q_len, heads = 8, 8, 4
    batch = Batch(realistic_lens(b, 50000, q_len, seed=91), seed=91)
    q = random_q(b * q_len, heads, seed=92)
    qsl = decode_qsl(b, q_len)
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    got = SCORES.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl, dot=dot)
    observed = check_scores(got, exact, mag, bits)
    print(f"\n{dot}: bound 2^-{bits}, observed worst error 2^-{observed:.2f} x magnitude")
    out = selection_out(b * q_len, heads, device=DEV)
    runner = DECODE.DecodeRunner(heads, b, batch.width, q_len, DEV,
                                 config=DECODE.DecodeConfig(dot=dot))
    runner.run(q, batch.cache, batch.block_table, batch.seq_lens, out)
    n_tol = check_selection(out, exact, mag, local_pages(batch.seq_lens, qsl), bits)
    print(f"{dot}: decode rows that needed the tolerance: {n_tol}")
    pb, pqsl = prefill_batch([(300, 20000), (64, 5000)], seed=93)
    pq = random_q(364, heads, seed=94)
    pe, pm = ref.page_scores(pq, pb.cache, pb.block_table, pb.seq_lens, pqsl,
                             with_magnitude=True)
    for on_n in (None, dot not in TOKENS_ON_N_DOTS) if dot != "fp32" else (None,):
        pout = selection_out(364, heads, device=DEV)
        PREFILL.prefill_indexer(pq, pb.cache, pb.block_table, pqsl, pb.seq_lens, 10**6, pout,
                                config=PREFILL.PrefillConfig(dot=dot, tokens_on_n=on_n))
        check_selection(pout, pe, pm, local_pages(pb.seq_lens, pqsl), bits)


@pytest.mark.gpu
def test_gpu_page_scores_realistic():
    batch = Batch([70000, 0, 5000, 129], seed=101)
    qsl = torch.tensor([0, 8, 9, 200, 204], dtype=torch.int32, device=DEV)
    q = random_q(204, 4, seed=102)
    got = ni.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl)
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    check_scores(got, exact, mag, BITS)

