"""One WORKLOADS.md case on a cold page pool, for a profiler (``ncu``) to attach to.

Usage (one GPU)::

    ncu --clock-control none --set full -k regex:_decode_score_kernel \\
        --launch-skip 2 --launch-count 1 -o decode \\
        python -m benchmarks.labs.profile_case decode 128 100000
    python -m benchmarks.labs.profile_case decode 1 32000 window=1 maxnreg=128  # config
    python -m benchmarks.labs.profile_case prefill 16384 32768 1   # new tokens, context, requests
    python -m benchmarks.labs.profile_case gather 16384 131072 4 page_parts=4 streaming=false
    python -m benchmarks.labs.profile_case prefill 16384 32768 1 tokens_on_n=false

- ``decode BATCH NOMINAL``: Q = 8, H = 4 requests of the WORKLOADS.md lengths, run through
  ``DecodeRunner.run`` (``key=value``: ``DecodeConfig`` fields).
- ``prefill NEW CONTEXT REQUESTS``: ``triton.prefill.prefill_indexer`` with the API's default
  gather budget (``key=value``: ``PrefillConfig`` fields, ``gather_X`` for its gather's, e.g.
  ``block_m=64``).
- ``gather NEW CONTEXT REQUESTS``: ``triton.prefill.gather.gather_into`` of the prefill case's
  history pages (``key=value``: ``GatherConfig`` fields, e.g. ``streaming=true``).

Each runs ``--calls`` times (default 3; the profiler picks the launch) on a page pool of
random NVFP4 keys just large enough for the case, prints what it ran, and exits with status 2
without a CUDA GPU (bad arguments: a usage error, status 2). ``key=value`` values are
``true`` / ``false`` (bools), ints, or strings such as ``dequant=ptx_arith``.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from .cli import lab_parser, require_gpu


def knob_value(text: str):
    """A ``key=value`` value: ``true`` / ``false`` (any case) -> bool, an integer -> int, else
    the string (e.g. ``dequant=ptx_arith``)."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    return int(text) if text.strip().lstrip("-").isdigit() else text.strip()


def config_of(kind: str, knobs: dict):
    """The tuning config of launcher ``kind`` ("decode", "prefill", "gather", "insert") with
    ``knobs`` applied by ``dataclasses.replace`` on its defaults; prefill keys ``gather_X``
    set field X of its nested ``GatherConfig``. Raises ``ValueError`` / ``TypeError`` for an
    unknown key or a bad value (the config's own checks)."""
    from nvfp4_indexer.triton import DecodeConfig, GatherConfig, InsertConfig, PrefillConfig
    default = {"decode": DecodeConfig, "prefill": PrefillConfig, "gather": GatherConfig,
               "insert": InsertConfig}[kind]()
    knobs = dict(knobs)
    if kind == "prefill":
        gather = {k[len("gather_"):]: knobs.pop(k) for k in list(knobs)
                  if k.startswith("gather_")}
        if gather:
            knobs["gather"] = dataclasses.replace(default.gather, **gather)
    return dataclasses.replace(default, **knobs)


def _knobs(items: list[str]) -> dict:
    kw = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"profile_case: expected key=value, got {item!r}")
        kw[key] = knob_value(val)
    return kw


def _pool(seq_lens: list[int], dev):
    from benchmarks import workloads as wl
    from benchmarks.pool import PagePool
    need = sum(wl.pages_needed(s) for s in seq_lens)
    width = max(wl.pages_needed(s) for s in seq_lens)
    pool = PagePool(need + 16, dev, seed=3)
    return pool, pool.block_tables(seq_lens, 1, width)[0], width


def run_decode(batch: int, nominal: int, kw: dict, calls: int) -> str:
    from benchmarks import workloads as wl
    from benchmarks.pool import random_index_q
    from nvfp4_indexer.triton.decode import DecodeRunner
    dev = torch.device("cuda")
    q_len, heads = wl.DECODE_QUERY_LEN, wl.DECODE_HEADS
    sl = wl.make_seq_lens(batch, nominal, q_len)
    pool, bt, width = _pool(sl, dev)
    seq = torch.tensor(sl, dtype=torch.int32, device=dev)
    q = random_index_q(batch * q_len, heads, dev, torch.Generator(device=dev).manual_seed(5))
    out = torch.empty((batch * q_len, heads, 16), dtype=torch.int32, device=dev)
    runner = DecodeRunner(heads, batch, width, q_len, dev, config=config_of("decode", kw))
    for _ in range(calls):
        runner.run(q, pool.cache, bt, seq, out)
    torch.cuda.synchronize()
    return (f"decode b{batch} x {nominal}: splits {runner.num_splits}, window {runner.window}, "
            f"keep {runner.keep}, history pages {sum(wl.history_pages(s) for s in sl)}")


