"""The Gluon redux kernels (``triton.decode.redux``): the merge against the Triton merge bit for
bit on a GPU; the select / merge / split select compile offline for sm_90a and sm_100a."""

from __future__ import annotations

import pytest
import torch

from kernel_harness import (  # sets TRITON_INTERPRET before the kernels are imported
    DEV, assert_guards, sass_report_lines, poisoned_out)

import triton  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


@pytest.mark.gpu
@pytest.mark.parametrize("q_len,heads", [(8, 4), (1, 1), (3, 2), (8, 8)])
@pytest.mark.parametrize("splits,keep", [(2, 16), (10, 4), (249, 1), (32, 16)])
def test_gpu_redux_merge_matches_triton_merge(splits, keep, q_len, heads):
    """The Gluon merge of split candidates (``redux_merge_kernel``, C = splits * keep up to
    512 per row) writes exactly what the Triton merge kernel writes and what a sort of the
    packed keys gives: candidate lists with EMPTY slots, coarse scores (ties by id), NaN,
    +-0.0, +-inf, rows of L = 16 / 17, short and padding rows; nothing outside ``out``."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs SM80+ (redux.sync)")
    from nvfp4_indexer.reference.candidates import pack_candidates
    from nvfp4_indexer.triton.decode.dispatch import redux_shape
    from nvfp4_indexer.triton.decode.redux import redux_merge_kernel
    from nvfp4_indexer.triton.decode.split_kernel import decode_merge_kernel
    c = splits * keep
    rows, b = max(16, triton.next_power_of_2(q_len * heads)), 6
    width = max(c, 40)
    g = torch.Generator().manual_seed(c + q_len)
    scores = torch.randint(-3, 4, (b * rows, c), generator=g).float()
    scores[0::3, ::5] = float("nan")
    scores[1::3, 1::7] = -0.0
    scores[1::3, 2::7] = 0.0
    scores[2::3, ::4] = float("inf")
    scores[2::3, 1::9] = float("-inf")
    ids = torch.stack([torch.randperm(width, generator=g)[:c] for _ in range(b * rows)])
    cand = pack_candidates(scores, ids)
    cand[torch.rand(b * rows, c, generator=g) < 0.1] = -(2 ** 63)  # EMPTY slots
    seq_lens = torch.tensor([width * 128, 17 * 128 + q_len - 1, 16 * 128 + q_len, 130, 0,
                             width * 128 - 1], dtype=torch.int32)
    outs = []
    for gluon in (True, False):
        big, out = poisoned_out(b * q_len, heads)
        args = (cand.to(DEV), seq_lens.to(DEV), out, width)
        if gluon:
            k, r = redux_shape(c, q_len * heads)
            redux_merge_kernel[(b, triton.cdiv(q_len * heads, r))](
                *args, Q=q_len, H=heads, BLOCK_M=rows, C=c, K=k, ROWS=r, num_warps=r)
        else:
            decode_merge_kernel[(b, q_len * heads)](
                *args, Q=q_len, H=heads, BLOCK_M=rows, NUM_SPLITS=splits,
                SPLITS_PAD=triton.next_power_of_2(splits), ROWS=1, KEEP=keep, num_warps=1)
        assert_guards(big)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])
    pos = seq_lens.long()[:, None] - q_len + torch.arange(q_len)[None, :]
    local = torch.where(pos >= 0, pos // 128, 0).reshape(-1)
    got = outs[0].reshape(b * q_len, heads, 16)
    for r in range(b * q_len):
        for h in range(heads):
            L = int(local[r])
            if L <= 15:
                want = [j if j <= L else -1 for j in range(16)]
            else:
                row = (r // q_len) * rows + (r % q_len) * heads + h
                top = torch.sort(cand[row], descending=True).values[:15]
                want = [int(x) for x in ((top & 0xFFFFFFFF) ^ 0xFFFFFFFF).to(torch.int32)] + [L]
            assert got[r, h].tolist() == want, (r, h)


def test_redux_select_compiles_offline():
    """The Gluon select compiles for sm_90a and sm_100a (no GPU) at K = 1, 4, 8, 16, 32 keys
    per lane, the Gluon merge at 64 / 512 candidates per row and the split select at (K, S)
    = (8, 4), (16, 4), (16, 8), (32, 8) (W up to 8192): two warp reductions per round (30
    REDUX; the split select 60: its two sets of rounds), no spill; the select at K = 4 takes
    fewer instructions than the plain-Triton wide select at W = 128 (K = 4: 512 against 992
    on sm_90a at Triton 3.6)."""
    lines = sass_report_lines("redux_select_report", (90, 100))
    assert len(lines) == 26, lines
    for arch in range(2):
        red, split = lines[13 * arch:13 * arch + 7], lines[13 * arch + 7:13 * arch + 11]
        wide = lines[13 * arch + 11]
        for ln in red:  # 5 select widths, then the merge at 64 / 512 candidates
            assert " 0 LDL/STL, " in ln and ln.endswith(" 30 REDUX"), ln
        for ln in split:
            assert "redux_select_split" in ln and " 0 LDL/STL, " in ln \
                and ln.endswith(" 60 REDUX"), ln
        count = lambda ln: int(ln.split(" SASS instructions")[0].split()[-1])  # noqa: E731
        assert count(red[1]) < count(wide), (red[1], wide)
