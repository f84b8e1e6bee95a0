"""The Gluon "wgmma" scorer (``triton.decode.wgmma``) compiles offline for sm_90a."""

from __future__ import annotations

from kernel_harness import sass_report_lines


def test_wgmma_scorer_compiles_offline_for_sm90():
    """The Gluon scorer compiles for sm_90a (no GPU): the A-operand conversions are register
    renamings (``assert_trivial``), nothing spills (no LDL / STL: "0 B local" alone cannot
    see spills), 16 wgmma per page (2 halves x 8 k-steps), and at Q*H <= 32 rows it fits 4
    CTAs of 128 threads per SM (<= 128 registers)."""
    lines = sass_report_lines("wgmma_report")
    assert len(lines) == 4, lines
    for ln in lines:
        regs = int(ln.split(": ")[1].split()[0])
        assert " 0 B local, 0 LDL/STL" in ln and "16 wgmma" in ln, ln
        if "N 64" not in ln:
            assert regs <= 128, ln
