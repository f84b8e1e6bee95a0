"""The Gluon "wgflat" scorer (``triton.decode.wgflat``): compiles offline for sm_90a; refused
above 32 rows."""

from __future__ import annotations

import pytest

from kernel_harness import DEV, K, sass_report_lines

DECODE = K["decode.runner"]


def test_wgflat_scorer_compiles_offline_for_sm90():
    """The page-per-warp wgmma scorer compiles for sm_90a (no GPU): the A-operand conversions
    are register renamings (``assert_trivial``), nothing spills (LDL / STL counted), at most
    128 registers (``WGFLAT_PROGRAMS_PER_SM`` = 4 programs of 4 warps fit an SM), the group
    loop (four pages, one per warp) holds its 64 HGMMA (8 chunks x 2 halves x 4 k-steps),
    33 cp.async (3 copies per chunk: 3 chunks before the loop, 8 in it) and the shared memory
    is the 4-slot ring (18 KB) plus the query (256 B per row)."""
    from nvfp4_indexer.triton.decode.dispatch import WGFLAT_PROGRAMS_PER_SM
    lines = sass_report_lines("wgflat_report")
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
