"""The Gluon prefill score kernel (``triton.prefill_wgmma``, SPEC 4, 5, 7, 10) and its dispatch.

CPU: which chunks take it (``heuristics.prefill_launch``'s ``kernel``; only those whose
splits keep 16 candidates, with BLOCK_M 128, on SM90 with dot fp16 and tokens on N),
``PrefillConfig.kernel`` checks, the scratch cap, ``prefill_indexer``'s Gluon branch with the
twin in the kernel's place (the Indexer's: ``tests/test_engine.py``), int64 workspace page
offsets, and an offline sm_90a compile (12 warps re-balanced by ``setmaxnreg``, no spills in
the two consumers' page loops, both pages' MMAs of an iteration in each). Its semantics
run on the CPU through the Triton twin (``prefill._prefill_score_kernel``,
``tests/test_triton_scoring.py``).
GPU (SM90): the Gluon kernel against the Triton twin row for row (poisoned outputs, NaN
pages, one and several splits, splits of 1-3 pages and empty ones, several chunks), and
against the exact
reference (tie-aware, b = 15).
"""

from __future__ import annotations

import pytest
import torch

from kernel_harness import offline_lines as _offline
from test_triton_scoring import (  # noqa: F401  (sets TRITON_INTERPRET before the kernels)
    BITS,
    DEV,
    HAS_CUDA,
    HZ,
    PREFILL,
    assert_guards,
    check_selection,
    local_pages,
    poisoned_out,
    prefill_batch,
    random_q,
)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from conformance.fixtures import OUT_POISON  # noqa: E402
from nvfp4_indexer import reference as ref  # noqa: E402
from nvfp4_indexer.triton.layout import ws_page_offset  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


def test_dispatch_rule():
    """The Gluon kernel takes exactly the chunks whose splits keep 16 candidates (> 8 pages)
    at BLOCK_M 128, when allowed; it inserts per page: window 1, no window scratch."""
    big = HZ.prefill_launch(512, 1023, 128, 132, wgmma=True)
    assert big["kernel"] == "wgmma" and big["win"] == 1 and big["win_elems"] == 0
    assert big["scratch"] == 2 * big["cand"]
    tri = HZ.prefill_launch(512, 1023, 128, 132)
    assert tri["kernel"] == "triton" and tri["win"] == 32 and tri["ns"] == 3
    # its own split target: at most 1 program per SM (one wave), at least 2, at most the
    # Triton rule's
    assert big["ns"] == 2
    assert HZ.prefill_launch(128, 1023, 128, 132, wgmma=True)["ns"] == 2  # Triton: 9
    assert HZ.prefill_launch(32, 1023, 128, 132, wgmma=True)["ns"] == 4  # 128 <= 132 programs
    assert HZ.prefill_launch(64, 1023, 128, 132, wgmma=True)["ns"] == 2
    assert HZ.prefill_launch(8, 1023, 128, 132, wgmma=True)["ns"] == 16
    for blocks in (1, 7, 32, 33, 64, 100, 128, 132, 200, 264):
        lp = HZ.prefill_launch(blocks, 1023, 128, 132, wgmma=True)
        assert lp["kernel"] == "wgmma" and lp["keep"] == 16, blocks
        assert lp["ns"] == 2 or blocks * lp["ns"] <= 132, (blocks, lp["ns"])
    assert HZ.prefill_launch(2048, 1023, 128, 132, wgmma=True)["ns"] == 1  # Triton: 1
    assert HZ.prefill_launch(512, 1023, 128, 132, num_splits=5, wgmma=True)["ns"] == 5
    assert HZ.prefill_launch(512, 1023, 64, 132, wgmma=True)["kernel"] == "triton"
    assert HZ.prefill_launch(512, 1023, 32, 132, wgmma=True)["kernel"] == "triton"
    assert HZ.prefill_launch(4, 9, 128, 132, num_splits=1, wgmma=True)["kernel"] == "wgmma"
    assert HZ.prefill_launch(4, 8, 128, 132, num_splits=1, wgmma=True)["kernel"] == "triton"
    assert HZ.prefill_launch(4, 0, 128, 132, wgmma=True)["kernel"] == "triton"  # all short
    assert HZ.prefill_launch(512, 1023, 128, 132, window=8, wgmma=True)["win"] == 1
    cpu = torch.device("cpu")
    assert not HZ.prefill_wgmma_ok(cpu, "fp16", True)
    assert not HZ.prefill_wgmma_ok(cpu, "fp8", True)
    if HAS_CUDA and torch.cuda.get_device_capability() == (9, 0):
        assert HZ.prefill_wgmma_ok(torch.device(DEV), "fp16", True)
        assert not HZ.prefill_wgmma_ok(torch.device(DEV), "fp16", False)
        assert not HZ.prefill_wgmma_ok(torch.device(DEV), "bf16", True)
        assert HZ.prefill_wgmma_ok(torch.device(DEV), "fp8", True)
        assert not HZ.prefill_wgmma_ok(torch.device(DEV), "fp8", False)


