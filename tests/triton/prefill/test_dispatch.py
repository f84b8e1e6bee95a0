"""``triton.prefill.dispatch``: the prefill and gather rule table (host only, no kernel).

Which chunks take the Gluon kernel (only those whose splits keep 16 candidates, with BLOCK_M
128, when allowed), its split rule, the scratch cap, the Triton kernel's pipeline depth, row
blocks, the gather's PAGES, grid and request ranges.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_harness import DEV, HAS_CUDA
from nvfp4_indexer.triton.prefill import dispatch as D


def test_dispatch_rule():
    """The Gluon kernel takes exactly the chunks whose splits keep 16 candidates (> 8 pages)
    at BLOCK_M 128, when allowed; it inserts per page: window 1, no window scratch."""
    big = D.prefill_launch(512, 1023, 128, 132, wgmma=True)
    assert big["kernel"] == "wgmma" and big["win"] == 1 and big["win_elems"] == 0
    assert big["scratch"] == 2 * big["cand"]
    tri = D.prefill_launch(512, 1023, 128, 132)
    assert tri["kernel"] == "triton" and tri["win"] == 32 and tri["ns"] == 3
    # its own split target: at most 1 program per SM (one wave), at least 2, at most the
    # Triton rule's
    assert big["ns"] == 2
    assert D.prefill_launch(128, 1023, 128, 132, wgmma=True)["ns"] == 2  # Triton: 9
    assert D.prefill_launch(32, 1023, 128, 132, wgmma=True)["ns"] == 4  # 128 <= 132 programs
    assert D.prefill_launch(64, 1023, 128, 132, wgmma=True)["ns"] == 2
    assert D.prefill_launch(8, 1023, 128, 132, wgmma=True)["ns"] == 16
    for blocks in (1, 7, 32, 33, 64, 100, 128, 132, 200, 264):
        lp = D.prefill_launch(blocks, 1023, 128, 132, wgmma=True)
        assert lp["kernel"] == "wgmma" and lp["keep"] == 16, blocks
        assert lp["ns"] == 2 or blocks * lp["ns"] <= 132, (blocks, lp["ns"])
    assert D.prefill_launch(2048, 1023, 128, 132, wgmma=True)["ns"] == 1  # Triton: 1
    assert D.prefill_launch(512, 1023, 128, 132, num_splits=5, wgmma=True)["ns"] == 5
    assert D.prefill_launch(512, 1023, 64, 132, wgmma=True)["kernel"] == "triton"
    assert D.prefill_launch(512, 1023, 32, 132, wgmma=True)["kernel"] == "triton"
    assert D.prefill_launch(4, 9, 128, 132, num_splits=1, wgmma=True)["kernel"] == "wgmma"
    assert D.prefill_launch(4, 8, 128, 132, num_splits=1, wgmma=True)["kernel"] == "triton"
    assert D.prefill_launch(4, 0, 128, 132, wgmma=True)["kernel"] == "triton"  # all short
    assert D.prefill_launch(512, 1023, 128, 132, window=8, wgmma=True)["win"] == 1


def test_prefill_wgmma_ok():
    """Tokens on N, dot fp16 / fp8, a CUDA SM90 GPU with Gluon; never on the CPU."""
    cpu = torch.device("cpu")
    assert not D.prefill_wgmma_ok(cpu, "fp16", True)
    assert not D.prefill_wgmma_ok(cpu, "fp8", True)
    if HAS_CUDA and torch.cuda.get_device_capability() == (9, 0):
        dev = torch.device(DEV)
        assert D.prefill_wgmma_ok(dev, "fp16", True)
        assert not D.prefill_wgmma_ok(dev, "fp16", False)
        assert not D.prefill_wgmma_ok(dev, "bf16", True)
        assert D.prefill_wgmma_ok(dev, "fp8", True)
        assert not D.prefill_wgmma_ok(dev, "fp8", False)


def test_dispatch_rule_short_splits():
    """Chunks of few row blocks, whose Triton-rule splits are short (keep < 16), take the Gluon
    kernel with fewer splits of > 8 pages each (its own target, capped so that every split
    keeps 16); 8 pages cannot keep 16 in any split, nor explicit splits of <= 8 pages."""
    cases = {  # (row blocks, score pages): (Triton rule's splits, keep), Gluon splits
        (32, 263): ((33, 8), 4),  # 1K new tokens x 32K: 33 x 8 pages -> 4 x 66
        (8, 1025): ((132, 8), 16),  # 256 x 128K (an Indexer chunk of 1K x 128K x 4)
        (8, 257): ((65, 4), 16),  # 256 x 32K (an Indexer chunk of 1K x 32K x 4)
        (16, 60): ((15, 4), 7),  # capped: 7 x 9 pages (its target, 8 x 8, would keep 8)
        (32, 31): ((8, 4), 3),
        (4, 9): ((3, 4), 1),
    }
    for (blocks, pages), ((tns, tkeep), gns) in cases.items():
        tri = D.prefill_launch(blocks, pages, 128, 132)
        assert (tri["kernel"], tri["ns"], tri["keep"]) == ("triton", tns, tkeep), (blocks, pages)
        g = D.prefill_launch(blocks, pages, 128, 132, wgmma=True)
        assert (g["kernel"], g["ns"], g["keep"], g["win"]) == ("wgmma", gns, 16, 1), (blocks,
                                                                                   pages)
        assert -(-pages // g["ns"]) > 8
    assert D.prefill_launch(4, 8, 128, 132, wgmma=True)["kernel"] == "triton"
    assert D.prefill_launch(32, 255, 128, 132, num_splits=33, wgmma=True)["kernel"] == "triton"
    assert D.prefill_launch(32, 1023, 128, 132, wgmma=True)["ns"] == 4


def test_dispatch_rule_unsplit():
    """From ``PREFILL_WGMMA_UNSPLIT_BLOCKS_PER_SM`` row blocks per SM (two waves) the Gluon
    kernel runs unsplit (no merge launch) when the blocks score at most
    ``PREFILL_WGMMA_UNSPLIT_MAX_PAGES`` pages; longer blocks and fewer blocks keep the floor
    of 2 splits."""
    assert D.PREFILL_WGMMA_UNSPLIT_BLOCKS_PER_SM * 132 == 264
    assert D.PREFILL_WGMMA_UNSPLIT_MAX_PAGES == 512
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
        g = D.prefill_launch(blocks, pages, 128, 132, wgmma=True)
        assert (g["kernel"], g["ns"], g["keep"]) == ("wgmma", ns, 16), (blocks, pages)
        assert g["cand"] == (0 if ns == 1 else blocks * 128 * ns * 16)
        # the Triton kernel's rule is not changed by it
        assert D.prefill_launch(blocks, pages, 128, 132)["ns"] >= 2, (blocks, pages)
    assert D.prefill_launch(512, 383, 128, 132, num_splits=2, wgmma=True)["ns"] == 2


def test_cap_counts_only_the_gluon_scratch():
    """Under a scratch cap (the Indexer's shared buffer) the Gluon launch keeps the splits whose
    candidates fit: the window scratch it does not use is not counted."""
    tri = D.prefill_launch(512, 1023, 128, 132, num_splits=3)
    cap = 2 * tri["cand"] + tri["win_elems"] - 1  # the Triton launch's scratch does not fit
    assert D.prefill_launch(512, 1023, 128, 132, num_splits=3, cap=cap)["ns"] == 1
    g = D.prefill_launch(512, 1023, 128, 132, num_splits=3, cap=cap, wgmma=True)
    assert g["kernel"] == "wgmma" and g["ns"] == 3 and g["win"] == 1
    assert g["scratch"] == 2 * g["cand"] <= cap
    g = D.prefill_launch(512, 1023, 128, 132, num_splits=3, cap=2 * g["cand"] - 1,
                         wgmma=True)
    assert g["kernel"] == "wgmma" and g["ns"] == 1 and g["scratch"] == 0


def test_prefill_stages_rule():
    """The Triton score kernel's default pipeline depth (``prefill_launch``'s ``stages``):
    3 stages from ``PREFILL_DEEP_PIPELINE_PAGES`` pages per split (the longest split), 2
    below and for chunks whose rows are all short; an explicit ``num_splits`` moves it."""
    deep = D.PREFILL_DEEP_PIPELINE_PAGES
    assert D.prefill_launch(4, 0, 128, 132)["stages"] == 2  # every row short: no pages
    assert D.prefill_launch(4, deep, 128, 132, num_splits=1)["stages"] == 3
    assert D.prefill_launch(4, deep - 1, 128, 132, num_splits=1)["stages"] == 2
    assert D.prefill_launch(4, 2 * deep, 128, 132, num_splits=2)["stages"] == 3
    assert D.prefill_launch(4, 2 * deep, 128, 132, num_splits=3)["stages"] == 2
    # the benchmark's shapes: 16K x 128K (512 blocks) deep, 1K x 128K (32 blocks) shallow
    assert D.prefill_launch(512, 1151, 128, 132)["stages"] == 3
    assert D.prefill_launch(32, 1031, 128, 132)["stages"] == 2


def _row_blocks_loop(q_lens, seq_lens, h, block_m):
    """The row-block rule written out row by row: (request, first row, L of the last row)."""
    out = []
    for r, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for row0 in range(0, q * h, block_m):
            t_last = (min(row0 + block_m, q * h) - 1) // h
            out.append((r, row0, max(s - q + t_last, 0) // 128))
    return out


@pytest.mark.parametrize("n", [1, 2, 5])
def test_plan_row_blocks(n):
    """``plan_row_blocks`` (numpy, one request or several) equals the rule written row by row:
    blocks never span two requests, token-major rows, L of each block's last row; requests
    without rows have no block; ``pages=False`` leaves the pages out."""
    gen = np.random.default_rng(n)
    for h in (1, 2, 4):
        for bm in (16, 64, 128):
            q = gen.integers(0 if n > 1 else 1, 300, n)
            s = q + gen.integers(0, 5000, n)
            got = D.plan_row_blocks(q.astype(np.int64), s.astype(np.int64), h, bm)
            assert list(zip(*(x.tolist() for x in got))) == _row_blocks_loop(q, s, h, bm)
            reqs, row0s = D.plan_row_blocks(q.astype(np.int64), s.astype(np.int64), h, bm,
                                            pages=False)
            assert reqs.tolist() == got[0].tolist() and row0s.tolist() == got[1].tolist()


def test_prefill_block_m_and_pages_needed():
    """BLOCK_M: the longest request's rows as a power of two in 16..cap; a request gathers
    its last query's history pages unless every row is short (L <= 15)."""
    assert D.prefill_block_m(1, 1) == 16 and D.prefill_block_m(20, 4) == 128
    assert D.prefill_block_m(5, 4) == 32 and D.prefill_block_m(100, 4, cap=64) == 64
    assert D.gather_pages_needed([1, 129, 16 * 128, 16 * 128 + 1, 17 * 128 + 1]) == \
        [0, 0, 0, 16, 17]


