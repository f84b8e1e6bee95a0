"""The page-score decode paths (``triton.decode_wgmma``: the Gluon "mma", "wgflat" and "wgmma"
scorers, ``triton.lut``) vs the reference (SPEC 1.4, 4-6, 9, 10).

CPU (interpreter): the lookup table and its portable twin bit for bit over all 16 codes x 256
scale bytes; the plain-Triton twin of the two-launch decode ("lut": same scratch, same select
kernel) against the exact reference, with poisoned outputs, NaN / negative-scale pages, exact
ties, and SPEC 10 clamps (block ids outside the cache, seq_lens past the table width); the
Gluon scorers compile offline for sm_90a (and "mma" for sm_100a) without spills.
GPU (SM90): the inline-PTX lookup bit for bit, and the same tests through the Gluon scorers
against the reference (tie-aware, b = 15), in CUDA-graph replays after in-place changes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_triton_scoring import (  # noqa: F401  (sets TRITON_INTERPRET before the kernels)
    DECODE,
    DEV,
    HAS_CUDA,
    Batch,
    K,
    assert_guards,
    decode_check,
    decode_lens,
    poisoned_out,
    random_q,
)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nvfp4_indexer import reference as ref  # noqa: E402
from nvfp4_indexer.triton import lut  # noqa: E402
from nvfp4_indexer.triton import device as DV  # noqa: E402
from conformance.fixtures import OUT_POISON

WG = K["decode_wgmma"]
# the page-score scorers a test runs: the Gluon kernels on a GPU that has them, else the twin
FAST_MODES = [m for m, ok in (("mma", HAS_CUDA and DV.mma_available(DEV)),
                              ("wgflat", HAS_CUDA and DV.wgmma_available(DEV)),
                              ("wgmma", HAS_CUDA and DV.wgmma_available(DEV))) if ok] or ["lut"]
FLAT_MODES = [m for m in FAST_MODES if m in ("mma", "wgflat", "lut")]  # the flat grid's

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


def _strict_equal(got_bits: torch.Tensor, want_bits: torch.Tensor) -> None:
    """fp16 bit patterns equal, NaN results compared by position only."""
    got_bits, want_bits = got_bits.cpu(), want_bits.cpu()
    nan = want_bits == 0x7E00
    gnan = ((got_bits & 0x7C00) == 0x7C00) & ((got_bits & 0x3FF) != 0)
    assert torch.equal(nan, gnan)
    assert torch.equal(got_bits[~nan], want_bits[~nan])


def test_lut_table_formula_bit_exact():
    """The table formula (magnitude byte << 7, sign = code sign xor scale sign) gives the
    reference dequant_e4m3 for every (code, scale byte) pair (SPEC 1.4), zero signs included."""
    codes, scales = lut.exhaustive_groups()
    nib = torch.stack([codes.long() & 15, codes.long() >> 4], dim=-1).reshape(-1, 16)
    got = lut.lut_dequant_f16_bits(nib, scales[:, None].expand(-1, 16))
    _strict_equal(got, lut.reference_f16_bits(codes, scales))


@triton.jit
def _portable_kernel(codes_ptr, scales_ptr, tbl_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    c = tl.load(codes_ptr + i).to(tl.int32)
    s = tl.load(scales_ptr + i).to(tl.int32)
    v = lut.lut_dequant_portable(c, s, tbl_ptr)
    tl.store(out_ptr + i, v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)


def test_lut_portable_kernel_bit_exact():
    """``lut_dequant_portable`` (the interpreter's twin of the PTX lookup) over all pairs."""
    codes, scales = lut.exhaustive_groups()
    nib = torch.stack([codes.long() & 15, codes.long() >> 4], dim=-1).reshape(-1)
    sc = scales.long().repeat_interleave(16)
    out = torch.full((nib.numel(),), -7, dtype=torch.int32, device=DEV)
    table = lut.lut_table(DEV).view(torch.uint8)
    _portable_kernel[(1,)](nib.to(torch.uint8).to(DEV), sc.to(torch.uint8).to(DEV), table, out,
                           N=nib.numel())
    _strict_equal(out.reshape(-1, 16), lut.reference_f16_bits(codes, scales))


def test_ptx_emulate_follows_ptx_semantics():
    """The host replay of ``LUT_ASM``: ``prmt`` (identity, a gather across both sources, the
    sign-replicate mode), ``lop3`` against its truth table, shifts, and a refusal of anything
    it does not model."""
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    regs = lut.ptx_emulate(
        "prmt.b32 p, $1, $2, 0x5140;\nprmt.b32 q, $1, $2, 0x8F07;\n"
        "lop3.b32 r, $1, $2, 0x0000FFFF, 0x28;\nshr.u32 s, $2, 7;\nshl.b32 u, $2, 4;\n"
        "mov.b64 {lo, hi}, $3;",
        {"$1": t(0x44332211), "$2": t(0x88776655), "$3": t(0x0123456789ABCDEF)})
    assert regs["p"].item() == 0x66225511
    assert regs["q"].item() == 0x00FF1188  # bytes 0x88 (sign set), 0x11, then their signs
    assert regs["r"].item() == (0x44332211 ^ 0x88776655) & 0xFFFF  # 0x28: (a ^ b) & c
    assert regs["s"].item() == 0x88776655 >> 7
    assert regs["u"].item() == (0x88776655 << 4) & 0xFFFFFFFF
    assert (regs["lo"].item(), regs["hi"].item()) == (0x89ABCDEF, 0x01234567)
    regs = lut.ptx_emulate(".reg .b32 a; and.b32 a, $1, 0xF0F0F0F0;\nshr.u32 c, $1, 31;",
                           {"$1": t(-1)})  # read modulo 2^32: 0xFFFFFFFF
    assert regs["a"].item() == 0xF0F0F0F0  # a statement after a declaration runs
    assert regs["c"].item() == 1  # logical shift
    for bad in ("add.u32 a, $1, 1;", "mul.hi.u32 a, $1, 2;", "and.b32 a, $1, 3, 5;", "and.b32 a, $2, 1;",
                "lop3.b32 a, 1, $1, 2, 0x28;"):
        with pytest.raises(ValueError, match="ptx_emulate"):
            lut.ptx_emulate(bad, {"$1": t(1)})


def test_lut_asm_text_bit_exact_on_host():
    """``LUT_ASM`` itself (the PTX text the scorers inline), replayed on the host, gives the
    reference dequant_e4m3 for every (code, scale byte) pair in every nibble position
    (SPEC 1.4; the GPU test runs it on the device); a one-digit change of one byte selector
    is caught."""
    codes, scales = lut.exhaustive_groups()
    _strict_equal(lut.lut_asm_emulate(codes, scales), lut.reference_f16_bits(codes, scales))
    mutant = lut.LUT_ASM.replace("0x5240", "0x5241", 1)
    regs = lut.ptx_emulate(mutant, {"$8": codes.view(torch.int64).reshape(-1),
                                    "$9": lut.lut_table()[scales.long()],
                                    "$10": scales.long()})
    got = lut._unpack_pairs(torch.stack([regs[f"${i}"] for i in range(8)], dim=1))
    with pytest.raises(AssertionError):
        _strict_equal(got, lut.reference_f16_bits(codes, scales))


def test_lut_e4m3_asm_text_bit_exact_on_host():
    """``LUT_E4M3_ASM`` (the E4M3-operand lookup of dot mode "fp8"), replayed on the host,
    gives the reference dequant_e4m3 bytes for every (code, scale byte) pair in every nibble
    position (SPEC 1.4: code 8 as 0x80, negative and NaN scale bytes included); a one-digit
    change of a sign selector or of the lop3 function is caught."""
    codes, scales = lut.exhaustive_groups()
    want = lut.reference_e4m3_bytes(codes, scales)
    nan = (want & 0x7F) == 0x7F
    assert int(nan.sum()) == 2 * 16 * 16  # scale bytes 0x7F and 0xFF: every value NaN

    def check(got):
        assert torch.equal((got & 0x7F) == 0x7F, nan)
        assert torch.equal(got[~nan], want[~nan])
    check(lut.lut_e4m3_asm_emulate(codes, scales))
    for old, new in (("0xD9C8", "0xD9C9"), ("0x78;", "0x6A;")):
        mutant = lut.LUT_E4M3_ASM.replace(old, new, 1)
        regs = lut.ptx_emulate(mutant, {"$4": codes.view(torch.int64).reshape(-1),
                                        "$5": lut.lut_table_e4m3()[scales.long()]})
        with pytest.raises(AssertionError):
            check(lut._unpack_bytes(torch.stack([regs[f"${i}"] for i in range(4)], dim=1)))


def test_lut_table_e4m3_is_signed_lut_table():
    """The "fp8" table is the fp16 one's magnitudes as E4M3 bytes with the scale's sign: row s
    byte m = sign(s) << 7 | (E4M3 magnitude of ``lut_table``'s byte), NaN rows aside."""
    t16, t8 = lut.lut_table(), lut.lut_table_e4m3()
    sh = torch.arange(8, dtype=torch.int64) * 8
    b16 = (t16[:, None] >> sh) & 0xFF  # fp16 bits 7..14 = (exp + 8) << 3 | mantissa
    b8 = (t8[:, None] >> sh) & 0xFF
    s = torch.arange(256)[:, None]
    ok = (s & 0x7F) != 0x7F
    # fp16 bits 7..14 -> E4M3: subtract the exponent bias difference (8) from the exponent
    mag = torch.where(b16 == 0, 0, b16 - (8 << 3))
    sub = b16 < (9 << 3)  # E4M3 subnormals: fp16 exponent field below 1 + 8
    fp16 = (b16 << 7).to(torch.int16).view(torch.float16).float()
    from nvfp4_indexer.reference.formats import encode_e4m3
    mag = torch.where(sub, encode_e4m3(fp16).view(torch.uint8).long(), mag)
    want = mag | ((s >> 7) << 7)
    assert torch.equal(b8[ok.expand(-1, 8)], want[ok.expand(-1, 8)])


def test_phys_dim_e4m3_is_a_permutation():
    """The E4M3 A tile's column -> dim map (``wgflat_scorer.phys_dim_e4m3``) is a permutation
    of the 128 dims, and column c of K half g' reads a dim of group 2j + g' (j = the lane's
    group pair, as the code-load layout ``CL`` gives each lane its groups 2j, 2j + 1)."""
    from nvfp4_indexer.triton.wgflat_scorer import phys_dim_e4m3
    dims = [phys_dim_e4m3(c) for c in range(128)]
    assert sorted(dims) == list(range(128))
    for c in range(128):
        assert dims[c] // 16 == 2 * ((c >> 2) & 3) + (c >> 6)


def test_phys_dim_is_a_permutation():
    assert sorted(WG.phys_dim(c) for c in range(128)) == list(range(128))


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
    parts = WG.flat_partition(counts, programs)
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
        scores = torch.full((WG.scratch_elems(b, w, rows),), float("nan"), device=DEV)
        big, out = poisoned_out(b * q_len, heads)
        WG.launch(dequant, q, batch.cache, batch.block_table, seq, out, scores,
                  num_blocks=batch.cache.shape[0], query_len=q_len, num_heads=heads,
                  rows=rows, num_splits=1, programs=programs)
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


def _select_scores(width: int, seed: int) -> torch.Tensor:
    """fp32 page scores ``[B=7, N=16, W]`` for the select kernel's residue-class rounds:
    random, coarse values (exact ties by id, across and within classes), one residue class
    j % 16 far below the rest (a class that never wins), NaN / +-0.0 / +-inf pages."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(7, 16, width, generator=g)
    s[1] = torch.randint(0, 4, (16, width), generator=g).float()  # ties everywhere
    s[2, :, 3::16] = -1e30  # a class that never wins a round
    s[3, :, ::7] = float("nan")
    s[3, :, 1::11] = -0.0
    s[3, :, 2::13] = 0.0
    s[4, :, ::5] = float("inf")
    s[4, :, 1::9] = float("-inf")
    s[4, 3] = float("nan")  # a row of NaN pages only
    s[5, :, ::3] = 1e-40  # subnormals of both signs, NaN with the sign bit set
    s[5, :, 1::3] = -1e-40
    s[5, :, 2::11] = -float("nan")
    return s


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("width", [40, 300, 2100])
def test_select_kernel_matches_reference(width, wide):
    """Both select kernels (page scores -> SPEC 5 rows; ``wide``: a row's keys in registers)
    equal the reference selection on the same scores bit for bit: first pass in one chunk and in three (1024, 1024, 51 pages),
    classes of 3 / 19 / 132 pages (one and two reload steps of 128), ties, NaN, +-0.0, +-inf,
    rows of L = 16 / 17, short rows and padding rows; nothing written outside ``out``."""
    q_len, heads, rows, b = 2, 4, 16, 7
    scores = _select_scores(width, seed=width)
    seq_lens = torch.tensor([width * 128, (width - 1) * 128 + 64, width * 128, width * 128 - 1,
                             17 * 128 + 1, 130, 0], dtype=torch.int32).clamp(max=width * 128)
    buf = torch.full((WG.scratch_elems(b, width, rows),), float("nan"))
    buf[:b * rows * width] = scores.reshape(-1)
    big, out = poisoned_out(b * q_len, heads)
    WG.select(buf.to(DEV), seq_lens.to(DEV), out, width=width, query_len=q_len,
              num_heads=heads, rows=rows, wide=wide)
    assert_guards(big)
    pos = seq_lens.long()[:, None] - q_len + torch.arange(q_len)[None, :]  # [B, Q]
    local = torch.where(pos >= 0, pos // 128, -1).reshape(-1)
    per_row = scores[:, :q_len * heads].reshape(b * q_len, heads, width)
    assert torch.equal(out.cpu(), ref.select_pages(per_row, local))


KINDS = ({"gluon": True}, {"wide": True})  # the redux test's two select kernels


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("q_len,heads", [(2, 4), (1, 1), (3, 2), (2, 1), (8, 8)])
@pytest.mark.parametrize("width", [20, 33, 40, 100, 256, 500, 1000, 1907, 2100, 8192])
@pytest.mark.parametrize("split", [False, True])
def test_gpu_redux_select_matches_wide_select(width, q_len, heads, split, monkeypatch):
    """The Gluon select (``redux_select``, K = 1..32 keys per lane, rows per program 1 / 2 /
    4 with masked rows when Q*H is not a multiple, programs whose rows mix L = 15 and 16) and
    its split form (``split``: S = 4 / 8 warps per row, slices whose lists are partly or
    wholly padding) write exactly what the plain-Triton wide
    select and the reference write: ties, NaN of both signs, +-0.0, +-inf, subnormals, a
    NaN-only row, L = 16 / 17, a program mixing L = 15 and 16 rows, short and padding rows;
    nothing outside ``out``."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs SM80+ (redux.sync)")
    if not split and width > 1024:
        pytest.skip("one warp per row: W <= 1024 (32 keys per lane)")
    monkeypatch.setattr(WG, "SELECT_REDUX_MAX_WIDTH", 0 if split else 1024)
    kernel = WG.select_launch(7, width, q_len, heads, gluon=True)[0]
    assert kernel.__name__ == ("redux_select_split_kernel" if split else "redux_select_kernel")
    rows, b = max(16, triton.next_power_of_2(q_len * heads)), 7
    scores = _select_scores(width, seed=width)
    scores = scores.repeat(1, (rows + 15) // 16, 1)[:, :rows]
    # 16 * 128 + 1 / + 2: the rows of one program mix L = 15 and L = 16 at (Q, H) = (2, 1)
    # (2 rows per program) and (3, 2) (4 rows per program)
    seq_lens = torch.tensor([width * 128, (width - 1) * 128 + 64, 16 * 128 + 2, width * 128 - 1,
                             17 * 128 + 1, 16 * 128 + 1, 0],
                            dtype=torch.int32).clamp(max=width * 128)
    buf = torch.full((WG.scratch_elems(b, width, rows),), float("nan"))
    buf[:b * rows * width] = scores.reshape(-1)
    outs = []
    for kind in KINDS:
        big, out = poisoned_out(b * q_len, heads)
        WG.select(buf.to(DEV), seq_lens.to(DEV), out, width=width, query_len=q_len,
                  num_heads=heads, rows=rows, **kind)
        assert_guards(big)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])
    pos = seq_lens.long()[:, None] - q_len + torch.arange(q_len)[None, :]  # [B, Q]
    local = torch.where(pos >= 0, pos // 128, -1).reshape(-1)
    per_row = scores[:, :q_len * heads].reshape(b * q_len, heads, width)
    assert torch.equal(outs[0], ref.select_pages(per_row, local))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("q_len,heads", [(8, 4), (1, 1), (3, 2), (8, 8)])
@pytest.mark.parametrize("splits,keep", [(2, 16), (10, 4), (249, 1), (32, 16)])
def test_gpu_redux_merge_matches_triton_merge(splits, keep, q_len, heads):
    """The Gluon merge of split candidates (``redux_merge_kernel``, C = splits * keep up to
    512 per row) writes exactly what the Triton merge kernel writes and what a sort of the
    packed keys gives: candidate lists with EMPTY slots, coarse scores (ties by id), NaN,
    +-0.0, +-inf, rows of L = 16 / 17, short and padding rows; nothing outside ``out``."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs SM80+ (redux.sync)")
    from nvfp4_indexer.reference.candidates import pack_candidates
    from nvfp4_indexer.triton.decode import _decode_merge_kernel
    from nvfp4_indexer.triton.redux_select import launch_shape, redux_merge_kernel
    c = splits * keep
    rows, b = max(16, triton.next_power_of_2(q_len * heads)), 6
    width = max(c, 40)
    g = torch.Generator().manual_seed(c + q_len)
    scores = torch.randint(-3, 4, (b * rows, c), generator=g).float()
    scores[0::3, ::5] = float("nan")
    scores[1::3, 1::7] = -0.0
    scores[1::3, 2::7] = 0.0
    scores[2::3, ::4] = float("inf")
    scores[2::3, 1::9] = float("-inf")
    ids = torch.stack([torch.randperm(width, generator=g)[:c] for _ in range(b * rows)])
    cand = pack_candidates(scores, ids)
    cand[torch.rand(b * rows, c, generator=g) < 0.1] = -(2 ** 63)  # EMPTY slots
    seq_lens = torch.tensor([width * 128, 17 * 128 + q_len - 1, 16 * 128 + q_len, 130, 0,
                             width * 128 - 1], dtype=torch.int32)
    outs = []
    for gluon in (True, False):
        big, out = poisoned_out(b * q_len, heads)
        args = (cand.to(DEV), seq_lens.to(DEV), out, width)
        if gluon:
            k, r = launch_shape(c, q_len * heads)
            redux_merge_kernel[(b, triton.cdiv(q_len * heads, r))](
                *args, Q=q_len, H=heads, BLOCK_M=rows, C=c, K=k, ROWS=r, num_warps=r)
        else:
            _decode_merge_kernel[(b, q_len * heads)](
                *args, Q=q_len, H=heads, BLOCK_M=rows, NUM_SPLITS=splits,
                SPLITS_PAD=triton.next_power_of_2(splits), ROWS=1, KEEP=keep, num_warps=1)
        assert_guards(big)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])
    pos = seq_lens.long()[:, None] - q_len + torch.arange(q_len)[None, :]
    local = torch.where(pos >= 0, pos // 128, 0).reshape(-1)
    got = outs[0].reshape(b * q_len, heads, 16)
    for r in range(b * q_len):
        for h in range(heads):
            L = int(local[r])
            if L <= 15:
                want = [j if j <= L else -1 for j in range(16)]
            else:
                row = (r // q_len) * rows + (r % q_len) * heads + h
                top = torch.sort(cand[row], descending=True).values[:15]
                want = [int(x) for x in ((top & 0xFFFFFFFF) ^ 0xFFFFFFFF).to(torch.int32)] + [L]
            assert got[r, h].tolist() == want, (r, h)


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
    q = random_q(b * q_len, heads, seed=2)
    big, out = poisoned_out(b * q_len, heads)
    cfg = DECODE.DecodeConfig(dequant=dequant, num_splits=2, dot=None if HAS_CUDA else "fp32")
    runner = DECODE.DecodeRunner(heads, b, w, q_len, DEV, config=cfg)
    runner.run(q, batch.cache, bt, seq, out)
    assert_guards(big)
    o = out.cpu()
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
    q = random_q(b * q_len, heads, seed=3)
    big, out = poisoned_out(b * q_len, heads)
    cfg = DECODE.DecodeConfig(dequant=dequant, num_splits=2, dot=None if HAS_CUDA else "fp32")
    runner = DECODE.DecodeRunner(heads, b, w, q_len, DEV, config=cfg)
    runner.run(q, batch.cache, batch.block_table, seq, out)
    assert_guards(big)
    pad = torch.tensor([0] + [-1] * 15, dtype=torch.int32)
    assert bool((out.cpu() == pad).all())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_lut_asm_bit_exact():
    """The inline-PTX lookup (the registers the wgmma scorer feeds its MMA) over all pairs."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs SM80+")
    codes, scales = lut.exhaustive_groups()
    got = lut.lut_asm_dequant(codes.to(DEV), scales.to(DEV))
    _strict_equal(got, lut.reference_f16_bits(codes, scales))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_lut_e4m3_asm_bit_exact():
    """The E4M3-operand lookup (dot mode "fp8") on the device over all pairs."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs SM80+")
    codes, scales = lut.exhaustive_groups()
    got = lut.lut_e4m3_asm_dequant(codes.to(DEV), scales.to(DEV)).cpu()
    want = lut.reference_e4m3_bytes(codes, scales)
    nan = (want & 0x7F) == 0x7F
    assert torch.equal((got & 0x7F) == 0x7F, nan)
    assert torch.equal(got[~nan], want[~nan])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
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
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
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
    scores = torch.full((WG.scratch_elems(b, w, rows),), poison, device=DEV)
    big, out = poisoned_out(b * q_len, heads)
    runner = DECODE.DecodeRunner(heads, b, w, q_len, DEV,
                                 config=DECODE.DecodeConfig(dequant=dequant, dot=dot),
                                 score_buffer=scores)
    if programs:
        runner._page_score.programs = programs
    scores.fill_(poison)  # after the runner's warmup launch
    runner.run(q, batch.cache, batch.block_table, batch.seq_lens, out)
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


_WGMMA_COMPILE = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
from benchmarks.sass_stats import wgmma_report
for line in wgmma_report():
    print(line)
'''
_MMA_COMPILE = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
from benchmarks.sass_stats import mma_report
for arch in (90, 100):
    for line in mma_report(arch):
        print(line)
'''


def _offline(script: str) -> list[str]:
    """Run an offline-compile report in a subprocess without the interpreter."""
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except ImportError:
        pytest.skip("Triton's NVIDIA backend / Gluon is not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's bundled ptxas is unavailable")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()


def test_mma_scorer_compiles_offline():
    """The warp-per-split scorer compiles for sm_90a and sm_100a (no GPU): the A-operand
    conversions are register renamings (``assert_trivial``), nothing spills at the launcher's
    cap (``MMA_MAXNREG``: 3 one-warp programs per scheduler) up to ``MMA_MAX_ROWS`` rows,
    one m16n8k16 per (16 tokens, 8 rows, 16 dims) of a page, three cp.async per chunk of 16
    tokens (2 code runs of 16 bytes, 4 scale bytes per lane) and the 4-slot ring's 4.5 KB of
    shared memory. Nothing spills in the page loop; the request loop around it may spill a
    few registers once per request (Q1 H4: 2 LDL / STL)."""
    from nvfp4_indexer.triton.heuristics import MMA_MAX_ROWS, MMA_MAXNREG
    lines = _offline(_MMA_COMPILE)
    assert len(lines) == 8, lines
    for ln in lines:
        regs = int(ln.split(": ")[1].split()[0])
        rows = int(ln.split(" N ")[1].split(":")[0])
        assert regs <= MMA_MAXNREG, ln
        if rows <= MMA_MAX_ROWS:  # 64 rows spill: the default takes "wgmma" there
            spills = int(ln.split(" B local, ")[1].split()[0])
            assert " 0 B local, " in ln and "(0 in the page loop)" in ln and spills <= 4, ln
        # 8 chunks x rows / 8 n-tiles x 8 k-steps; 3 chunks in the prologue + 8 in the loop;
        # the ring (4.5 KB) and the query's layout conversion (1 KB)
        assert f" {8 * rows} mma.sync, 33 cp.async, 5632 B shared" in ln, ln


def test_wgmma_scorer_compiles_offline_for_sm90():
    """The Gluon scorer compiles for sm_90a (no GPU): the A-operand conversions are register
    renamings (``assert_trivial``), nothing spills (no LDL / STL: "0 B local" alone cannot
    see spills), 16 wgmma per page (2 halves x 8 k-steps), and at Q*H <= 32 rows it fits 4
    CTAs of 128 threads per SM (<= 128 registers)."""
    lines = _offline(_WGMMA_COMPILE)
    assert len(lines) == 4, lines
    for ln in lines:
        regs = int(ln.split(": ")[1].split()[0])
        assert " 0 B local, 0 LDL/STL" in ln and "16 wgmma" in ln, ln
        if "N 64" not in ln:
            assert regs <= 128, ln


_WGFLAT_COMPILE = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
from benchmarks.sass_stats import wgflat_report
for line in wgflat_report():
    print(line)
'''


def test_wgflat_scorer_compiles_offline_for_sm90():
    """The page-per-warp wgmma scorer compiles for sm_90a (no GPU): the A-operand conversions
    are register renamings (``assert_trivial``), nothing spills (LDL / STL counted), at most
    128 registers (``WGFLAT_PROGRAMS_PER_SM`` = 4 programs of 4 warps fit an SM), the group
    loop (four pages, one per warp) holds its 64 HGMMA (8 chunks x 2 halves x 4 k-steps),
    33 cp.async (3 copies per chunk: 3 chunks before the loop, 8 in it) and the shared memory
    is the 4-slot ring (18 KB) plus the query (256 B per row)."""
    from nvfp4_indexer.triton.heuristics import WGFLAT_PROGRAMS_PER_SM
    lines = _offline(_WGFLAT_COMPILE)
    assert len(lines) == 3, lines
    assert WGFLAT_PROGRAMS_PER_SM * 4 * 32 * 128 <= 65536
    for ln in lines:
        regs = int(ln.split(": ")[1].split()[0])
        rows = int(ln.split(" N ")[1].split(":")[0])
        assert regs <= 128 and " 0 B local, 0 LDL/STL (0 in the group loop)" in ln, ln
        assert f"with 64 HGMMA, 64 wgmma, 33 cp.async, {18432 + 256 * rows} B shared" in ln, ln


def test_wgflat_refuses_64_rows():
    """"wgflat" is built and measured for <= 32 query rows (its default is 32): a 64-row
    runner (Q8 H8) is refused by name at construction, on any device ("wgmma" takes 64)."""
    with pytest.raises(ValueError, match="'wgflat' scores at most 32 query rows"):
        DECODE.DecodeRunner(8, 2, 40, 8, DEV, config=DECODE.DecodeConfig(dequant="wgflat"))


@pytest.mark.parametrize("dequant", ["lut", "triton"])
def test_decode_runner_refuses_an_empty_cache(dequant):
    """Block ids are clamped into the cache (SPEC 10), so an empty cache is refused by name
    before any launch (it crashed the interpreter)."""
    if HAS_CUDA:
        pytest.skip("CPU runner (interpreter)")
    runner = DECODE.DecodeRunner(1, 1, 20, 1, DEV,
                                 config=DECODE.DecodeConfig(dequant=dequant, dot="fp32"))
    q = random_q(1, 1, seed=1)
    bt = torch.zeros((1, 20), dtype=torch.int32)
    sl = torch.tensor([2500], dtype=torch.int32)
    big, out = poisoned_out(1, 1)
    with pytest.raises(ValueError, match="cache"):
        runner.run(q, ref.new_index_cache(0), bt, sl, out)
    assert_guards(big)
    assert bool((out == OUT_POISON).all())


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
    scores = torch.full((WG.scratch_elems(1, w, 16),), float("nan"))
    big, out = poisoned_out(q_len, heads, device="cpu")
    with pytest.raises(ValueError, match=r"cache: .*aligned base and page stride"):
        WG.launch(dequant, q, cache, bt, sl, out, scores, num_blocks=nb, query_len=q_len,
                  num_heads=heads, rows=16, num_splits=1)
    assert_guards(big)
    assert bool((out == OUT_POISON).all()) and bool(scores.isnan().all())


def test_choose_dequant_page_score_rule(monkeypatch):
    """The default-dequant rule of ``heuristics.choose_dequant`` on a (simulated) SM90 GPU:
    "mma" from ``MMA_MIN_PAGES`` pages B * (W - 1) and ``MMA_MIN_WIDTH`` pages W - 1 at <= 32
    rows, "wgflat" from ``WGFLAT_MIN_PAGES`` (or the explicit ``min_pages`` when larger) and
    W - 1 >= ``WGFLAT_MIN_WIDTH`` at 32 rows,
    "wgmma" from ``WGMMA_MIN_PAGES`` at 64 rows (any B), an explicit ``min_pages`` for both,
    never without rows to score (W - 1 <= 15), off SM90 or with another dot; else the
    one-launch kernel's mode."""
    from nvfp4_indexer.triton import heuristics as hz
    monkeypatch.setattr(DV, "mma_available", lambda device: True)
    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    dev = torch.device("cpu")  # default_dequant: "triton" for the fallback
    pages, w_min = hz.MMA_MIN_PAGES, hz.MMA_MIN_WIDTH + 1
    reqs = pages // (w_min - 1)

    def pick(b, w, rows, min_pages=None, dot="fp16"):
        return hz.choose_dequant(dev, dot, b, w, min_pages, rows)
    assert reqs * (w_min - 1) == pages
    assert pick(reqs, w_min, 32) == "mma" and pick(reqs, w_min, 16) == "mma"
    flat = hz.WGFLAT_MIN_PAGES // 128  # requests of W - 1 = 128 pages
    assert pick(flat, 129, 32) == "wgflat" and pick(flat, 129, 16) == "mma"  # 32 rows only
    assert pick(flat - 1, 129, 32) == "mma" and pick(flat, 129, 64) == "wgmma"
    assert pick(flat, 129, 32, min_pages=2 * hz.WGFLAT_MIN_PAGES) == "triton"
    assert pick(2 * flat, 129, 32, min_pages=2 * hz.WGFLAT_MIN_PAGES) == "wgflat"
    assert pick(reqs - 1, w_min, 32) == "triton"  # 64 pages short
    assert pick(1, pages + 1, 32) == "mma"  # one long request
    assert pick(10 * reqs, w_min - 1, 32) == "triton"  # short requests
    wide = hz.WGMMA_MIN_PAGES + 1
    assert pick(1, wide, 64) == "wgmma" and pick(1, wide - 1, 64) == "triton"
    assert pick(reqs, w_min, 64) == "triton"  # 64 rows: the wgmma threshold
    assert pick(1, w_min, 32, min_pages=0) == "mma" and pick(1, 17, 64, min_pages=0) == "wgmma"
    assert pick(reqs, w_min - 1, 32, min_pages=0) == "triton"  # W - 1 < MMA_MIN_WIDTH
    assert pick(reqs, 16, 32, min_pages=0) == "triton"  # W - 1 = 15: every row is short
    assert pick(128, 17, 32) == "mma" and pick(64, 33, 16) == "mma"  # W - 1 = 16 / 32 pages
    short = hz.WGFLAT_MIN_WIDTH  # W - 1 = WGFLAT_MIN_WIDTH - 1: "mma" however many pages
    assert pick(hz.WGFLAT_MIN_PAGES, short, 32) == "mma"
    assert pick(hz.WGFLAT_MIN_PAGES, short + 1, 32) == "wgflat"
    assert pick(reqs, w_min, 32, dot="fp32") == "triton"
    cap[0] = (10, 0)
    assert pick(reqs, w_min, 32) == "triton"  # measured on SM90 only