def test_dispatch_rule_short_splits(monkeypatch):
    """Chunks of few row blocks, whose Triton-rule splits are short (keep < 16), take the Gluon
    kernel with fewer splits of > 8 pages each (its own target, capped so that every split keeps
    16); ``PREFILL_WGMMA_SHORT_SPLITS`` off restores the Triton kernel there."""
    cases = {  # (row blocks, score pages): (Triton rule's splits, keep), Gluon splits
        (32, 263): ((33, 8), 4),  # 1K new tokens x 32K: 33 x 8 pages -> 4 x 66
        (8, 1025): ((132, 8), 16),  # 256 x 128K (an Indexer chunk of 1K x 128K x 4)
        (8, 257): ((65, 4), 16),  # 256 x 32K (an Indexer chunk of 1K x 32K x 4)
        (16, 60): ((15, 4), 7),  # capped: 7 x 9 pages (its target, 8 x 8, would keep 8)
        (32, 31): ((8, 4), 3),
        (4, 9): ((3, 4), 1),
    }
    for (blocks, pages), ((tns, tkeep), gns) in cases.items():
        tri = HZ.prefill_launch(blocks, pages, 128, 132)
        assert (tri["kernel"], tri["ns"], tri["keep"]) == ("triton", tns, tkeep), (blocks, pages)
        g = HZ.prefill_launch(blocks, pages, 128, 132, wgmma=True)
        assert (g["kernel"], g["ns"], g["keep"], g["win"]) == ("wgmma", gns, 16, 1), (blocks,
                                                                                   pages)
        assert -(-pages // g["ns"]) > 8
    # 8 pages cannot keep 16 in any split: the Triton kernel stays
    assert HZ.prefill_launch(4, 8, 128, 132, wgmma=True)["kernel"] == "triton"
    assert HZ.prefill_launch(32, 255, 128, 132, num_splits=33, wgmma=True)["kernel"] == "triton"
    monkeypatch.setattr(HZ, "PREFILL_WGMMA_SHORT_SPLITS", False)
    for (blocks, pages), ((tns, tkeep), _) in cases.items():
        g = HZ.prefill_launch(blocks, pages, 128, 132, wgmma=True)
        assert (g["kernel"], g["ns"], g["keep"]) == ("triton", tns, tkeep), (blocks, pages)
    assert HZ.prefill_launch(32, 1023, 128, 132, wgmma=True)["ns"] == 4


def test_dispatch_rule_unsplit(monkeypatch):
    """From ``PREFILL_WGMMA_UNSPLIT_BLOCKS_PER_SM`` row blocks per SM (two waves) the Gluon
    kernel runs unsplit (no merge launch) when the blocks score at most
    ``PREFILL_WGMMA_UNSPLIT_MAX_PAGES`` pages; longer blocks and fewer blocks keep the floor
    of 2 splits."""
    cases = {  # (row blocks, score pages): splits
        (512, 127): 1,  # 16K new tokens, no context
        (512, 383): 1,  # 16K x 32K
        (264, 512): 1,  # the edges
        (264, 513): 2,
        (263, 383): 2,
        (512, 1151): 2,  # 16K x 128K
        (128, 287): 2,  # 4K x 32K
    }
    for (blocks, pages), ns in cases.items():
        g = HZ.prefill_launch(blocks, pages, 128, 132, wgmma=True)
        assert (g["kernel"], g["ns"], g["keep"]) == ("wgmma", ns, 16), (blocks, pages)
        assert g["cand"] == (0 if ns == 1 else blocks * 128 * ns * 16)
        # the Triton kernel's rule is not changed by it
        assert HZ.prefill_launch(blocks, pages, 128, 132)["ns"] >= 2, (blocks, pages)
    assert HZ.prefill_launch(512, 383, 128, 132, num_splits=2, wgmma=True)["ns"] == 2
    monkeypatch.setattr(HZ, "PREFILL_WGMMA_UNSPLIT_MAX_PAGES", 0)
    assert HZ.prefill_launch(512, 383, 128, 132, wgmma=True)["ns"] == 2


def test_cap_counts_only_the_gluon_scratch():
    """Under a scratch cap (the Indexer's shared buffer) the Gluon launch keeps the splits whose
    candidates fit: the window scratch it does not use is not counted (it used to halve the
    splits for it, 3 -> 1 here)."""
    tri = HZ.prefill_launch(512, 1023, 128, 132, num_splits=3)
    cap = 2 * tri["cand"] + tri["win_elems"] - 1  # the Triton launch's scratch does not fit
    assert HZ.prefill_launch(512, 1023, 128, 132, num_splits=3, cap=cap)["ns"] == 1
    g = HZ.prefill_launch(512, 1023, 128, 132, num_splits=3, cap=cap, wgmma=True)
    assert g["kernel"] == "wgmma" and g["ns"] == 3 and g["win"] == 1
    assert g["scratch"] == 2 * g["cand"] <= cap
    g = HZ.prefill_launch(512, 1023, 128, 132, num_splits=3, cap=2 * g["cand"] - 1,
                          wgmma=True)
    assert g["kernel"] == "wgmma" and g["ns"] == 1 and g["scratch"] == 0


def test_kernel_knob_checked():
    """``PrefillConfig.kernel`` takes None / "triton" / "wgmma"; "wgmma" where it cannot run is
    refused before anything is written."""
    for bad in ("gluon", 1, True):
        with pytest.raises(ValueError, match="kernel"):
            PREFILL.PrefillConfig(kernel=bad)
    if HAS_CUDA and HZ.prefill_wgmma_ok(torch.device(DEV), "fp16", True):
        cfgs = [PREFILL.PrefillConfig(kernel="wgmma", tokens_on_n=False),
                PREFILL.PrefillConfig(kernel="wgmma", dot="bf16")]
    else:
        cfgs = [PREFILL.PrefillConfig(kernel="wgmma")]
    batch, qsl = prefill_batch([(4, 2200)], seed=3)
    q = random_q(4, 1, seed=3)
    for cfg in cfgs:
        big, out = poisoned_out(4, 1)
        with pytest.raises(ValueError, match="kernel"):
            PREFILL.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens, 64,
                                    out, config=cfg)
        assert_guards(big)
        assert (out == OUT_POISON).all()