def test_gather_pages_per_program_rule():
    """The default PAGES: 2 exactly when one page per program takes more than one and at
    most two waves of resident programs (32 one-warp programs per SM, fewer for wider ones),
    counting the pages the grid covers (min(max_pages, width))."""
    f = D.gather_pages_per_program
    sms = 132
    wave = 32 * sms  # 4224 one-warp programs
    assert f(1, wave // 8, 1024, 8, 1, None, sms) == 1  # exactly one wave
    assert f(1, wave // 8 + 1, 1024, 8, 1, None, sms) == 2
    assert f(4, wave // 16, 1024, 8, 1, None, sms) == 2  # exactly two waves
    assert f(4, wave // 16 + 1, 1024, 8, 1, None, sms) == 1
    assert f(1, 10 ** 6, 600, 8, 1, None, sms) == 2  # the width bounds the grid: 1.14 waves
    assert f(1, 600, 600, 8, 4, None, sms) == 1  # 4-warp programs: 16 per SM, 2.27 waves
    assert f(1, 600, 600, 8, 2, None, sms) == 2  # 2-warp programs: still 32 per SM


def test_gather_grid_and_request_ranges():
    """The grid covers ceil(min(max_pages, W) / PAGES) page groups times the page parts; the
    requests are split into launches of at most ``MAX_GRID_Y``."""
    assert D.gather_grid(17, 40, 8, 2) == 9 * 8
    assert D.gather_grid(50, 40, 1, 1) == 40
    assert D.gather_request_ranges(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert D.gather_request_ranges(0) == []
    n = D.MAX_GRID_Y + 3
    assert D.gather_request_ranges(n) == [(0, D.MAX_GRID_Y), (D.MAX_GRID_Y, n)]


def test_gather_defaults():
    """Interpreter: whole pages in one 128-token step, one program per page; the portable /
    CPU dequant is "triton"; TOK_BLOCK is capped at a page part's tokens."""
    dequant, tok, warps, parts, stream = D.gather_defaults("cpu", True, None, None, None, None,
                                                           None)
    assert dequant == "triton" and warps == D.GATHER_NUM_WARPS and stream == D.GATHER_STREAMING
    assert D.gather_defaults("cpu", True, None, 128, None, 4, None)[1] == 32