_SPECIALIZATION = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import create_function_from_signature
from nvfp4_indexer.reference.paging import new_index_cache
from nvfp4_indexer.triton import decode_wgmma as WG
from nvfp4_indexer.triton.heuristics import MMA_STAGES
from nvfp4_indexer.triton.mma_scorer import mma_score_kernel
from nvfp4_indexer.triton.wgflat_scorer import wgflat_score_kernel
from nvfp4_indexer.triton.wgmma_scorer import wgmma_score_kernel
backend = CUDABackend(GPUTarget("cuda", 90, 32))
for name, fn in (("mma", mma_score_kernel), ("wgflat", wgflat_score_kernel),
                 ("wgmma", wgmma_score_kernel)):
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    if name == "mma":
        cl, mma, ql, scl = WG.mma_layouts(32)
        consts = dict(BB=32, CL=cl, MMA=mma, QL=ql, SCL=scl, STAGES=MMA_STAGES)
        flat = (16, 1584)  # num_reqs, num_programs
    elif name == "wgflat":
        cl, mma, ql, scl, b_sl = WG.wgflat_layouts(32)
        consts = dict(BB=32, CL=cl, MMA=mma, QL=ql, SCL=scl, B_SL=b_sl, STAGES=4, ASYNC=1)
        flat = (16, 528)
    else:
        cl, mma, ql, b_sl = WG.gluon_layouts(32)
        consts = dict(NUM_SPLITS=8, CL=cl, MMA=mma, QL=ql, B_SL=b_sl)
        flat = ()

    def key(cache, b, w, bt_cols, q_heads):
        # the arguments decode_wgmma.launch passes (q may be a head slice of a wider tensor)
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
from nvfp4_indexer.triton.redux_select import redux_merge_kernel, redux_select_kernel
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
    lines = _offline(_SPECIALIZATION)
    assert len(lines) == 15 and all(ln.endswith(" True") for ln in lines), lines


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
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