@triton.jit
def _ws_offsets_kernel(j_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, ws_page_offset(tl.load(j_ptr + i)))


def test_workspace_page_offsets_are_int64():
    """SPEC 10: page j of a request's workspace lies ``j * 16384`` bytes past its first page; in
    int32 that wraps from page 131072 on (a 16M-token history, within the int32 seq lens the
    API takes) and both scorers would read before the workspace. They take the offset from
    ``layout.ws_page_offset`` (int64, checked here in the interpreter) and multiply no page
    index by ``WS_PAGE`` themselves (the Gluon kernel's converter is the one that loads pages)."""
    import inspect

    from nvfp4_indexer.triton import prefill_wgmma as PW
    pages = [0, 1, 131071, 131072, 131073, 2**24, 2**31 - 1]
    j = torch.tensor(pages + [0], dtype=torch.int32, device=DEV)
    out = torch.zeros(8, dtype=torch.int64, device=DEV)
    _ws_offsets_kernel[(1,)](j, out, N=8)
    assert out.tolist()[:len(pages)] == [p * 128 * 128 for p in pages]
    for fn in (PREFILL._ws_page_scores, PW._converter):
        src = inspect.getsource(fn.fn)
        assert "ws_page_offset(" in src and "* WS_PAGE" not in src, fn


_COMPILE = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
from benchmarks.sass_stats import compile_prefill_wgmma, sass_stats, wgmma_serialized
for ns, direct, conv, fp8 in ((1, 0, "", 0), (4, 0, "", 0), (4, 1, "lut", 0),
                              (4, 1, "arith", 0), (4, 0, "", 1)):
    # the launchers' specialization
    k = compile_prefill_wgmma(num_splits=ns, direct=bool(direct), conv=conv or "lut",
                              fp8=bool(fp8))
    st = sass_stats(k)
    steps = 8 if fp8 else 16  # two pages' k-steps (K = 32 / 16 per instruction)
    inner = sorted((n, sp) for (n, hg), sp in zip(st["loops"], st["loop_spills"]) if hg == steps)
    ptx = k.asm["ptx"]
    print(ns, st["registers"], k.metadata.num_warps, len(inner), sum(sp for _, sp in inner[:2]),
          st["spill_ops"], ptx.count("setmaxnreg.dec.sync.aligned.u32 \t104"),
          ptx.count("setmaxnreg.dec.sync.aligned.u32 \t200"), k.metadata.shared,
          sum(sp for (n, hg), sp in zip(st["loops"], st["loop_spills"]) if hg == 0 and n > 100),
          int(wgmma_serialized(k)), fp8,
          ",".join(str(n) for n, hg in st["loops"] if hg == 0 and n > 100))
