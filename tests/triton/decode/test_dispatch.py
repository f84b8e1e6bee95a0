"""The decode rule table (``triton.decode.dispatch``): the plan of every (device capability, dot,
B, W, Q, H) case, the dequant rule's thresholds, the select rule and the Gluon launch shapes.
Pure host functions: a device is simulated by its capability and SM count."""

from __future__ import annotations

import pytest
import torch

from nvfp4_indexer.triton.config import DecodeConfig
from nvfp4_indexer.triton.decode import dispatch as dsp
from nvfp4_indexer.triton.heuristics import cdiv

# (capability, dot, B, W, Q, H) -> (dequant, kernel dot, NUM_SPLITS, programs of the flat
# page-score grid or (window, keep) of the one-launch kernel, score options and ring slots,
# (merge or select kernel, its constexprs and warps, grid y = cdiv(Q * H, rows per program))
# or None), on 132 SMs: the measured defaults (module doc of ``dispatch``), pinned.
TABLE = [
    ((None, "fp32", 4, 300, 1, 1),
     ("triton", "fp32", 150, (1, 2), {"num_warps": 4},
      ("split_merge", {"NUM_SPLITS": 150, "SPLITS_PAD": 256, "ROWS": 1, "KEEP": 2,
                       "num_warps": 1}, 1))),
    (((8, 0), "fp16", 16, 129, 8, 4),
     ("triton", "fp16", 64, (1, 2), {"num_warps": 4, "maxnreg": 128},
      ("redux_merge", {"C": 128, "K": 4, "ROWS": 4, "num_warps": 4}, 8))),
    (((8, 9), "fp16", 16, 129, 8, 4),
     ("ptx", "fp16", 64, (1, 2), {"num_warps": 4, "maxnreg": 128},
      ("redux_merge", {"C": 128, "K": 4, "ROWS": 4, "num_warps": 4}, 8))),
    (((9, 0), "fp16", 1, 16, 1, 1),
     ("ptx", "fp16", 1, (1, 16), {"num_warps": 4, "maxnreg": 128}, None)),
    (((9, 0), "fp16", 1, 17, 8, 4),
     ("ptx", "fp16", 16, (1, 1), {"num_warps": 4, "maxnreg": 128},
      ("redux_merge", {"C": 16, "K": 1, "ROWS": 4, "num_warps": 4}, 8))),
    (((9, 0), "fp16", 16, 129, 8, 4),
     ("mma", "fp16", 64, 1584, {"num_warps": 1, "maxnreg": 168, "STAGES": 4},
      ("redux_select", {"K": 8, "ROWS": 4, "num_warps": 4}, 8))),
    (((9, 0), "fp16", 192, 129, 8, 4),
     ("wgflat", "fp16", 3, 528, {"num_warps": 4, "STAGES": 4, "FP8": 0},
      ("redux_select", {"K": 8, "ROWS": 4, "num_warps": 4}, 8))),
    (((9, 0), "fp16", 512, 65, 8, 4),
     ("wgflat", "fp16", 2, 528, {"num_warps": 4, "STAGES": 4, "FP8": 0},
      ("redux_select", {"K": 4, "ROWS": 4, "num_warps": 4}, 8))),
    (((9, 0), "fp16", 128, 129, 8, 8),
     ("wgmma", "fp16", 32, 4096, {"num_warps": 4},
      ("redux_select", {"K": 8, "ROWS": 4, "num_warps": 4}, 16))),
    (((9, 0), "fp16", 16, 1025, 8, 8),
     ("wgmma", "fp16", 256, 4096, {"num_warps": 4},
      ("redux_select_split", {"K": 16, "S": 4, "ROWS": 1, "num_warps": 4}, 64))),
    (((9, 0), "fp16", 4, 8193, 8, 8),
     ("wgmma", "fp16", 256, 1024, {"num_warps": 4},
      ("select_classes", {"CHUNK": 1024, "GROUP": 128, "num_warps": 1}, 64))),
    (((9, 0), "fp16", 2048, 33, 1, 1),
     ("mma", "fp16", 1, 1584, {"num_warps": 1, "maxnreg": 168, "STAGES": 4},
      ("redux_select", {"K": 2, "ROWS": 1, "num_warps": 1}, 1))),
    (((9, 0), "fp16", 3, 10000, 1, 4),
     ("mma", "fp16", 256, 1584, {"num_warps": 1, "maxnreg": 168, "STAGES": 4},
      ("select_classes", {"CHUNK": 1024, "GROUP": 128, "num_warps": 1}, 4))),
    (((9, 0), "fp16", 1, 1025, 8, 4),
     ("ptx", "fp16", 256, (1, 4), {"num_warps": 4, "maxnreg": 128},
      ("split_merge", {"NUM_SPLITS": 256, "SPLITS_PAD": 256, "ROWS": 1, "KEEP": 4,
                       "num_warps": 2}, 32))),
    (((9, 0), "fp8", 16, 129, 8, 4),
     ("wgflat", "fp8", 33, 256, {"num_warps": 4, "STAGES": 4, "FP8": 1},
      ("redux_select", {"K": 8, "ROWS": 4, "num_warps": 4}, 8))),
    (((9, 0), "fp8", 1, 1025, 8, 4),
     ("ptx", "fp16", 256, (1, 4), {"num_warps": 4, "maxnreg": 128},
      ("split_merge", {"NUM_SPLITS": 256, "SPLITS_PAD": 256, "ROWS": 1, "KEEP": 4,
                       "num_warps": 2}, 32))),
    (((9, 0), "bf16", 16, 129, 8, 4),
     ("triton", "bf16", 64, (1, 2), {"num_warps": 4, "maxnreg": 128},
      ("redux_merge", {"C": 128, "K": 4, "ROWS": 4, "num_warps": 4}, 8))),
    (((10, 0), "fp16", 16, 129, 8, 4),
     ("ptx", "fp16", 64, (1, 2), {"num_warps": 4, "maxnreg": 128},
      ("redux_merge", {"C": 128, "K": 4, "ROWS": 4, "num_warps": 4}, 8))),
]


