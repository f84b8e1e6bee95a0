"""GPU lab (issue 15): the prefill merge kernel alone, 15 rounds against the bitonic top-16.

    python -m benchmarks.labs.merge_lab                       # the shapes the Gluon rule merges
    python -m benchmarks.labs.merge_lab --shape 128:2:16      # ROW_BLOCKS:SPLITS:KEEP
    python -m benchmarks.labs.merge_lab --config 8:2          # also SORT 1 at ROWS:WARPS

Per shape (BLOCK_M 128, H = 4, one request whose rows all score >= 16 pages), a candidate
scratch of distinct random keys (a fifth of the slots EMPTY) is merged by
``prefill._prefill_merge_kernel`` with ``SORT`` 0 (15 rounds of max-and-remove) and 1 (one
bitonic top-16 where a row has 16-64 candidate columns, ``topk.write_selection(SORT=1)``),
each at ``heuristics.merge_config``'s rows per program (since session 20 several rows where
it sorts; "SORT 1" lines of older records are one row per program), and ``--config``'s:
every output is compared bit for bit with SORT 0's, then each launch is timed alone in CUDA-graph
replays (the scratch stays L2-resident, as right after a score kernel). Default shapes:
128 / 512 row blocks x 2 splits (4K / 16K new tokens with context), 32 x 4 (1K x 32K), 64 x
2 (2K chunks) and 8 x 16 (the four-request cases' chunks: 256 columns, the rounds either
way). Exits with status 2 without a CUDA GPU.
"""

from __future__ import annotations

import argparse

import torch

DEFAULT_SHAPES = [(128, 2, 16), (512, 2, 16), (32, 4, 16), (64, 2, 16), (8, 16, 16)]
HEADS, BLOCK_M = 4, 128


def merge_inputs(row_blocks: int, num_splits: int, keep: int, device, *, heads: int = HEADS,
                 block_m: int = BLOCK_M, seed: int = 0) -> dict:
    """The merge kernel's arguments for one request of ``row_blocks * block_m / heads`` new
    tokens after 32K cached (every row long): a candidate scratch int64
    ``[row_blocks * block_m, num_splits, keep]`` of distinct keys with ~20 % EMPTY, the
    request's metadata, the row-block table and a poisoned ``out`` (-99)."""
    from nvfp4_indexer.triton.topk import EMPTY
    rows = row_blocks * block_m
    tokens = -(-rows // heads)
    gen = torch.Generator().manual_seed(seed)
    n = rows * num_splits * keep
    ids = torch.randperm(max(2 * n, 1 << 16), generator=gen)[:n].to(torch.int64)
    scores = torch.randint(-2 ** 31, 2 ** 31, (n,), generator=gen, dtype=torch.int64)
    cand = (scores << 32) | (0xFFFFFFFF - ids)  # distinct: the ids differ
    cand[torch.rand(n, generator=gen) < 0.2] = int(EMPTY.value)
    seq = tokens + 32768
    return dict(
        cand=cand.to(device), qsl=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq=torch.tensor([seq], dtype=torch.int32, device=device),
        blk=torch.tensor([0] * row_blocks + [i * block_m for i in range(row_blocks)],
                         dtype=torch.int32, device=device),
        out=torch.full((tokens, heads, 16), -99, dtype=torch.int32, device=device),
        row_blocks=row_blocks, num_splits=num_splits, keep=keep, heads=heads, block_m=block_m)


def launch_merge(inp: dict, sort: int, config: tuple[int, int] | None = None) -> None:
    """One merge launch over ``inp`` (``merge_inputs``): ``config`` ``(rows per program,
    warps)``, by default ``heuristics.merge_config``'s; writes ``inp["out"]``."""
    from nvfp4_indexer.triton import heuristics as hz
    from nvfp4_indexer.triton.prefill import _prefill_merge_kernel
    rows, warps = config or hz.merge_config(inp["num_splits"], inp["keep"], sort=bool(sort))
    nb = inp["row_blocks"]
    _prefill_merge_kernel[(nb, -(-inp["block_m"] // rows))](
        inp["cand"], inp["qsl"], inp["seq"], inp["seq"], inp["blk"], nb, inp["out"],
        H=inp["heads"], BLOCK_M=inp["block_m"], NUM_SPLITS=inp["num_splits"],
        SPLITS_PAD=hz.next_pow2(inp["num_splits"]), ROWS=rows, KEEP=inp["keep"], SORT=sort,
        num_warps=warps)


def parse_shape(text: str) -> tuple[int, int, int]:
    """``ROW_BLOCKS:SPLITS:KEEP`` -> ints (argparse type)."""
    try:
        shape = tuple(int(v) for v in text.split(":"))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1 or shape[2] not in (1, 2, 4, 8, 16):
        raise argparse.ArgumentTypeError(
            f"expected ROW_BLOCKS:SPLITS:KEEP (positive, KEEP a power of two <= 16), got {text!r}")
    return shape


def parse_config(text: str) -> tuple[int, int]:
    """``ROWS:WARPS`` -> ints (argparse type)."""
    try:
        rows, warps = (int(v) for v in text.split(":"))
    except ValueError:
        rows = warps = 0
    if rows not in (1, 2, 4, 8, 16, 32, 64, 128) or warps not in (1, 2, 4, 8):
        raise argparse.ArgumentTypeError(
            f"expected ROWS:WARPS (powers of two, rows <= 128, warps <= 8), got {text!r}")
    return rows, warps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", type=parse_shape, default=[],
                    metavar="ROW_BLOCKS:SPLITS:KEEP", help="instead of the default shapes")
    ap.add_argument("--config", action="append", type=parse_config, default=[],
                    metavar="ROWS:WARPS", help="also time SORT 1 at these rows per program "
                    "and warps (output compared with the default launch's)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("merge_lab: needs a CUDA GPU", flush=True)
        return 2
    from . import knob_lab as kl
    ctx = kl.make_context(600)
    for nb, ns, keep in args.shape or DEFAULT_SHAPES:
        inp = merge_inputs(nb, ns, keep, ctx.device)
        outs = []
        for sort in (0, 1):
            inp["out"].fill_(-99)
            launch_merge(inp, sort)
            torch.cuda.synchronize()
            outs.append(inp["out"].clone())
        same = bool(torch.equal(outs[0], outs[1])) and bool((outs[0] != -99).all())
        name = f"{nb}x{ns}x{keep}"
        rows = nb * BLOCK_M
        for sort in (0, 1):
            t = ctx.time_capturable([lambda sort=sort: launch_merge(inp, sort)])
            kl._record("merge", name, f"SORT {sort}", t.us, rows / t.us, "rows/us",
                       same, t.method)
        for cfg in args.config:
            inp["out"].fill_(-99)
            launch_merge(inp, 1, cfg)
            torch.cuda.synchronize()
            ok = bool(torch.equal(inp["out"], outs[0]))
            t = ctx.time_capturable([lambda cfg=cfg: launch_merge(inp, 1, cfg)])
            kl._record("merge", name, f"SORT 1 rows {cfg[0]} warps {cfg[1]}", t.us,
                       rows / t.us, "rows/us", ok, t.method)
    kl.print_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