'''


def test_compiles_offline_for_sm90():
    """sm_90a, no GPU, as the launchers specialize it: 12 warps at 168 registers, re-balanced
    to 200 per consumer thread and 104 per converter thread; each consumer's page loop holds
    two pages' MMAs (2 x 8 wgmma k-steps; 2 x 4 in the E4M3 form) and no spill instruction (a
    few outside the loops with one split: the final selection); six fp16 (E4M3) page buffers
    in shared memory; ptxas keeps the wgmma asynchronous (no C7514 serialization). The same
    for the direct kernel with either converter, whose page loop holds no spill either."""
    assert HZ.PREFILL_WGMMA_BLOCK_M == (128,)
    lines = _offline(_COMPILE)
    assert len(lines) == 5, lines
    conv_loops = []
    for ln in lines:
        *nums, conv_loop = ln.split()
        ns, regs, warps, loops, loop_spills, spills, conv, cons, shared, conv_spills, \
            serialized, fp8 = map(int, nums)
        assert regs == 168 and warps == 12 and loops >= 2 and loop_spills == 0, ln
        assert conv_spills == 0 and conv_loop.isdigit(), ln  # exactly one converter loop
        assert conv >= 1 and cons >= 1 and spills <= 8, ln
        assert shared >= 6 * 128 * 128 * (1 if fp8 else 2), ln
        assert serialized == 0, ln
        conv_loops.append(int(conv_loop))
    # the direct converters (lookup, arithmetic) do more per page than the workspace's
    assert conv_loops[0] < conv_loops[2] < conv_loops[3], conv_loops


def _direct_lut_emulate(asm, codes, scales):
    """The direct converter's lookup asm (``prefill_wgmma._F16X2_LUT_PTX``) replayed on the
    host for groups given as ``lut_probes.exhaustive_groups``: fp16 bits ``[N, 16]``."""
    import lut_probes
    from nvfp4_indexer.triton.decode import lut
    words = codes.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [N, 2]
    row = lut.lut_table()[scales.long()]
    out = []
    for w in range(2):
        regs = lut_probes.ptx_emulate(asm, {"$4": words[:, w], "$5": row & 0xFFFFFFFF,
                                     "$6": (row >> 32) & 0xFFFFFFFF,
                                     "$7": (scales.long() >> 7) * 0x88888888})
        for b in range(4):  # f16x2 of dims 8w + 2b (low half), 8w + 2b + 1
            x = regs[f"${b}"]
            out += [x & 0xFFFF, (x >> 16) & 0xFFFF]
    return torch.stack(out, dim=1).to(torch.int32)


def test_direct_lut_asm_bit_exact_on_host():
    """The direct converter's lookup PTX text (the default ``CONV``), replayed on the host,
    gives the reference dequant_e4m3 widened to fp16 for every (code, scale byte) pair in
    every nibble position, dims in memory order (SPEC 1.4); one changed selector digit (a
    sign taken from the wrong nibble) is caught."""
    from kernel_harness import strict_equal as _strict_equal
    from lut_probes import exhaustive_groups, reference_f16_bits
    from nvfp4_indexer.triton.prefill_wgmma import _F16X2_LUT_PTX
    codes, scales = exhaustive_groups()
    want = reference_f16_bits(codes, scales)
    _strict_equal(_direct_lut_emulate(_F16X2_LUT_PTX.value, codes, scales), want)
    mutant = _F16X2_LUT_PTX.value.replace("0x1151", "0x0151", 1)
    with pytest.raises(AssertionError):
        _strict_equal(_direct_lut_emulate(mutant, codes, scales), want)


_COMPILE_NB1 = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
from benchmarks.sass_stats import compile_prefill_wgmma
for direct in (False, True):
    try:
        compile_prefill_wgmma(nb=1, direct=direct)
        print("compiled")
    except Exception as e:
        print("refused", "NB >= 2" in str(e))
'''


def test_one_ring_buffer_is_refused():
    """The lab knob NB (ring buffers) below 2 is refused at compile time: with one buffer a
    consumer releases page k - 1 only after waiting for page k, which the converter writes
    into that same buffer only after the release: a deadlock on the GPU."""
    assert _offline(_COMPILE_NB1) == ["refused True", "refused True"]  # both kernels


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HZ.prefill_wgmma_ok(torch.device(DEV), "fp16", True)),
                    reason="needs a CUDA SM90 GPU with Gluon")