def _row(plan: dsp.DecodePlan) -> tuple:
    """A plan in the table's terms."""
    score = {**plan.score.constexprs, **plan.score.options}
    opts = {k: score[k] for k in ("num_warps", "maxnreg", "STAGES", "FP8") if k in score}
    second = plan.select if plan.page_scores else plan.merge
    if second is not None:
        consts = {k: v for k, v in {**second.constexprs, **second.options}.items()
                  if k not in ("Q", "H", "BLOCK_M", "PDL")}
        second = (second.kernel, consts, cdiv(plan.query_len * plan.num_heads, second.rows))
    extra = plan.programs if plan.page_scores else (plan.window, plan.keep)
    return (plan.dequant, plan.kernel_dot, plan.num_splits, extra, opts, second)


@pytest.mark.parametrize("case,want", TABLE, ids=[str(c) for c, _ in TABLE])
def test_default_dispatch_table(case, want):
    """The default plan of each case: one-launch kernel ("triton" / "ptx") and its Gluon or
    Triton merge off SM90 and for small batches; "mma", "wgflat" (32 rows, from 24 576 pages)
    and "wgmma" (64 rows) with their selects on SM90; dot "fp8" on "wgflat" with E4M3
    operands where it pays, else the exact fp16 form."""
    cap, dot, b, w, q, h = case
    plan = dsp.plan_decode(h, b, w, q, DecodeConfig(dot=dot), capability=cap, num_sms=132)
    assert _row(plan) == want
    assert plan.score.kernel == ("split" if plan.dequant in ("triton", "ptx") else plan.dequant)
    assert plan.scratch_elems == (2 * plan.cand_elems + plan.win_elems)


