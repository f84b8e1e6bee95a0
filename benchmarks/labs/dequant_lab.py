"""GPU lab for the Triton decode kernels: every dequant mode and tuning knob of ``DecodeConfig``.

Run (one H100 / H200, about 2-4 minutes)::

    python -m benchmarks.labs.dequant_lab            # every variant
    python -m benchmarks.labs.dequant_lab --quick    # fewer variants, two cases
    python -m benchmarks.labs.dequant_lab --variants base,mma,wgf --cases 8:100000
    python -m benchmarks.labs.dequant_lab --variants base,ptx,mma --cases 8:4000,8:4000:8192

A variant is a set of ``DecodeConfig`` fields (``VARIANTS``); "base" is the default dispatch.
Steps (progress is printed and flushed as it goes; a compact table comes last):

1. Correctness on a small adversarial batch (B=8, Q=8, H=4; pages with NaN scale bytes
   0x7F/0xFF, negative, maximal 0x7E and subnormal scales, random codes): every variant
   against the default path (rows identical) and against the exact reference scores
   (SPEC 9 tie-aware, at the runner's b); for the page-score modes the observed error bits
   of the score kernel alone.
2. Timing: decode variants on b128 x 100K, b8 x 100K, b32 x 10K, b1 x 32K, b8 x 4K and
   b128 x 1K (Q=8, H=4; ``--cases BATCH:LEN[:WIDTH]``: LEN the nominal context tokens per
   request, WIDTH pages of block table as an engine sizes it for ``max_model_len``, else the
   contexts' own), cold cache (a page pool far larger than L2, block tables rotated
   across >= 2x L2 of traffic, ``benchmarks.pool`` / ``timing``), CUDA-graph replays: us/call,
   GB/s of necessary traffic (``workloads.decode_traffic``) and % of the device-to-device copy
   measured in this run. A variant whose plan equals an earlier one's on a case is not timed
   again.
A variant that fails (compile error, wrong result) is reported and the lab goes on.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch

from .cli import gpu_args, lab_parser

START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {msg}", flush=True)


# Variants: name -> DecodeConfig fields (``profile_case.config_of``: dataclasses.replace on
# the default config).
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
    "mma pps11": {"dequant": "mma", "programs_per_sm": 11},
    "mma pps24": {"dequant": "mma", "programs_per_sm": 24},
    "mma ns256": {"dequant": "mma", "num_splits": 256},
    "mma s2": {"dequant": "mma", "ring_stages": 2},
    "mma s8": {"dequant": "mma", "ring_stages": 8},
    "wgf": {"dequant": "wgflat"},
    "wgf s8": {"dequant": "wgflat", "ring_stages": 8},
    "wgf pps3": {"dequant": "wgflat", "programs_per_sm": 3},
    "wgf pps5": {"dequant": "wgflat", "programs_per_sm": 5},
    "wgf pps5 r96": {"dequant": "wgflat", "programs_per_sm": 5, "maxnreg": 96},
    # the same scorer with E4M3 operands (dot "fp8": ``lut.LUT_E4M3_ASM``, fp8 wgmma, b = 5)
    "wgf8": {"dequant": "wgflat", "dot": "fp8"},
    "wgf8 pps5": {"dequant": "wgflat", "dot": "fp8", "programs_per_sm": 5},
    "wgf8 s8": {"dequant": "wgflat", "dot": "fp8", "ring_stages": 8},
    "pps2": {"programs_per_sm": 2},
    "pps4": {"programs_per_sm": 4},
    "pps8": {"programs_per_sm": 8},
    "pps32": {"programs_per_sm": 32},
    "ns64": {"num_splits": 64},
    "ns250": {"num_splits": 250},
}
QUICK_VARIANTS = ("base", "ptx", "wg", "pps8")


def make_runner(b, width, dev, kw):
    """A ``DecodeRunner`` of B = ``b`` requests, block tables ``width`` wide, for the
    ``DecodeConfig`` fields ``kw``."""
    from nvfp4_indexer.triton.decode import DecodeRunner

    from .profile_case import config_of
    return DecodeRunner(HEADS, b, width, Q_LEN, dev, config=config_of("decode", kw))


CASES = [(128, 100_000), (8, 100_000), (32, 10_000), (1, 32_000), (8, 4_000),
         (128, 1_000)]  # (batch, nominal len)
Q_LEN, HEADS = 8, 4


# ------------------------------------------------------------------- 1. decode correctness

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
    from nvfp4_indexer.conformance.checks import tie_aware_check
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
    from nvfp4_indexer.triton.decode.page_scores import PageScoreLaunch
    b, w = bt.shape
    n = runner.block_m
    scores = torch.full((runner.plan.win_elems,), float("nan"), device=q.device)
    PageScoreLaunch(runner.plan).run_score(q, cache, bt, seq, scores, num_blocks=cache.shape[0])
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


# -------------------------------------------------------------------------------- 2. timing

def run_timing(dev, variants, cases, budget_s: float, graph_calls: int) -> list[dict]:
    from benchmarks import workloads as wl
    from benchmarks.pool import PagePool, random_index_q
    from benchmarks.timing import l2_bytes, rotation_slots, time_graph
    l2 = l2_bytes(dev)
    plans, total = [], 0
    for b, nominal, *wide in cases:
        sl = wl.make_seq_lens(b, nominal, Q_LEN)
        tr = wl.decode_traffic(sl, Q_LEN, HEADS)
        need = sum(wl.pages_needed(s) for s in sl)
        slots = rotation_slots(tr.pages_bytes, l2, graph_calls)
        plans.append((b, nominal, wide[0] if wide else 0, sl, tr, need, slots))
        total = max(total, need * slots)
    log(f"page pool: {total} pages ({total * 9216 / 1e9:.2f} GB), L2 {l2 / 1e6:.0f} MB")
    pool = PagePool(total, dev, seed=11, log=log)
    torch.cuda.synchronize(dev)
    log(f"pool filled ({pool.fill_backend})")
    recs = []
    for b, nominal, wide, sl, tr, need, slots in plans:
        case = f"b{b}_s{nominal}" + (f"_w{wide}" if wide else "")
        width = wide or max(wl.pages_needed(s) for s in sl)
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
                launch = repr(runner.plan)  # the kernels and every launch parameter
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
    ap = lab_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="4 variants, 2 cases")
    ap.add_argument("--budget-s", type=float, default=210.0,
                    help="stop starting timings after this many seconds (default 210)")
    ap.add_argument("--graph-calls", type=int, default=24)
    ap.add_argument("--variants", default=None, help="comma-separated subset of variants")
    ap.add_argument("--cases", default=None,
                    help="comma-separated BATCH:LEN[:WIDTH] cases (LEN: nominal context "
                         "tokens per request; WIDTH: block-table pages, default the contexts' "
                         "own; default cases: the module's CASES)")
    ap.add_argument("--q-len", type=int, default=None,
                    help=f"query tokens per request Q (default {Q_LEN}), every step")
    ap.add_argument("--heads", type=int, default=None,
                    help=f"index heads H (default {HEADS}), every step")
    args = gpu_args(ap, argv, "dequant_lab")
    Q_LEN = args.q_len or Q_LEN
    HEADS = args.heads or HEADS
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
            if any(len(c) not in (2, 3) for c in cases):
                raise ValueError(args.cases)
        except ValueError:
            ap.error(f"--cases: expected BATCH:LEN[:WIDTH],..., got {args.cases!r}")
    copy = copy_ceiling(dev)["gbps"]
    log(f"device copy: {copy:.0f} GB/s")
    checks = check_decode(dev, variants)
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