@pytest.mark.parametrize("specs,budget,num_splits,block_m", [
    ([(1024, 32768 + 1024)], None, 2, None),  # one request, several splits
    ([(2048, 34816), (512, 131072 + 512), (8, 9000)], None, 4, None),
    ([(64, 20000), (16, 40000)], None, 1, 128),  # one split: the kernel writes the output
    ([(4096, 4096), (1024, 33792), (256, 20000)], 300, None, None),  # several chunks
    ([(300, 50000)], None, 3, 128),  # partial last row block
    # blocks of 16 / 17 / 39 pages in 16 splits: 1-, 2-, 3-page and empty splits
    ([(1024, 40000), (64, 2100), (32, 2300), (16, 5000)], None, 16, None),
])
def test_gpu_gluon_matches_triton_twin(specs, budget, num_splits, block_m):
    """The Gluon kernel (pages from the workspace, and read straight from the cache) and its
    Triton twin select the same pages for every row (the same products in the same fp32
    wgmma order), the Gluon paths were taken, and all match the exact reference (tie-aware);
    pages with NaN scales in part or in whole are in the batch. (Splits are set where the
    default would give at most 8 pages per split: those chunks take the Triton kernel.)"""
    heads = 4
    batch, qsl = prefill_batch(specs, seed=len(specs) + 5, page_stride=9216)
    for blk, lo, hi in ((1, 8192, 8192 + 8 * 40), (3, 8192, 9216), (7, 8192, 9216)):
        batch.page_bytes(int(batch.block_table[0, blk]))[lo:hi] = 0x7F
    t = int(qsl[-1])
    q = random_q(t, heads, seed=t + 1)
    if budget is None:
        budget = ref.max_gather_pages(batch.width * 128, t)
    assert HZ.prefill_direct_ok(batch.cache)  # else the direct runs would gather
    outs = _run_kernels(batch, qsl, q, budget, num_splits, block_m,
                        (("triton", False), ("wgmma", False), ("wgmma", True)))
    assert torch.equal(outs["wgmma", False], outs["triton", False])
    assert torch.equal(outs["wgmma", True], outs["triton", False])
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    check_selection(outs["wgmma", True], exact, mag, local_pages(batch.seq_lens, qsl), BITS)