def test_plan_needs_gluon_for_the_page_scorers():
    """Without Gluon the SM90 default stays on the one-launch kernel, and a Gluon mode is
    refused by name."""
    plan = dsp.plan_decode(4, 16, 129, 8, None, capability=(9, 0), num_sms=132, gluon=False)
    assert plan.dequant == "ptx"
    with pytest.raises(ValueError, match="'mma' needs"):
        dsp.plan_decode(4, 16, 129, 8, DecodeConfig(dequant="mma"), capability=(9, 0),
                        num_sms=132, gluon=False)


def test_plan_validation():
    """Device and shape checks of a config, before any launch: ptx modes and dot modes
    other than fp32 off CUDA, "lut" with a 16-bit dot, "wgmma" off SM90, pdl before SM90,
    a window too large for BLOCK_M; ``validate=False`` sizes such configs instead."""
    def plan(cap, **kw):
        return dsp.plan_decode(4, 2, 40, 8, DecodeConfig(**kw), capability=cap, num_sms=132)
    with pytest.raises(ValueError, match="'ptx' needs a CUDA GPU"):
        plan(None, dequant="ptx")
    with pytest.raises(ValueError, match="dot: only 'fp32'"):
        plan(None, dot="fp16")
    with pytest.raises(ValueError, match="'lut' scores with dot 'fp32'"):
        plan((9, 0), dequant="lut")
    with pytest.raises(ValueError, match="'wgmma' needs a CUDA SM90"):
        plan((10, 0), dequant="wgmma")
    with pytest.raises(ValueError, match="pdl"):
        plan((8, 9), pdl=True)
    with pytest.raises(ValueError, match="window"):
        plan((9, 0), window=256)
    sized = dsp.plan_decode(4, 2, 40, 8, DecodeConfig(dequant="ptx"), capability=None,
                            num_sms=132, validate=False)
    assert sized.scratch_elems > 0