def _prefill_setup(new: int, context: int, reqs: int):
    from benchmarks import workloads as wl
    case = wl.PrefillCase(new, context, reqs)
    dev = torch.device("cuda")
    sl = case.seq_lens()
    pool, bt, width = _pool(sl, dev)
    seq = torch.tensor(sl, dtype=torch.int32, device=dev)
    cu = torch.tensor(case.cu_seqlens_q(), dtype=torch.int32, device=dev)
    return case, dev, sl, pool, bt, width, seq, cu


def run_prefill(new: int, context: int, reqs: int, kw: dict, calls: int) -> str:
    import nvfp4_indexer as ni
    from benchmarks.pool import random_index_q
    from nvfp4_indexer.triton import prefill as tp
    case, dev, sl, pool, bt, width, seq, cu = _prefill_setup(new, context, reqs)
    q = random_index_q(case.new_tokens, case.num_heads, dev,
                       torch.Generator(device=dev).manual_seed(5))
    out = torch.empty((case.new_tokens, case.num_heads, 16), dtype=torch.int32, device=dev)
    mgp = ni.max_gather_pages(width * 128, case.new_tokens)
    cfg = config_of("prefill", kw)
    for _ in range(calls):
        tp.prefill_indexer(q, pool.cache, bt, cu, seq, mgp, out, config=cfg)
    torch.cuda.synchronize()
    return f"prefill {case.name}: width {width}, max_gather_pages {mgp}, seq_lens {sl[:4]}"


def run_gather(new: int, context: int, reqs: int, kw: dict, calls: int) -> str:
    from benchmarks import workloads as wl
    from nvfp4_indexer.triton.prefill import gather as tg
    case, dev, sl, pool, bt, width, seq, cu = _prefill_setup(new, context, reqs)
    pages = [wl.history_pages(s) for s in sl]
    offsets = torch.tensor([0] + pages, device=dev).cumsum(0).to(torch.int32)
    ws = torch.empty((max(sum(pages), 1), 128, 128), dtype=torch.float8_e4m3fn, device=dev)
    cfg = config_of("gather", kw)
    for _ in range(calls):
        tg.gather_into(pool.cache, bt, seq, offsets, ws, max(pages), config=cfg)
    torch.cuda.synchronize()
    return (f"gather {case.name}: {sum(pages)} pages, "
            f"{wl.gather_traffic(case).bytes_moved / 1e6:.1f} MB moved")


def main(argv=None) -> int:
    ap = lab_parser(__doc__)
    ap.add_argument("part", choices=("decode", "prefill", "gather"))
    ap.add_argument("sizes", nargs="+", help="decode: BATCH NOMINAL; prefill / gather: NEW "
                    "CONTEXT REQUESTS; then key=value tuning keywords")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes if "=" not in s]
    kw = _knobs([s for s in args.sizes if "=" in s])
    want = 2 if args.part == "decode" else 3
    if len(sizes) != want or not all(s.isdigit() for s in sizes):
        ap.error(f"{args.part} takes {want} non-negative integer sizes, got {sizes}")
    nums = [int(s) for s in sizes]
    if nums[0] < 1 or (args.part == "decode" and nums[1] < 1) or (
            args.part != "decode" and nums[2] < 1):
        ap.error(f"{args.part}: batch / new tokens / requests and the decode length must be "
                 f">= 1, got {nums}")
    require_gpu("profile_case")
    if args.part == "decode":
        msg = run_decode(*nums, kw, args.calls)
    elif args.part == "prefill":
        msg = run_prefill(*nums, kw, args.calls)
    else:
        msg = run_gather(*nums, kw, args.calls)
    print(msg, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
