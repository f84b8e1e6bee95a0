"""The Gluon "mma" scorer (``triton.decode.mma``) compiles offline for sm_90a and sm_100a."""

from __future__ import annotations

from kernel_harness import sass_report_lines


def test_mma_scorer_compiles_offline():
    """The warp-per-split scorer compiles for sm_90a and sm_100a (no GPU): the A-operand
    conversions are register renamings (``assert_trivial``), nothing spills at the launcher's
    cap (``MMA_MAXNREG``: 3 one-warp programs per scheduler) up to ``MMA_MAX_ROWS`` rows,
    one m16n8k16 per (16 tokens, 8 rows, 16 dims) of a page, three cp.async per chunk of 16
    tokens (2 code runs of 16 bytes, 4 scale bytes per lane) and the 4-slot ring's 4.5 KB of
    shared memory. Nothing spills in the page loop; the request loop around it may spill a
    few registers once per request (Q1 H4: 2 LDL / STL)."""
    from nvfp4_indexer.triton.decode.dispatch import MMA_MAX_ROWS, MMA_MAXNREG
    lines = sass_report_lines("mma_report", (90, 100))
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