_REDUX_COMPILE = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
from benchmarks.sass_stats import redux_select_report
for arch in (90, 100):
    for line in redux_select_report(arch):
        print(line)
'''


def _split_select_rounds(scores: torch.Tensor, local: torch.Tensor, keys_per_lane: int,
                         nan_key: int = -2 ** 31 + 1) -> torch.Tensor:
    """A torch replay of ``redux_select_split_kernel`` (GPU only), round by round, for rows
    ``scores [R, W]`` with local pages ``local [R]`` (>= 16): the kernel's slicing (page
    j = s * 32K + lane * K + k of warp s, ``split_shape``), its int32 keys (-0.0 as +0.0, NaN
    at ``nan_key``, pages j >= L at INT32_MIN), each round's per-lane max, smallest id holding
    it, warp max / min and the taken page set to INT32_MIN; phase 2 on the S kept entries per
    lane. Returns the 15 page ids ``[R, 15]``."""
    from nvfp4_indexer.reference.candidates import score_key
    from nvfp4_indexer.triton.redux_select import split_shape
    low, no_id = -2 ** 31, 2 ** 31 - 1
    r, w = scores.shape
    k, s = split_shape(w, keys_per_lane)
    ids = (torch.arange(s)[:, None, None] * 32 * k + torch.arange(32)[None, :, None] * k
           + torch.arange(k)[None, None, :]).expand(r, s, 32, k)  # [R, S, 32, K]
    ok = ids < local[:, None, None, None]
    padded = torch.cat([scores, torch.zeros(r, s * 32 * k - w)], 1)
    sc = torch.where(ok, padded.gather(1, ids.reshape(r, -1)).reshape(ids.shape), 0.0)
    key = score_key(sc).long()
    key = torch.where(torch.isnan(sc), torch.full_like(key, nan_key), key)
    key = torch.where(ok, key, torch.full_like(key, low))

    def rounds(key, ids, lane_dim, warp_dim):
        picked_key, picked_id = [], []
        for _ in range(15):
            lane_key = key.max(lane_dim, keepdim=True).values
            lane_id = torch.where(key == lane_key, ids, no_id).min(lane_dim, keepdim=True).values
            best = lane_key.max(warp_dim, keepdim=True).values
            page = torch.where(lane_key == best, lane_id, no_id).min(warp_dim, keepdim=True).values
            picked_key.append(best)
            picked_id.append(page)
            key = torch.where(ids == page, low, key)
        return torch.cat(picked_key, warp_dim), torch.cat(picked_id, warp_dim)

    top_key, top_id = rounds(key, ids, 3, 2)  # [R, S, 15, 1]: each slice's best 15
    top_key, top_id = top_key[..., 0].transpose(1, 2), top_id[..., 0].transpose(1, 2)
    return rounds(top_key, top_id, 2, 1)[1][:, :, 0].to(torch.int32)  # [R, 15]


def _split_select_rows(width: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[113, W]`` of the select test's adversarial scores (7 groups of 16: random,
    ties everywhere, a class that never wins, NaN / +-0.0, +-inf and a NaN-only row,
    subnormals and NaN of both signs) plus one row whose 16 best pages are equal and straddle
    the first slice boundary 32K; local pages: each group's first 8 rows at slice boundaries,
    the rest random, all <= W - 1 (as seq_len <= W * 128 allows)."""
    scores = _select_scores(width, seed=seed).reshape(-1, width)
    tie = torch.randn(1, width, generator=torch.Generator().manual_seed(seed))
    tie[0, 32 * k - 8:32 * k + 8] = 1e6
    scores = torch.cat([scores, tie])
    g = torch.Generator().manual_seed(seed)
    edges = [16, 17, 32 * k - 1, 32 * k, 32 * k + 1, 32 * k + 15, 32 * k + 16, width - 1]
    local = []
    for _ in range(7):
        local += edges + torch.randint(16, width, (8,), generator=g).tolist()
    local = torch.tensor([min(x, width - 1) for x in local] + [min(32 * k + 8, width - 1)])
    return scores, local


@pytest.mark.parametrize("width", [513, 938, 1025, 1907, 2049, 4096, 8192])
@pytest.mark.parametrize("keys_per_lane", [8, 16])
def test_split_select_algorithm_matches_reference(width, keys_per_lane):
    """The split select's algorithm on the CPU (its kernel is GPU only): a round-by-round
    replay of the kernel (``_split_select_rounds``) equals SPEC 5's reference selection on
    adversarial scores (ties within and across slices, NaN of both signs, +-0.0, +-inf,
    subnormals, a NaN-only row) for local pages at slice boundaries. It fails if a slice keeps
    fewer than 15, if ties go to the larger id, or if NaN pages share the key of taken pages
    (then a taken page is picked again): the second half checks that the replay is that
    strict."""
    from nvfp4_indexer.triton.redux_select import split_shape
    k, _ = split_shape(width, keys_per_lane)
    scores, local = _split_select_rows(width, k, seed=width + keys_per_lane)
    want = ref.select_pages(scores[:, None], local)[:, 0, :15]
    assert torch.equal(_split_select_rounds(scores, local, keys_per_lane), want)
    assert not torch.equal(_split_select_rounds(scores, local, keys_per_lane, -2 ** 31), want)


def test_redux_launch_shape():
    """Keys per lane and rows per program of the Gluon select / merge: K = next power of two
    >= n / 32, rows = min(4, next power of two >= Q*H); the split select: S = 4 warps per row
    up to 4 * 32 * keys_per_lane keys (the library passes 16: 2048), else 8, K = next power
    of two >= n / (32 S)."""
    from nvfp4_indexer.triton.redux_select import launch_shape, split_shape
    assert launch_shape(20, 1) == (1, 1) and launch_shape(33, 2) == (2, 2)
    assert launch_shape(128, 32) == (4, 4) and launch_shape(129, 6) == (8, 4)
    assert launch_shape(512, 64) == (16, 4) and launch_shape(249, 3) == (8, 4)
    assert split_shape(20, 8) == (1, 4) and split_shape(600, 8) == (8, 4)
    assert split_shape(1024, 8) == (8, 4) and split_shape(1025, 8) == (8, 8)
    assert split_shape(1563, 8) == (8, 8) and split_shape(2100, 8) == (16, 8)
    assert split_shape(8192, 16) == (32, 8) and split_shape(4096, 16) == (16, 8)
    assert split_shape(2048, 16) == (16, 4) and split_shape(2049, 16) == (16, 8)


def test_select_launch_rule():
    """Which select kernel a launch gets: on the Gluon paths the one-warp redux select up to
    ``SELECT_REDUX_MAX_WIDTH``, its split form above that for at most
    ``SELECT_SPLIT_MAX_ROWS`` rows (S warps, one row per program) up to
    ``SELECT_SPLIT_MAX_WIDTH``, else the Triton selects (wide for few rows, residue-class for
    many); off the Gluon paths (the interpreter, "lut") never a Gluon kernel."""
    def pick(b, w, q=8, h=4, gluon=True):
        kernel, consts, warps, per_prog = WG.select_launch(b, w, q, h, gluon=gluon)
        return kernel.__name__, consts, warps, per_prog
    assert pick(128, 512)[0] == "redux_select_kernel"
    assert pick(16, 513) == ("redux_select_split_kernel", dict(K=8, S=4, ROWS=1), 4, 1)
    assert pick(8, 1563) == ("redux_select_split_kernel", dict(K=16, S=4, ROWS=1), 4, 1)
    assert pick(16, 2049) == ("redux_select_split_kernel", dict(K=16, S=8, ROWS=1), 8, 1)
    assert pick(16, 8192)[1] == dict(K=32, S=8, ROWS=1)
    assert pick(16, 8193)[0] == "_select_kernel"  # past the split's (and wide's) width
    assert pick(32, 1000)[0] == "redux_select_split_kernel"  # 1024 rows
    assert pick(33, 1000)[0] == "_select_kernel"  # 1056 rows: the residue-class select
    assert pick(17, 1000)[0] == "redux_select_split_kernel"  # 544 rows
    assert pick(256, 1000, 1, 4)[0] == "redux_select_split_kernel"  # Q1 H4: 1024 rows
    for w in (100, 1000):
        assert pick(8, w, gluon=False)[0] == "_select_wide_kernel"
    # ``wide`` forces the Triton selects on the Gluon paths too (tests, labs)
    for w in (100, 1000):
        assert WG.select_launch(8, w, 8, 4, wide=False, gluon=True)[0].__name__ == "_select_kernel"
        assert WG.select_launch(8, w, 8, 4, wide=True, gluon=True)[0].__name__ \
            == "_select_wide_kernel"
    assert WG.SELECT_SPLIT_MAX_WIDTH <= 8 * 32 * 32  # K <= 32 keys per lane at S = 8


def test_redux_select_compiles_offline():
    """The Gluon select compiles for sm_90a and sm_100a (no GPU) at K = 1, 4, 8, 16, 32 keys
    per lane, the Gluon merge at 64 / 512 candidates per row and the split select at (K, S)
    = (8, 4), (16, 4), (16, 8), (32, 8) (W up to 8192): two warp reductions per round (30
    REDUX; the split select 60: its two sets of rounds), no spill; the select at K = 4 takes
    fewer instructions than the plain-Triton wide select at W = 128 (K = 4: 512 against 992
    on sm_90a at Triton 3.6)."""
    lines = _offline(_REDUX_COMPILE)
    assert len(lines) == 26, lines
    for arch in range(2):
        red, split = lines[13 * arch:13 * arch + 7], lines[13 * arch + 7:13 * arch + 11]
        wide = lines[13 * arch + 11]
        for ln in red:  # 5 select widths, then the merge at 64 / 512 candidates
            assert " 0 LDL/STL, " in ln and ln.endswith(" 30 REDUX"), ln
        for ln in split:
            assert "redux_select_split" in ln and " 0 LDL/STL, " in ln \
                and ln.endswith(" 60 REDUX"), ln
        count = lambda ln: int(ln.split(" SASS instructions")[0].split()[-1])  # noqa: E731
        assert count(red[1]) < count(wide), (red[1], wide)
