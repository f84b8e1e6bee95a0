"""``triton.prefill.prefill``: the Triton prefill score and merge kernels (SPEC 4, 5, 7, 10).

The score kernel's selections against the reference run through ``prefill_indexer``
(``test_launch.py``); here: the merge kernel's bitonic top-16 equals its 15 rounds, and the
workspace page offsets both scorers use are int64.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernel_harness import DEV
from nvfp4_indexer.triton.heuristics import merge_config, next_pow2
from nvfp4_indexer.triton.layout import ws_page_offset
from nvfp4_indexer.triton.prefill import prefill as P
from nvfp4_indexer.triton.prefill.prefill import prefill_merge_kernel

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


@pytest.mark.parametrize("num_splits,keep", [(2, 16), (3, 8), (4, 16), (2, 4), (16, 16)])
@pytest.mark.parametrize("seq_len", [5 * 128 + 7, 40 * 128 + 9])
def test_prefill_merge_sort_equals_rounds(num_splits, keep, seq_len):
    """The prefill merge kernel's bitonic top-16 selection (``SORT=1``,
    ``topk.write_selection(SORT=1)``) writes exactly what the 15 rounds of max-and-remove
    write (``SORT=0``): distinct random keys with EMPTY slots (a row with fewer than 15 real
    candidates included), padded split columns (3 splits), rows short (L <= 15: the rounds
    skipped) or long, and the fallback to the rounds below 16 and above 64 columns (2 x 4,
    16 x 16), at one row per program, at ``merge_config``'s rows and at 32 rows (more than
    BLOCK_M); rows past the request stay poisoned (SPEC 5, 10)."""
    from nvfp4_indexer.triton.topk import EMPTY
    H, block_m, tokens = 4, 16, 7
    rows = tokens * H
    nb = -(-rows // block_m)
    gen = torch.Generator().manual_seed(num_splits * 100 + keep + seq_len)
    n = nb * block_m * num_splits * keep
    ids = torch.randperm(2 ** 20, generator=gen)[:n].to(torch.int64)
    scores = torch.randint(-2 ** 31, 2 ** 31, (n,), generator=gen, dtype=torch.int64)
    cand = (scores << 32) | (0xFFFFFFFF - ids)  # distinct: the ids differ
    cand[torch.rand(n, generator=gen) < 0.2] = int(EMPTY.value)
    cand.view(nb * block_m, -1)[3, 2:] = int(EMPTY.value)  # row 3: two real candidates
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    seq = torch.tensor([seq_len], dtype=torch.int32)
    blk = torch.tensor([0] * nb + [i * block_m for i in range(nb)], dtype=torch.int32)
    outs = []
    # (SORT, rows per program): one row, merge_config's rows, and 32 rows (> BLOCK_M)
    for sort, rows_pp in ((0, 1), (1, 1), (1, merge_config(num_splits, keep, sort=True)[0]),
                          (1, 32)):
        out = torch.full((tokens + 2, H, 16), -99, dtype=torch.int32)
        prefill_merge_kernel[(nb, -(-block_m // rows_pp))](
            cand.to(DEV), qsl.to(DEV), seq.to(DEV), seq.to(DEV), blk.to(DEV), nb,
            out_dev := out.to(DEV), H=H, BLOCK_M=block_m, NUM_SPLITS=num_splits,
            SPLITS_PAD=next_pow2(num_splits), ROWS=rows_pp, KEEP=keep, SORT=sort)
        outs.append(out_dev.cpu())
    for got in outs[1:]:
        assert torch.equal(got, outs[0])
    assert bool((outs[1][tokens:] == -99).all()) and bool((outs[1][:tokens] != -99).all())
    if seq_len > 16 * 128:  # long rows: the 15 best of each row's candidates, in order
        keys = cand.view(nb * block_m, -1)
        for r in (0, 3, rows - 1):
            live = keys[r][keys[r] != int(EMPTY.value)]
            best = live.sort(descending=True).values[:15]
            want = (0xFFFFFFFF - (best & 0xFFFFFFFF)).to(torch.int32)
            got = outs[1][r // H, r % H, :len(want)]
            assert torch.equal(got, want), r


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

    from nvfp4_indexer.triton.prefill import prefill_wgmma as PW
    pages = [0, 1, 131071, 131072, 131073, 2**24, 2**31 - 1]
    j = torch.tensor(pages + [0], dtype=torch.int32, device=DEV)
    out = torch.zeros(8, dtype=torch.int64, device=DEV)
    _ws_offsets_kernel[(1,)](j, out, N=8)
    assert out.tolist()[:len(pages)] == [p * 128 * 128 for p in pages]
    for fn in (P._ws_page_scores, PW._converter):
        src = inspect.getsource(fn.fn)
        assert "ws_page_offset(" in src and "* WS_PAGE" not in src, fn