def test_choose_dequant_page_score_rule():
    """The default-dequant rule on a (simulated) SM90 GPU: "mma" from ``MMA_MIN_PAGES``
    pages B * (W - 1) and ``MMA_MIN_WIDTH`` pages W - 1 at <= 32 rows, "wgflat" from
    ``WGFLAT_MIN_PAGES`` (or the explicit ``min_pages`` when larger) and W - 1 >=
    ``WGFLAT_MIN_WIDTH`` at 32 rows, "wgmma" from ``WGMMA_MIN_PAGES`` at 64 rows (any B), an
    explicit ``min_pages`` for both, never without rows to score (W - 1 <= 15), off SM90 or
    with another dot; else the one-launch kernel's mode ("ptx" for fp16 on SM89+)."""
    pages, w_min = dsp.MMA_MIN_PAGES, dsp.MMA_MIN_WIDTH + 1
    reqs = pages // (w_min - 1)
    cap = [(9, 0)]

    def pick(b, w, rows, min_pages=None, dot="fp16"):
        return dsp.choose_dequant(cap[0], dot, b, w, min_pages, rows)
    assert reqs * (w_min - 1) == pages
    assert pick(reqs, w_min, 32) == "mma" and pick(reqs, w_min, 16) == "mma"
    flat = dsp.WGFLAT_MIN_PAGES // 128  # requests of W - 1 = 128 pages
    assert pick(flat, 129, 32) == "wgflat" and pick(flat, 129, 16) == "mma"  # 32 rows only
    assert pick(flat - 1, 129, 32) == "mma" and pick(flat, 129, 64) == "wgmma"
    assert pick(flat, 129, 32, min_pages=2 * dsp.WGFLAT_MIN_PAGES) == "ptx"
    assert pick(2 * flat, 129, 32, min_pages=2 * dsp.WGFLAT_MIN_PAGES) == "wgflat"
    assert pick(reqs - 1, w_min, 32) == "ptx"  # 64 pages short
    assert pick(1, pages + 1, 32) == "mma"  # one long request
    assert pick(10 * reqs, w_min - 1, 32) == "ptx"  # short requests
    wide = dsp.WGMMA_MIN_PAGES + 1
    assert pick(1, wide, 64) == "wgmma" and pick(1, wide - 1, 64) == "ptx"
    assert pick(reqs, w_min, 64) == "ptx"  # 64 rows: the wgmma threshold
    assert pick(1, w_min, 32, min_pages=0) == "mma" and pick(1, 17, 64, min_pages=0) == "wgmma"
    assert pick(reqs, w_min - 1, 32, min_pages=0) == "ptx"  # W - 1 < MMA_MIN_WIDTH
    assert pick(reqs, 16, 32, min_pages=0) == "ptx"  # W - 1 = 15: every row is short
    assert pick(128, 17, 32) == "mma" and pick(64, 33, 16) == "mma"  # W - 1 = 16 / 32 pages
    short = dsp.WGFLAT_MIN_WIDTH  # W - 1 = WGFLAT_MIN_WIDTH - 1: "mma" however many pages
    assert pick(dsp.WGFLAT_MIN_PAGES, short, 32) == "mma"
    assert pick(dsp.WGFLAT_MIN_PAGES, short + 1, 32) == "wgflat"
    assert pick(reqs, w_min, 32, dot="fp32") == "triton"
    # dot fp8: "wgflat" with E4M3 operands from FP8_MIN_PAGES at 32 rows, FP8_MIN_PAGES_NARROW
    # at 16, the exact fp16 choice below them and at 64 rows
    assert pick(dsp.FP8_MIN_PAGES // 16, 17, 32, dot="fp8") == "wgflat"
    assert pick(dsp.FP8_MIN_PAGES // 16, 17, 16, dot="fp8") == "mma"
    assert pick(dsp.FP8_MIN_PAGES_NARROW // 16, 17, 16, dot="fp8") == "wgflat"
    assert pick(flat, 129, 64, dot="fp8") == "wgmma"
    assert dsp.fp8_kernel_dot("fp8", "mma") == "fp16" and dsp.fp8_kernel_dot("fp8", "lut") == "fp32"
    cap[0] = (10, 0)
    assert pick(reqs, w_min, 32) == "ptx"  # measured on SM90 only
    cap[0] = None
    assert pick(reqs, w_min, 32, dot="fp32") == "triton"


def test_split_counts():
    """NUM_SPLITS: 1 when every row is short (W - 1 <= 15), at most ``MAX_SPLITS``, 1-page
    splits for small batches; the window and kept candidates follow the split's pages."""
    assert dsp.choose_num_splits(1, 1, 132) == 1
    assert dsp.choose_num_splits(5000, 2000, 132) == 1
    assert dsp.choose_num_splits(1, 1024, 132) == 256
    assert 1 < dsp.choose_num_splits(8, 400, 132) <= 200
    assert dsp.keep_per_split(19, 20) == 1 and dsp.keep_per_split(2, 40) == 16
    assert dsp.decode_window(1, 2000, 16) == 64 and dsp.decode_window(19, 20, 16) == 1
    assert dsp.cp_num_splits(4, 16, 2, 132) == 1
    assert dsp.subset_pages(300, 4) == 75


def test_redux_launch_shape():
    """Keys per lane and rows per program of the Gluon select / merge: K = next power of two
    >= n / 32, rows = min(4, next power of two >= Q*H); the split select: S = 4 warps per row
    up to 4 * 32 * keys_per_lane keys (the library passes 16: 2048), else 8, K = next power
    of two >= n / (32 S)."""
    assert dsp.redux_shape(20, 1) == (1, 1) and dsp.redux_shape(33, 2) == (2, 2)
    assert dsp.redux_shape(128, 32) == (4, 4) and dsp.redux_shape(129, 6) == (8, 4)
    assert dsp.redux_shape(512, 64) == (16, 4) and dsp.redux_shape(249, 3) == (8, 4)
    split = dsp.split_shape
    assert split(20, 8) == (1, 4) and split(600, 8) == (8, 4)
    assert split(1024, 8) == (8, 4) and split(1025, 8) == (8, 8)
    assert split(1563, 8) == (8, 8) and split(2100, 8) == (16, 8)
    assert split(8192, 16) == (32, 8) and split(4096, 16) == (16, 8)
    assert split(2048, 16) == (16, 4) and split(2049, 16) == (16, 8)


def test_select_plan_rule():
    """Which select kernel a launch gets: on the Gluon paths the one-warp redux select up to
    ``SELECT_REDUX_MAX_WIDTH``, its split form above that for at most
    ``SELECT_SPLIT_MAX_ROWS`` rows (S warps, one row per program) up to
    ``SELECT_SPLIT_MAX_WIDTH``, else the Triton selects (wide for few rows, residue-class for
    many); off the Gluon paths (the interpreter, "lut") never a Gluon kernel."""
    def pick(b, w, q=8, h=4, gluon=True):
        launch = dsp.select_plan(b, w, q, h, gluon=gluon)
        return launch.kernel, launch.constexprs, launch.options["num_warps"], launch.rows
    assert pick(128, 512)[0] == "redux_select"
    assert pick(16, 513) == ("redux_select_split", dict(K=8, S=4, ROWS=1), 4, 1)
    assert pick(8, 1563) == ("redux_select_split", dict(K=16, S=4, ROWS=1), 4, 1)
    assert pick(16, 2049) == ("redux_select_split", dict(K=16, S=8, ROWS=1), 8, 1)
    assert pick(16, 8192)[1] == dict(K=32, S=8, ROWS=1)
    assert pick(16, 8193)[0] == "select_classes"  # past the split's (and wide's) width
    assert pick(32, 1000)[0] == "redux_select_split"  # 1024 rows
    assert pick(33, 1000)[0] == "select_classes"  # 1056 rows: the residue-class select
    assert pick(17, 1000)[0] == "redux_select_split"  # 544 rows
    assert pick(256, 1000, 1, 4)[0] == "redux_select_split"  # Q1 H4: 1024 rows
    for w in (100, 1000):
        assert pick(8, w, gluon=False)[0] == "select_wide"
    # ``wide`` forces the Triton selects on the Gluon paths too (tests, labs)
    for w in (100, 1000):
        assert dsp.select_plan(8, w, 8, 4, gluon=True, wide=False).kernel == "select_classes"
        assert dsp.select_plan(8, w, 8, 4, gluon=True, wide=True).kernel == "select_wide"
    assert dsp.SELECT_SPLIT_MAX_WIDTH <= 8 * 32 * 32  # K <= 32 keys per lane at S = 8


@pytest.mark.parametrize("cap,dot", [(None, "fp32"), ((8, 0), "fp16"), ((9, 0), "fp16"),
                                     ((9, 0), "bf16")])
def test_context_parallel_plan(cap, dot):
    """A context-parallel rank's plan: the one-launch kernel's default mode over the rank's
    ceil((W - 1) / world) pages, candidates always written, the reduce / merge one row per
    program on a GPU and a request's rows per program under the interpreter; page-score
    modes and pdl refused."""
    plan = dsp.plan_context_parallel(4, 2, 4, 300, 2, DecodeConfig(dot=dot), capability=cap,
                                     num_sms=132)
    assert plan.dequant == ("ptx" if cap == (9, 0) and dot == "fp16" else "triton")
    assert (plan.num_splits, plan.keep, plan.window, plan.block_m) == (75, 2, 1, 16)
    assert plan.score.constexprs["CANDIDATES"] is True and plan.score.constexprs["H"] == 8
    assert plan.cand_elems == 4 * 16 * 75 * 2
    rows = (plan.reduce.rows, plan.merge.rows)
    assert rows == ((16, 8) if cap is None else (1, 1))
    assert ("maxnreg" in plan.score.options) == (cap is not None)
    with pytest.raises(ValueError, match="dequant"):
        dsp.plan_context_parallel(4, 2, 4, 300, 2, DecodeConfig(dequant="lut", dot="fp32"),
                                  capability=cap, num_sms=132)
    with pytest.raises(ValueError, match="pdl"):
        dsp.plan_context_parallel(4, 2, 4, 300, 2, DecodeConfig(dot=dot, pdl=True),
                                  capability=cap, num_sms=132)


def test_runner_runs_the_plan_of_its_device():
    """``DecodeRunner`` takes its launches from ``plan_decode`` for its own device (the CPU:
    capability None) and exposes the plan."""
    from kernel_harness import DEV, K  # noqa: F401  (sets TRITON_INTERPRET)
    from nvfp4_indexer.triton.device import capability, num_sms
    runner = K["decode.runner"].DecodeRunner(2, 3, 300, 2, DEV, warmup=False)
    want = dsp.plan_decode(2, 3, 300, 2, None, capability=capability(torch.device(DEV)),
                           num_sms=num_sms(DEV))
    assert runner.plan == want


def _constexpr_params(kernel) -> tuple[set, set]:
    """(every parameter, the constexpr parameters without a default) of a jit kernel."""
    import inspect
    params = inspect.signature(getattr(kernel, "fn", kernel)).parameters
    required = {n for n, p in params.items()
                if "constexpr" in str(p.annotation) and p.default is p.empty}
    return set(params), required


@pytest.mark.parametrize("dot", ["fp16", "fp8"])
def test_plans_bind_to_their_kernels(dot):
    """Every launch a plan names (score, select, merge; SM90, SM89 and SM100 plans over a grid of
    shapes and forced dequant modes) passes only constexprs its kernel declares and every
    constexpr it needs: a mismatch would only show at launch on a GPU."""
    pytest.importorskip("triton.experimental.gluon")
    from nvfp4_indexer.triton.decode import page_scores, runner
    from nvfp4_indexer.triton.decode import mma, redux, wgflat, wgmma
    score = {"mma": (mma.mma_score_kernel, {"CL", "MMA", "QL", "SCL"}),
             "wgflat": (wgflat.wgflat_score_kernel, {"CL", "MMA", "QL", "SCL", "B_SL"}),
             "wgmma": (wgmma.wgmma_score_kernel, {"CL", "MMA", "QL", "B_SL"}),
             "lut": (page_scores.lut_score_kernel, set())}
    merge = {"redux_merge": redux.redux_merge_kernel, "split_merge": runner.decode_merge_kernel}
    checked = set()
    for cap, h, q, b, w, dq in [(cap, h, q, b, w, dq)
                                for cap in ((9, 0), (8, 9), (10, 0))
                                for h in (1, 4, 8) for q in (1, 2, 8) for b in (1, 8, 256)
                                for w in (17, 100, 3000)
                                for dq in (None, "lut", "mma", "wgflat", "wgmma")
                                if q * h <= 64]:
        try:
            plan = dsp.plan_decode(h, b, w, q, DecodeConfig(dot=dot, dequant=dq),
                                   capability=cap, num_sms=132)
        except ValueError:  # a mode this device or shape cannot run
            continue
        launches = []
        if plan.page_scores:
            kernel, layouts = score[plan.dequant]
            launches.append((kernel, set(plan.score.constexprs) | layouts))
            launches.append((page_scores.select_kernel(plan.select.kernel),
                             set(plan.select.constexprs) | {"Q", "H", "N"}))
        if plan.merge is not None:
            launches.append((merge[plan.merge.kernel], set(plan.merge.constexprs)))
        for kernel, given in launches:
            names, required = _constexpr_params(kernel)
            assert given <= names, (plan.dequant, kernel, given - names)
            assert required <= given, (plan.dequant, kernel, required - given)
            checked.add(getattr(kernel, "__name__", str(kernel)))
    assert len(checked) >= 7, checked