def _misaligned(cache: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` whose base is 8 bytes past a 16-byte boundary (same page stride)."""
    n, stride = cache.shape[0], cache.stride(0)
    raw = torch.zeros(n * stride + 16, dtype=torch.uint8, device=cache.device)
    base = (16 - raw.data_ptr() % 16) % 16 + 8
    view = raw[base:base + n * stride].as_strided((n, 128, 72), (stride, 72, 1))
    view.copy_(cache)
    assert view.data_ptr() % 16 == 8
    return view


def _run_kernels(batch, qsl, q, budget, num_splits, block_m, runs, cache=None, dot=None):
    """``prefill_indexer`` outputs per ``(kernel, direct)`` of ``runs`` (poisoned, guards
    checked), asserting which Gluon kernel each run launched (``dot``: the config's)."""
    from nvfp4_indexer.triton import prefill_wgmma as PW
    t, heads = q.shape[0], q.shape[1]
    outs = {}
    origs = {n: getattr(PW, n) for n in ("prefill_wgmma_kernel", "prefill_wgmma_direct_kernel")}
    for kernel, direct in runs:
        calls = []

        def spy(name):
            class Spy:
                def __getitem__(self, grid):
                    def launch(*a, **kw):
                        calls.append((name, kw.get("FP8", 0)))
                        return origs[name][grid](*a, **kw)
                    return launch
            return Spy()
        big, out = poisoned_out(t, heads)
        cfg = PREFILL.PrefillConfig(kernel=kernel, num_splits=num_splits, block_m=block_m,
                                    direct=direct, dot=dot)
        for n in origs:
            setattr(PW, n, spy(n))
        try:
            PREFILL.prefill_indexer(q, batch.cache if cache is None else cache,
                                    batch.block_table, qsl, batch.seq_lens, budget, out,
                                    config=cfg)
        finally:
            for n, f in origs.items():
                setattr(PW, n, f)
        torch.cuda.synchronize()
        assert_guards(big)
        outs[kernel, direct] = out.clone()
        aligned = HZ.prefill_direct_ok(batch.cache if cache is None else cache)
        want = set() if kernel == "triton" else {
            ("prefill_wgmma_direct_kernel" if direct and aligned else "prefill_wgmma_kernel",
             int(dot == "fp8"))}  # dot "fp8": the kernel's E4M3 form
        assert set(calls) == want, (kernel, direct, calls)
    return outs


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HZ.prefill_wgmma_ok(torch.device(DEV), "fp8", True)),
                    reason="needs a CUDA SM90 GPU with Gluon")
@pytest.mark.parametrize("specs,budget,num_splits", [
    ([(1024, 32768 + 1024)], None, 2),
    ([(2048, 34816), (512, 131072 + 512), (8, 9000)], None, 4),
    ([(64, 20000), (16, 40000)], None, 1),
    ([(4096, 4096), (1024, 33792), (256, 20000)], 300, None),
])
def test_gpu_gluon_fp8(specs, budget, num_splits):
    """Dot "fp8" (E4M3 operands on the FP8 tensor cores): the Gluon kernel is taken and its
    selection is valid against the exact reference within SPEC 9's b = 5, as is the Triton
    kernel's (tokens on M; the two are not bit-twins); the observed worst error is printed."""
    from nvfp4_indexer.triton.decode import SCORE_ERROR_BITS
    heads = 4
    batch, qsl = prefill_batch(specs, seed=len(specs) + 11, page_stride=9216)
    batch.page_bytes(int(batch.block_table[0, 3]))[8192:9216] = 0x7F  # NaN scales
    t = int(qsl[-1])
    q = random_q(t, heads, seed=t + 3)
    if budget is None:
        budget = ref.max_gather_pages(batch.width * 128, t)
    outs = _run_kernels(batch, qsl, q, budget, num_splits, 128,
                        (("triton", False), ("wgmma", False)), dot="fp8")
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    local = local_pages(batch.seq_lens, qsl)
    for key, out in outs.items():
        differ = check_selection(out, exact, mag, local, SCORE_ERROR_BITS["fp8"])
        print(f"{key}: {differ} long rows of {int((local >= 16).sum()) * heads} differ from "
              "the exact selection (within b = 5)")


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HZ.prefill_wgmma_ok(torch.device(DEV), "fp16", True)),
                    reason="needs a CUDA SM90 GPU with Gluon")
def test_gpu_direct_needs_an_aligned_cache():
    """A cache view whose base is not 16-byte aligned is gathered into the workspace (the
    direct kernel's 16-byte code loads need it); the selections are the same."""
    batch, qsl = prefill_batch([(512, 20000), (64, 9000)], seed=71, page_stride=9216)
    cache = _misaligned(batch.cache)
    assert not HZ.prefill_direct_ok(cache)
    q = random_q(int(qsl[-1]), 4, seed=72)
    budget = ref.max_gather_pages(batch.width * 128, int(qsl[-1]))
    outs = _run_kernels(batch, qsl, q, budget, 2, None, (("triton", False), ("wgmma", True)),
                        cache=cache)
    assert torch.equal(outs["wgmma", True], outs["triton", False])


def _with_poisoned_block(cache: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` (same stride) as a view of an allocation one block longer whose
    extra block holds NaN scales: an unclamped read of block id ``cache.shape[0]`` lands there
    (inside the allocation: a clean wrong answer, not a crash)."""
    n, stride = cache.shape[0], cache.stride(0)
    raw = torch.full(((n + 1) * stride,), 0x7F, dtype=torch.uint8, device=cache.device)
    big = raw.as_strided((n + 1, 128, 72), (stride, 72, 1))
    big[:n].copy_(cache)
    return big[:n]


def _clamp_case(kernel, ids):
    """``prefill_indexer`` outputs with direct False / True after writing ``ids``
    ({(request, page): block id}) into the block table, and with the ids the clamp reads."""
    batch, qsl = prefill_batch([(20, 3300), (16, 3000)], seed=65)
    cache = _with_poisoned_block(batch.cache)
    last = cache.shape[0] - 1
    t = int(qsl[-1])
    q = random_q(t, 2, seed=66)

    def run(bt, direct):
        big, out = poisoned_out(t, 2)
        PREFILL.prefill_indexer(q, cache, bt, qsl, batch.seq_lens, 10**6, out,
                                config=PREFILL.PrefillConfig(kernel=kernel, num_splits=2,
                                                             block_m=128, direct=direct))
        assert_guards(big)
        return out.clone()
    bt = batch.block_table.clone()
    clamped = bt.clone()
    for (r, j), v in ids.items():
        bt[r, j] = v
        clamped[r, j] = min(max(v, 0), last)
    return run(bt, False), run(bt, True), run(clamped, True)


# a split's first page (request 0: 25 pages in 2 splits: pages 0 and 13), a later page (the
# look-ahead), past the cache by one block (the poisoned block) and negative
_CLAMP_IDS = {(0, 0): 10**6, (0, 13): -5, (0, 7): "last+1", (1, 11): -1}


def _clamp_ids(batch_blocks):
    return {k: (batch_blocks if v == "last+1" else v) for k, v in _CLAMP_IDS.items()}


@pytest.mark.skipif(HAS_CUDA, reason="CPU check (the twin; the GPU test runs the kernel)")
def test_direct_clamps_block_ids_like_the_gather(monkeypatch):
    """SPEC 10: block ids past the cache or negative (metadata edited after validation; the
    internal ``prefill_indexer`` does not check ids) are clamped into it by the direct path as
    by the gather (a split's first page, a later page, one block past the cache, negative):
    both paths select the same pages, those of the clamped ids; an unclamped read would land in
    a poisoned block just past the cache view."""
    _twin_in_its_place(monkeypatch)
    n = prefill_batch([(20, 3300), (16, 3000)], seed=65)[0].cache.shape[0]
    gathered, direct, clamped = _clamp_case(None, _clamp_ids(n))
    assert torch.equal(direct, gathered)
    assert torch.equal(direct, clamped)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HZ.prefill_wgmma_ok(torch.device(DEV), "fp16", True)),
                    reason="needs a CUDA SM90 GPU with Gluon")
def test_gpu_direct_clamps_block_ids_like_the_gather():
    """The Gluon direct kernel's clamp (first load and look-ahead): as the CPU test, on the
    real kernel against the gather + workspace kernel."""
    n = prefill_batch([(20, 3300), (16, 3000)], seed=65)[0].cache.shape[0]
    gathered, direct, clamped = _clamp_case("wgmma", _clamp_ids(n))
    assert torch.equal(direct, gathered)
    assert torch.equal(direct, clamped)


def _twin_in_its_place(monkeypatch):
    """Let the Gluon branch run on the CPU: ``prefill_wgmma_ok`` forced, and the Gluon kernel
    replaced by the Triton twin under its contract (window 1, KEEP 16, no window scratch).
    Returns the list of the launches' ``(grid, BLOCK_M, NUM_SPLITS)``."""
    from nvfp4_indexer.triton import prefill_wgmma as PW
    options = PW.launch_options()  # the real kernel's layout constexprs and num_warps
    calls = []

    class Twin:
        def __getitem__(self, grid):
            def launch(*args, H, BLOCK_M, NUM_SPLITS, **kw):
                assert kw == options, kw
                assert grid[1] == NUM_SPLITS and BLOCK_M in HZ.PREFILL_WGMMA_BLOCK_M
                cand, win = args[11], args[12]
                rows = grid[0] * BLOCK_M * NUM_SPLITS * 16
                assert cand.numel() == (rows if NUM_SPLITS > 1 else 1) and win.numel() == 1
                calls.append((grid, BLOCK_M, NUM_SPLITS))
                PREFILL._prefill_score_kernel[grid](
                    *args, H=H, BLOCK_M=BLOCK_M, NUM_SPLITS=NUM_SPLITS, DOT="fp32", WINDOW=1,
                    KEEP=16, TOKENS_N=False)
            return launch
    class DirectTwin:  # the direct kernel's twin: the Triton kernel reading the cache
        def __getitem__(self, grid):
            def launch(*args, H, BLOCK_M, NUM_SPLITS, **kw):
                assert kw == options, kw
                calls.append((grid, BLOCK_M, NUM_SPLITS, "direct"))
                PREFILL._prefill_direct_score_kernel[grid](
                    *args, H=H, BLOCK_M=BLOCK_M, NUM_SPLITS=NUM_SPLITS, DOT="fp32", WINDOW=1,
                    KEEP=16, TOKENS_N=False)
            return launch
    monkeypatch.setattr(HZ, "prefill_wgmma_ok", lambda *a: True)
    monkeypatch.setattr(PW, "prefill_wgmma_kernel", Twin())
    monkeypatch.setattr(PW, "prefill_wgmma_direct_kernel", DirectTwin())
    return calls


@pytest.mark.skipif(HAS_CUDA, reason="CPU plumbing check (the GPU test runs the kernel)")
@pytest.mark.parametrize("knob", [{"window": 2}, {"num_stages": 2}])
def test_triton_knobs_select_the_triton_kernel(monkeypatch, knob):
    """With ``kernel`` None a window or num_stages (knobs of the Triton kernel only) selects the
    Triton kernel for every chunk; with ``kernel="wgmma"`` they are ignored."""
    calls = _twin_in_its_place(monkeypatch)
    batch, qsl = prefill_batch([(20, 2300)], seed=63)
    q = random_q(20, 2, seed=64)
    for kernel, gluon in ((None, False), ("wgmma", True)):
        calls.clear()
        big, out = poisoned_out(20, 2)
        cfg = PREFILL.PrefillConfig(num_splits=1, block_m=128, kernel=kernel, **knob)
        PREFILL.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens, 10**6,
                                out, config=cfg)
        assert_guards(big)
        assert bool(calls) == gluon, (kernel, calls)


@pytest.mark.skipif(HAS_CUDA, reason="CPU plumbing check (the GPU test runs the kernel)")
@pytest.mark.parametrize("direct", [False, True, "misaligned"])
@pytest.mark.parametrize("num_splits,block_m,gluon", [(1, 128, True), (2, 128, True),
                                                      (3, 128, False), (1, 64, False)])
def test_prefill_indexer_gluon_branch_on_cpu(monkeypatch, num_splits, block_m, gluon, direct):
    """``prefill_indexer``'s Gluon branch (CPU, the twin in its place): a chunk whose splits keep
    16 with BLOCK_M 128 launches it with the contract's grid, constexprs and scratch
    (candidates ``[rows, splits, 16]`` or none, no window scratch); the output (written by the
    score kernel for one split, by the KEEP-16 merge otherwise) passes the reference judge.
    At most 8 pages per split (3 splits of 18 pages) and BLOCK_M 64 take the Triton kernel.
    ``direct``: the Gluon chunks launch the direct kernel (its twin reads the cache) with
    the chunk's block-table rows and request base (a budget of 17 pages: one request per
    chunk, so request bases 0, 1, 2); "misaligned": asked for, but the cache view's base is
    not 16-byte aligned, so the chunks gather and take the workspace kernel."""
    calls = _twin_in_its_place(monkeypatch)
    specs = [(20, 2300), (3, 2200), (5, 40)]  # 18 / 17 pages, and short rows only
    batch, qsl = prefill_batch(specs, seed=61)
    batch.page_bytes(int(batch.block_table[0, 4]))[8192:] = 0x7F  # a NaN page
    t, heads = int(qsl[-1]), 2
    q = random_q(t, heads, seed=62)
    big, out = poisoned_out(t, heads)
    cfg = PREFILL.PrefillConfig(num_splits=num_splits, block_m=block_m, direct=bool(direct))
    cache = _misaligned(batch.cache) if direct == "misaligned" else batch.cache
    PREFILL.prefill_indexer(q, cache, batch.block_table, qsl, batch.seq_lens,
                            17 if direct else 10**6, out, config=cfg)
    assert_guards(big)
    assert bool(calls) == gluon, calls
    assert all(c[1:3] == (block_m, num_splits) for c in calls)
    assert all((c[3:] == ("direct",)) == (direct is True) for c in calls), calls
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    check_selection(out, exact, mag, local_pages(batch.seq_lens, qsl), BITS)


@pytest.mark.skipif(HAS_CUDA, reason="CPU plumbing check (the GPU test runs the kernel)")
@pytest.mark.parametrize("cfg_kw,gluon_fp8", [
    ({}, True),  # the Gluon chunk in E4M3 form, the Triton chunks exact (fp16, tokens on N)
    ({"kernel": "triton"}, False),  # the Triton kernel's fp8 (tokens on M) everywhere
    ({"tokens_on_n": False}, False),
])
def test_prefill_fp8_routing_on_cpu(monkeypatch, cfg_kw, gluon_fp8):
    """``PrefillConfig(dot="fp8")`` where the Gluon kernel runs (forced on the CPU, the twin
    in its place, every launch run in fp32): its chunks get ``launch_options(fp8=True)``
    (``FP8=1``), chunks off it (BLOCK_M 64) the exact ``DOT="fp16"`` with tokens on N; with
    the Triton kernel asked for, or tokens on M, every chunk is the Triton kernel's
    ``DOT="fp8"``. The output passes the reference judge."""
    from nvfp4_indexer.triton import prefill_wgmma as PW
    seen = []
    orig = PREFILL._prefill_score_kernel

    class Tri:
        def __getitem__(self, grid):
            def launch(*args, DOT, TOKENS_N, **kw):
                seen.append(("triton", DOT, TOKENS_N))
                orig[grid](*args, DOT="fp32", TOKENS_N=False, **kw)
            return launch

    class Gluon:
        def __getitem__(self, grid):
            def launch(*args, H, BLOCK_M, NUM_SPLITS, **kw):
                seen.append(("gluon", kw.get("FP8", 0), kw == PW.launch_options(True)))
                orig[grid](*args, H=H, BLOCK_M=BLOCK_M, NUM_SPLITS=NUM_SPLITS, DOT="fp32",
                           WINDOW=1, KEEP=16, TOKENS_N=False)
            return launch
    monkeypatch.setattr(HZ, "prefill_wgmma_ok", lambda dev, dot, tokens_n: bool(tokens_n))
    monkeypatch.setattr(PREFILL, "resolve_dot", lambda dot, dev: dot or "fp32")
    monkeypatch.setattr(PREFILL, "_prefill_score_kernel", Tri())
    monkeypatch.setattr(PW, "prefill_wgmma_kernel", Gluon())
    batch, qsl = prefill_batch([(20, 2300), (12, 2600)], seed=71)
    q = random_q(32, 2, seed=72)
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    for block_m in (128, 64):  # BLOCK_M 64: never the Gluon kernel's
        seen.clear()
        big, out = poisoned_out(32, 2)
        cfg = PREFILL.PrefillConfig(dot="fp8", num_splits=1, block_m=block_m, **cfg_kw)
        PREFILL.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens,
                                10**6, out, config=cfg)
        assert_guards(big)
        if not gluon_fp8:
            want = ("triton", "fp8", False)
        else:
            want = ("gluon", 1, True) if block_m == 128 else ("triton", "fp16", True)
        assert seen == [want], (block_m, seen)
        check_selection(out, exact, mag, local_pages(batch.seq_lens, qsl), BITS)
