"""GPU lab for the Triton decode kernel's dequantization paths and tuning knobs.

Run (one H200, about 2-4 minutes)::

    python -m benchmarks.labs.dequant_lab            # everything
    python -m benchmarks.labs.dequant_lab --quick    # fewer variants, two cases

Steps (progress is printed and flushed as it goes; a compact table comes last):

1. Operands: ``ptx.nvfp4_dequant_ptx`` in modes "ptx" / "ptx_arith" on two pages that
   hold all 16 x 256 (code, scale byte) pairs in every nibble position, against the reference
   dequant_e4m3 table (SPEC 1.4), bit for bit (NaN positions exactly).
2. Decode correctness on a small adversarial batch (B=8, Q=8, H=4; pages with NaN scale
   bytes 0x7F/0xFF, negative, maximal 0x7E and subnormal scales, random codes): every variant
   against the default path (rows identical) and against the exact reference scores
   (SPEC 9 tie-aware, b = 15).
3. Timing: decode variants on b128 x 100K, b8 x 100K, b32 x 10K, b1 x 32K, b8 x 4K and
   b128 x 1K (Q=8, H=4), cold
   cache (a page pool far larger than L2, block tables rotated across >= 2x L2 of traffic,
   ``benchmarks.pool`` / ``timing``), CUDA-graph replays: us/call, GB/s of necessary traffic
   (9216 B per history page + queries + outputs + block-table entries + seq lens,
   ``workloads.decode_traffic``) and % of the device-to-device copy measured in this run.
   Each variant's output on slot 0 is also compared with the default variant's.
A variant that fails (compile error, wrong result) is reported and the lab goes on.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {msg}", flush=True)


# Variants: name -> DecodeConfig fields (``profile_case.config_of``: dataclasses.replace on
# the default config). "base" is the current default path; a variant whose launch equals an
# earlier one's on a case (the defaults pick the same dequant / splits / window there) is
# reported as such and not timed again (docs/benchmarks.md records what each knob did).
VARIANTS = {
    "base": {},
    "ptx": {"dequant": "ptx"},
    "triton": {"dequant": "triton"},
    "arith": {"dequant": "ptx_arith"},
    "ptx win1": {"dequant": "ptx", "window": 1},
    "ptx reg168": {"dequant": "ptx", "maxnreg": 168},
    "ptx pps4": {"dequant": "ptx", "programs_per_sm": 4},
    "ptx w8": {"dequant": "ptx", "num_warps": 8},
    "ptx pdl": {"dequant": "ptx", "pdl": True},
    "wg": {"dequant": "wgmma"},
    "wg pps16": {"dequant": "wgmma", "programs_per_sm": 16},
    "wg pps64": {"dequant": "wgmma", "programs_per_sm": 64},
    "mma": {"dequant": "mma"},
    "mma reg144": {"dequant": "mma", "maxnreg": 144},
    "mma reg128": {"dequant": "mma", "maxnreg": 128},
    "mma pps32": {"dequant": "mma", "programs_per_sm": 32},
    "mma pps36": {"dequant": "mma", "programs_per_sm": 36},
    "mma pps64": {"dequant": "mma", "programs_per_sm": 64},
    "mma pps11": {"dequant": "mma", "programs_per_sm": 11},
    "mma pps24": {"dequant": "mma", "programs_per_sm": 24},
    "mma ns256": {"dequant": "mma", "num_splits": 256},
    # speed of light of the mma scorer (``mma_scorer`` LAB; 2 and 3 give wrong scores and
    # are timed only): 1 two independent K-half MMA chains, 2 no lookup, 3 no MMA
    "mma narrow": {"dequant": "mma", "_narrow_select": True},  # one-warp select for any B
    "mma lab1": {"dequant": "mma", "_lab": 1},
    "mma lab2": {"dequant": "mma", "_lab": 2},
    "mma lab3": {"dequant": "mma", "_lab": 3},
    # the page-per-warp wgmma scorer (``wgflat_scorer``): ring slots, async low half, residency
    "wgf": {"dequant": "wgflat"},
    "wgf sync": {"dequant": "wgflat", "_wgf_async": 0},
    "wgf sync r96": {"dequant": "wgflat", "_wgf_async": 0, "maxnreg": 96, "programs_per_sm": 5},
    "wgf s8": {"dequant": "wgflat", "_wgf_stages": 8},
    "wgf pps3": {"dequant": "wgflat", "programs_per_sm": 3},
    "wgf pps4": {"dequant": "wgflat", "programs_per_sm": 4},
    "wgf pps5": {"dequant": "wgflat", "programs_per_sm": 5},
    "wgf pps6": {"dequant": "wgflat", "programs_per_sm": 6},
    "wgf pps8": {"dequant": "wgflat", "programs_per_sm": 8},
    "wgf lab2": {"dequant": "wgflat", "_lab": 2},  # no lookup (wrong scores)
    "wgf lab3": {"dequant": "wgflat", "_lab": 3},  # no MMA (wrong scores)
    # the same scorer with E4M3 operands (dot "fp8": ``lut.LUT_E4M3_ASM``, fp8 wgmma, b = 5)
    "wgf8": {"dequant": "wgflat", "dot": "fp8"},
    "wgf8 pps5": {"dequant": "wgflat", "dot": "fp8", "programs_per_sm": 5},
    "wgf8 pps6 r80": {"dequant": "wgflat", "dot": "fp8", "programs_per_sm": 6, "maxnreg": 80},
    "wgf8 s8": {"dequant": "wgflat", "dot": "fp8", "_wgf_stages": 8},
    "wgf8 a1": {"dequant": "wgflat", "dot": "fp8", "_wgf_async": 1},  # async low half
    "wgf8 lab2": {"dequant": "wgflat", "dot": "fp8", "_lab": 2},
    "wgf8 lab3": {"dequant": "wgflat", "dot": "fp8", "_lab": 3},
    # the select kernel (``decode_wgmma.select_launch``): the Gluon redux select up to a
    # width (0: the split form from W 1, "oldsel" also without it: the Triton selects), its
    # rows per program, the int64 wide select for any row count
    "mma oldsel": {"dequant": "mma", "_redux_width": 0, "_split_width": 0},
    "mma widesel": {"dequant": "mma", "_redux_width": 0, "_split_width": 0,
                    "_wide_rows": 1 << 30},
    "mma rx512": {"dequant": "mma", "_redux_width": 512},
    "mma rx1024": {"dequant": "mma", "_redux_width": 1024},
    "mma rxr1": {"dequant": "mma", "_redux_rows": 1},
    "mma rxr8": {"dequant": "mma", "_redux_rows": 8},
    "wgf oldsel": {"dequant": "wgflat", "_redux_width": 0, "_split_width": 0},
    # the split redux select (S warps per row) for W > 512 on the default path: off (the
    # Triton selects); 8 keys per lane (S = 4 up to W 1024, then 8); only up to 512 rows
    # (session 13's rule); at any row count
    "nosplit": {"_split_width": 0},
    "split8": {"_split_keys": 8},
    "split512": {"_split_rows": 512},
    "splitall": {"_split_rows": 1 << 30},
    "ptx oldmerge": {"dequant": "ptx", "_redux_merge": 0},  # the Triton merge kernel
    "pps2": {"programs_per_sm": 2},
    "pps4": {"programs_per_sm": 4},
    "pps8": {"programs_per_sm": 8},
    "pps32": {"programs_per_sm": 32},
    "ns64": {"num_splits": 64},
    "ns250": {"num_splits": 250},
}
SELECT_KNOBS = {"_redux_width": ("decode_wgmma", "SELECT_REDUX_MAX_WIDTH"),
                "_redux_rows": ("redux_select", "ROWS_PER_PROGRAM"),
                "_wide_rows": ("decode_wgmma", "SELECT_WIDE_MAX_ROWS"),
                "_split_width": ("decode_wgmma", "SELECT_SPLIT_MAX_WIDTH"),
                "_split_keys": ("decode_wgmma", "SELECT_SPLIT_KEYS"),
                "_split_rows": ("decode_wgmma", "SELECT_SPLIT_MAX_ROWS"),
                "_redux_merge": ("decode", "REDUX_MERGE_MAX_CANDIDATES")}
QUICK_VARIANTS = ("base", "ptx", "wg", "pps8")
SOL_LABS = (2, 3)  # LAB variants whose scores are wrong by design: timed, not checked


def make_runner(b, width, dev, kw):
    """A ``DecodeRunner`` for variant knobs ``kw`` (``_lab``: ``decode_wgmma.MMA_LAB``;
    ``_narrow_select``: no wide select; ``_wgf_stages`` / ``_wgf_async``: the wgflat scorer's
    ring slots / ASYNC, ``decode_wgmma.WGFLAT_LAB_*``; ``SELECT_KNOBS``: select / merge rule
    constants; all only while its launches are built)."""
    from nvfp4_indexer.triton import decode_wgmma
    from nvfp4_indexer.triton.decode import DecodeRunner

    from .profile_case import config_of
    kw = dict(kw)
    lab = kw.pop("_lab", 0)
    narrow = kw.pop("_narrow_select", False)
    wgf = (kw.pop("_wgf_stages", None), kw.pop("_wgf_async", None))
    # select / merge rule knobs: module constants while the runner is built
    from nvfp4_indexer.triton import decode as decode_mod
    from nvfp4_indexer.triton import redux_select
    mods = {"decode_wgmma": decode_wgmma, "decode": decode_mod, "redux_select": redux_select}
    sel = {SELECT_KNOBS[knob]: kw.pop(knob) for knob in list(kw) if knob in SELECT_KNOBS}
    if narrow:  # no multi-warp select: neither the wide select nor the split redux select
        sel[("decode_wgmma", "SELECT_WIDE_MAX_ROWS")] = 0
        sel[("decode_wgmma", "SELECT_SPLIT_MAX_ROWS")] = 0
    saved = {key: getattr(mods[key[0]], key[1]) for key in sel}
    decode_wgmma.WGFLAT_LAB_STAGES, decode_wgmma.WGFLAT_LAB_ASYNC = wgf
    decode_wgmma.MMA_LAB = lab
    for (mod, name), val in sel.items():
        setattr(mods[mod], name, val)
    try:
        runner = DecodeRunner(HEADS, b, width, Q_LEN, dev, config=config_of("decode", kw))
    finally:
        decode_wgmma.MMA_LAB = 0
        for (mod, name), val in saved.items():
            setattr(mods[mod], name, val)
        decode_wgmma.WGFLAT_LAB_STAGES = decode_wgmma.WGFLAT_LAB_ASYNC = None
    runner.lab = (lab, narrow, wgf, tuple(sorted(sel.items())))
    return runner
CASES = [(128, 100_000), (8, 100_000), (32, 10_000), (1, 32_000), (8, 4_000),
         (128, 1_000)]  # (batch, nominal len)
Q_LEN, HEADS = 8, 4


# ----------------------------------------------------------------------------- 1. operands

def operand_kernel():
    """A Triton kernel: page ``pid``'s keys through ``ptx.nvfp4_dequant_ptx`` exactly as
    the decode kernel calls it (uint16 code pairs, fp16 group scales), stored fp16 [128, 128].
    Defined on call (it needs the GPU backend)."""
    import triton
    import triton.language as tl

    from nvfp4_indexer.triton import ptx

    @triton.jit
    def kernel(cache_ptr, out_ptr, DEQUANT: tl.constexpr):
        pid = tl.program_id(0)
        page = cache_ptr + pid * 9216
        t = tl.arange(0, 128)[:, None]
        codes = tl.load((page + t * 64).to(tl.pointer_type(tl.uint16), bitcast=True)
                        + tl.arange(0, 32)[None, :])
        sb = tl.load(page + 8192 + t * 8 + tl.arange(0, 8)[None, :])
        s8 = sb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        s = tl.reshape(tl.broadcast_to(s8[:, :, None], (128, 8, 4)), (128, 32))
        k0, k1, k2, k3 = ptx.nvfp4_dequant_ptx(codes, s, DEQUANT)
        base = out_ptr + pid * 128 * 128 + t * 128 + 4 * tl.arange(0, 32)[None, :]
        tl.store(base, k0)
        tl.store(base + 1, k1)
        tl.store(base + 2, k2)
        tl.store(base + 3, k3)

    return kernel


def pair_page_cache() -> torch.Tensor:
    """Two pages (CPU cache) holding all 16 x 256 (code, scale byte) pairs in both nibbles of
    every code byte position class."""
    from nvfp4_indexer import reference as ref
    cache = ref.new_index_cache(2, device="cpu")
    raw = cache.view(2, 9216)
    group = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)
    raw[0, :8192] = group.repeat(1024)
    raw[1, :8192] = ((group << 4) | (group >> 4)).repeat(1024)
    scales = torch.arange(1024) % 256
    raw[0, 8192:] = scales.to(torch.uint8)
    raw[1, 8192:] = ((scales * 37 + 11) % 256).to(torch.uint8)
    return cache


def check_operands(dev) -> list[tuple[str, str]]:
    """All 16 x 256 (code, scale byte) pairs through each ptx mode vs the reference."""
    from nvfp4_indexer import reference as ref
    cache = pair_page_cache()
    want = ref.decode_e4m3(ref.dequantize_nvfp4(*ref.read_blocks(cache, torch.arange(2))))
    rows = []
    try:
        kernel = operand_kernel()
    except Exception as e:  # noqa: BLE001
        return [("operands", f"ERROR defining kernel: {type(e).__name__}: {e}")]
    try:
        from nvfp4_indexer.triton import lut
        codes, scales = lut.exhaustive_groups()
        got = lut.lut_asm_dequant(codes.to(dev), scales.to(dev)).cpu()
        want16 = lut.reference_f16_bits(codes, scales)
        nan = want16 == 0x7E00
        gnan = ((got & 0x7C00) == 0x7C00) & ((got & 0x3FF) != 0)
        bad = int((got[~nan] != want16[~nan]).sum())
        verdict = "bit-exact" if bad == 0 and torch.equal(nan, gnan) else \
            f"FAIL ({bad} mismatches, NaN positions {'ok' if torch.equal(nan, gnan) else 'differ'})"
    except Exception as e:  # noqa: BLE001
        verdict = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    rows.append(("operands lut asm (16x256 pairs x 16 positions)", verdict))
    log(f"operands lut asm: {verdict}")
    for mode in ("ptx", "ptx_arith"):
        try:
            got = torch.full((2, 128, 128), -7.0, dtype=torch.float16, device=dev)
            kernel[(2,)](cache.to(dev), got, DEQUANT=mode)
            got = got.float().cpu()
            nan_ok = torch.equal(torch.isnan(got), torch.isnan(want))
            keep = ~torch.isnan(want) & ~torch.isnan(got)
            bad = int((got[keep].view(torch.int32) != want[keep].view(torch.int32)).sum())
            verdict = "bit-exact" if nan_ok and bad == 0 else \
                f"FAIL ({bad} mismatches, NaN positions {'ok' if nan_ok else 'differ'})"
        except Exception as e:  # noqa: BLE001
            verdict = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append((f"operands {mode} (16x256 pairs x 8 positions)", verdict))
        log(f"operands {mode}: {verdict}")
    return rows


# ------------------------------------------------------------------- 2. decode correctness

ADVERSARIAL_LENS = (20_000, 0, 129, 2050, 16_500, 12_345, 2_300, 19_999)


def adversarial_batch(dev, seed: int = 3, lens=ADVERSARIAL_LENS):
    """B=8, Q=8, H=4 batch over a fresh cache with adversarial pages (see module doc)."""
    import nvfp4_indexer as ni
    from benchmarks.pool import random_index_q, random_keys
    g = torch.Generator().manual_seed(seed)
    lens = list(lens)
    width = max(-(-s // 128) for s in lens)
    n_pages = len(lens) * width + 8
    cache = ni.new_index_cache(n_pages, device=dev)
    dgen = torch.Generator(device=dev).manual_seed(seed)
    k = random_keys(n_pages * 128, dev, dgen, torch.ones(128, device=dev))
    ni.write_index_k(cache, k, torch.arange(n_pages * 128, device=dev))
    raw = cache.view(n_pages, 9216)
    special = torch.randperm(n_pages, generator=g)[:60].tolist()
    for i, p in enumerate(special):
        kind = i % 6
        raw[p, :8192] = torch.randint(0, 256, (8192,), generator=g, dtype=torch.uint8).to(dev)
        sc = torch.randint(0, 256, (1024,), generator=g, dtype=torch.uint8)
        if kind == 0:
            sc[:] = 0x7F  # NaN page
        elif kind == 1:
            sc[torch.rand(1024, generator=g) < 0.05] = 0xFF  # some NaN tokens
        elif kind == 2:
            sc = (sc % 0x7F) | 0x80  # negative scales
        elif kind == 3:
            sc[:] = 0x7E  # largest scale: 6 * 448 saturates
        elif kind == 4:
            sc = 1 + sc % 7  # subnormal scales
        raw[p, 8192:] = sc.to(dev)
    perm = torch.randperm(n_pages, generator=g)
    bt = perm[:len(lens) * width].view(len(lens), width).to(torch.int32).to(dev)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = random_index_q(len(lens) * Q_LEN, HEADS, dev, torch.Generator(device=dev).manual_seed(4))
    return q, cache, bt, seq


def check_decode(dev, variants, lens=ADVERSARIAL_LENS) -> list[tuple[str, str]]:
    from conformance.checks import tie_aware_check
    from nvfp4_indexer import reference as ref
    q, cache, bt, seq = adversarial_batch(dev, lens=lens)
    b = bt.shape[0]
    qsl = torch.arange(0, b * Q_LEN + 1, Q_LEN, dtype=torch.int32, device=dev)
    exact, mag = ref.page_scores(q, cache, bt, seq, qsl, with_magnitude=True)
    pos = seq.repeat_interleave(Q_LEN) - Q_LEN + torch.arange(Q_LEN, device=dev).repeat(b)
    local = torch.div(pos, 128, rounding_mode="floor")
    refsel = ref.decode_indexer(q, cache, bt, seq, Q_LEN)
    rows, base = [], None
    for name, kw in variants.items():
        try:
            out = torch.full((b * Q_LEN, HEADS, 16), -7, dtype=torch.int32, device=dev)
            if kw.get("_lab", 0) in SOL_LABS:
                rows.append((f"decode adversarial {name}", "ok: not checked (speed of light)"))
                continue
            runner = make_runner(b, bt.shape[1], dev, kw)
            runner.run(q, cache, bt, seq, out)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            res = tie_aware_check(out, exact, mag, local, runner.error_bits)
            eq_ref = float((out.cpu() == refsel.cpu()).all(-1).float().mean())
            msg = (f"tie-aware failures {res.failed} (b = {runner.error_bits}), rows == "
                   f"reference {eq_ref:.3f}")
            if runner.dequant in ("mma", "wgflat", "wgmma"):
                msg += f", {score_error_bits(runner, q, cache, bt, seq, exact, mag)}"
            if base is None:
                base = out
            else:
                msg += f", rows == base {float((out == base).all(-1).float().mean()):.3f}"
            verdict = ("ok: " if res.failed == 0 else "FAIL: ") + msg
        except Exception as e:  # noqa: BLE001
            verdict = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append((f"decode adversarial {name}", verdict))
        log(f"decode adversarial {name}: {verdict}")
    return rows


def score_error_bits(runner, q, cache, bt, seq, exact, mag) -> str:
    """The page-score kernel alone on a batch: the largest |score - exact| of a scored page
    as -log2 of its fraction of the row's magnitude (SPEC 9's e = 2^-b * mag: the observed b),
    and how many scored scores are bit-equal to the exact fp32 ones."""
    from nvfp4_indexer.triton import decode_wgmma
    b, w = bt.shape
    n = runner.block_m
    scores = torch.full((decode_wgmma.scratch_elems(b, w, n),), float("nan"), device=q.device)
    runner._page_score.run_score(q, cache, bt, seq, scores, num_blocks=cache.shape[0])
    torch.cuda.synchronize(q.device)
    got = scores.view(b, n, w)[:, :Q_LEN * HEADS].reshape(b, Q_LEN, HEADS, w) \
        .reshape(b * Q_LEN, HEADS, w).double()
    ex = exact.double()
    ok = torch.isfinite(ex) & torch.isfinite(got) & (mag[..., None] > 0)
    # rows score pages below their own local page only: compare those
    if not bool(ok.any()):
        return "no finite scored page"
    err = ((got - ex).abs() / mag[..., None].double())[ok]
    worst = float(err.max())
    bits = float("inf") if worst == 0 else -torch.log2(torch.tensor(worst)).item()
    equal = float((got[ok] == ex[ok]).double().mean())
    return f"observed b {bits:.1f} (worst |err| / mag {worst:.2e}), scores == exact {equal:.3f}"


# -------------------------------------------------------------------------------- 3. timing

def run_timing(dev, variants, cases, budget_s: float, graph_calls: int) -> list[dict]:
    from benchmarks import workloads as wl
    from benchmarks.pool import PagePool, random_index_q
    from benchmarks.timing import l2_bytes, rotation_slots, time_graph
    l2 = l2_bytes(dev)
    plans, total = [], 0
    for b, nominal in cases:
        sl = wl.make_seq_lens(b, nominal, Q_LEN)
        tr = wl.decode_traffic(sl, Q_LEN, HEADS)
        need = sum(wl.pages_needed(s) for s in sl)
        slots = rotation_slots(tr.pages_bytes, l2, graph_calls)
        plans.append((b, nominal, sl, tr, need, slots))
        total = max(total, need * slots)
    log(f"page pool: {total} pages ({total * 9216 / 1e9:.2f} GB), L2 {l2 / 1e6:.0f} MB")
    pool = PagePool(total, dev, seed=11, log=log)
    torch.cuda.synchronize(dev)
    log(f"pool filled ({pool.fill_backend})")
    recs = []
    for b, nominal, sl, tr, need, slots in plans:
        case = f"b{b}_s{nominal}"
        width = max(wl.pages_needed(s) for s in sl)
        tables = pool.block_tables(sl, slots, width)
        seq = torch.tensor(sl, dtype=torch.int32, device=dev)
        q = random_index_q(b * Q_LEN, HEADS, dev, torch.Generator(device=dev).manual_seed(b))
        base_out = None
        launches = {}  # effective launch -> the first variant timed with it
        for name, kw in variants.items():
            rec = {"case": case, "variant": name, "slots": slots,
                   "reuse_over_l2": (slots - 1) * tr.pages_bytes / l2 if l2 else None}
            if time.monotonic() - START > budget_s:
                rec["error"] = "skipped: lab time budget spent"
                recs.append(rec)
                continue
            try:
                runner = make_runner(b, width, dev, kw)
                # page-score modes: the flat grid's programs (P); else splits per request
                flat = runner.dequant in ("mma", "wgflat", "lut")
                rec["splits"] = f"P{runner.programs}" if flat else runner.num_splits
                launch = (runner.dequant, runner.dot, runner.num_splits, runner.window,
                          runner.num_warps, runner.num_stages, runner.maxnreg, runner.pdl,
                          runner.programs if flat else None, runner.lab)
                if launch in launches:
                    rec["error"] = f"same launch as {launches[launch]}: not timed again"
                    recs.append(rec)
                    log(f"{case} {name}: {rec['error']}")
                    continue
                launches[launch] = name
                out = torch.full((b * Q_LEN, HEADS, 16), -7, dtype=torch.int32, device=dev)
                runner.run(q, pool.cache, tables[0], seq, out)
                torch.cuda.synchronize(dev)
                if base_out is None and name == "base":
                    base_out = out.clone()
                if base_out is not None:
                    rec["rows_eq_base"] = float((out == base_out).all(-1).float().mean())
                outs = [torch.empty_like(out) for _ in range(2)]
                calls = [lambda bt=bt, o=outs[i % 2], r=runner, q=q, s=seq:
                         r.run(q, pool.cache, bt, s, o) for i, bt in enumerate(tables)]
                t = time_graph(calls, dev, graph_calls=graph_calls, warmup=2, replays=10)
                rec.update(us=t.us, cv=t.cv, gbps=tr.bytes_moved / (t.us * 1e-6) / 1e9)
            except Exception as e:  # noqa: BLE001
                torch.cuda.synchronize(dev)
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                traceback.print_exc(limit=2)
            recs.append(rec)
            log(f"{case} {name}: " + (f"{rec['us']:.1f} us, {rec['gbps']:.0f} GB/s"
                                      if "us" in rec else rec["error"]))
    return recs


def main(argv=None) -> int:
    global Q_LEN, HEADS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 variants, 2 cases")
    ap.add_argument("--budget-s", type=float, default=210.0,
                    help="stop starting timings after this many seconds (default 210)")
    ap.add_argument("--graph-calls", type=int, default=24)
    ap.add_argument("--variants", default=None, help="comma-separated subset of variants")
    ap.add_argument("--cases", default=None,
                    help="comma-separated BATCH:NOMINAL cases (default: the module's CASES)")
    ap.add_argument("--q-len", type=int, default=None,
                    help=f"query tokens per request Q (default {Q_LEN}), every step")
    ap.add_argument("--heads", type=int, default=None,
                    help=f"index heads H (default {HEADS}), every step")
    args = ap.parse_args(argv)
    Q_LEN = args.q_len or Q_LEN
    HEADS = args.heads or HEADS
    if not torch.cuda.is_available():
        print("dequant_lab: needs a CUDA GPU", flush=True)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    import triton

    from benchmarks.timing import copy_ceiling
    p = torch.cuda.get_device_properties(dev)
    log(f"{p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}")
    names = QUICK_VARIANTS if args.quick else tuple(VARIANTS)
    if args.variants:
        names = tuple(v.strip() for v in args.variants.split(","))
    variants = {n: VARIANTS[n] for n in names}
    if "base" not in variants:
        variants = {"base": {}, **variants}
    cases = CASES[:2] if args.quick else CASES
    if args.cases:
        try:
            cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
        except ValueError:
            ap.error(f"--cases: expected BATCH:NOMINAL,..., got {args.cases!r}")
    copy = copy_ceiling(dev)["gbps"]
    log(f"device copy: {copy:.0f} GB/s")
    checks = check_operands(dev)
    checks += check_decode(dev, variants)
    recs = run_timing(dev, variants, cases, args.budget_s, args.graph_calls)

    print("\n== correctness ==", flush=True)
    for what, verdict in checks:
        print(f"{what:58s} {verdict}")
    print(f"\n== timing (cold cache, CUDA graphs; copy = {copy:.0f} GB/s) ==")
    print(f"{'case':14s} {'variant':16s} {'splits':>6s} {'us/call':>9s} {'GB/s':>7s} "
          f"{'%copy':>6s} {'eq_base':>7s}  note")
    for r in recs:
        if "us" in r:
            print(f"{r['case']:14s} {r['variant']:16s} {str(r.get('splits', '')):>6} "
                  f"{r['us']:9.1f} {r['gbps']:7.0f} {100 * r['gbps'] / copy:5.1f}% "
                  f"{r.get('rows_eq_base', float('nan')):7.3f}  cv {r['cv']:.3f} "
                  f"slots {r['slots']} reuse/L2 {r['reuse_over_l2']:.1f}")
        else:
            print(f"{r['case']:14s} {r['variant']:16s} {'':>6} {'-':>9} {'-':>7} {'-':>6} "
                  f"{'-':>7}  {r['error']}")
    failed = [c for c in checks if not c[1].startswith(("ok", "bit-exact"))]
    print(f"\ncorrectness problems: {len(failed)}; total {time.monotonic() - START:.0f} s",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
