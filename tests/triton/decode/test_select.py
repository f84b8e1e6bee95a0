"""The select kernels of the page-score family (SPEC 5): the plain-Triton ``select`` kernels
against the reference on the CPU, the Gluon ``redux`` selects against the wide select bit for
bit on a GPU, and the split select's algorithm replayed round by round on the CPU."""

from __future__ import annotations

import pytest
import torch

from kernel_harness import (  # sets TRITON_INTERPRET before the kernels are imported
    DEV, K, assert_guards, poisoned_out)

from nvfp4_indexer import reference as ref  # noqa: E402
from nvfp4_indexer.triton.decode.dispatch import (KernelLaunch, redux_shape,  # noqa: E402
                                                   select_plan, split_shape)

PS = K["decode.page_scores"]

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


def _select_scores(width: int, seed: int) -> torch.Tensor:
    """fp32 page scores ``[B=7, N=16, W]`` for the select kernel's residue-class rounds:
    random, coarse values (exact ties by id, across and within classes), one residue class
    j % 16 far below the rest (a class that never wins), NaN / +-0.0 / +-inf pages."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(7, 16, width, generator=g)
    s[1] = torch.randint(0, 4, (16, width), generator=g).float()  # ties everywhere
    s[2, :, 3::16] = -1e30  # a class that never wins a round
    s[3, :, ::7] = float("nan")
    s[3, :, 1::11] = -0.0
    s[3, :, 2::13] = 0.0
    s[4, :, ::5] = float("inf")
    s[4, :, 1::9] = float("-inf")
    s[4, 3] = float("nan")  # a row of NaN pages only
    s[5, :, ::3] = 1e-40  # subnormals of both signs, NaN with the sign bit set
    s[5, :, 1::3] = -1e-40
    s[5, :, 2::11] = -float("nan")
    return s


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("width", [40, 300, 2100])
def test_select_kernel_matches_reference(width, wide):
    """Both select kernels (page scores -> SPEC 5 rows; ``wide``: a row's keys in registers)
    equal the reference selection on the same scores bit for bit: first pass in one chunk and in three (1024, 1024, 51 pages),
    classes of 3 / 19 / 132 pages (one and two reload steps of 128), ties, NaN, +-0.0, +-inf,
    rows of L = 16 / 17, short rows and padding rows; nothing written outside ``out``."""
    q_len, heads, rows, b = 2, 4, 16, 7
    scores = _select_scores(width, seed=width)
    seq_lens = torch.tensor([width * 128, (width - 1) * 128 + 64, width * 128, width * 128 - 1,
                             17 * 128 + 1, 130, 0], dtype=torch.int32).clamp(max=width * 128)
    buf = scores.reshape(-1).clone()
    big, out = poisoned_out(b * q_len, heads)
    PS.run_select(select_plan(b, width, q_len, heads, gluon=False, wide=wide), buf.to(DEV),
                  seq_lens.to(DEV), out, width=width, query_len=q_len, num_heads=heads, rows=rows)
    assert_guards(big)
    pos = seq_lens.long()[:, None] - q_len + torch.arange(q_len)[None, :]  # [B, Q]
    local = torch.where(pos >= 0, pos // 128, -1).reshape(-1)
    per_row = scores[:, :q_len * heads].reshape(b * q_len, heads, width)
    assert torch.equal(out.cpu(), ref.select_pages(per_row, local))




@pytest.mark.gpu
@pytest.mark.parametrize("q_len,heads", [(2, 4), (1, 1), (3, 2), (2, 1), (8, 8)])
@pytest.mark.parametrize("width", [20, 33, 40, 100, 256, 500, 1000, 1907, 2100, 8192])
@pytest.mark.parametrize("split", [False, True])
def test_gpu_redux_select_matches_wide_select(width, q_len, heads, split):
    """The Gluon select (``redux.redux_select_kernel``, K = 1..32 keys per lane, rows per program 1 / 2 /
    4 with masked rows when Q*H is not a multiple, programs whose rows mix L = 15 and 16) and
    its split form (``split``: S = 4 / 8 warps per row, slices whose lists are partly or
    wholly padding) write exactly what the plain-Triton wide
    select and the reference write: ties, NaN of both signs, +-0.0, +-inf, subnormals, a
    NaN-only row, L = 16 / 17, a program mixing L = 15 and 16 rows, short and padding rows;
    nothing outside ``out``."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs SM80+ (redux.sync)")
    if not split and width > 1024:
        pytest.skip("one warp per row: W <= 1024 (32 keys per lane)")
    if split:
        k, s = split_shape(width)
        redux = KernelLaunch("redux_select_split", dict(K=k, S=s, ROWS=1), dict(num_warps=s))
    else:
        k, per = redux_shape(width, q_len * heads)
        redux = KernelLaunch("redux_select", dict(K=k, ROWS=per), dict(num_warps=per), per)
    wide = select_plan(7, width, q_len, heads, gluon=False, wide=True)
    rows, b = max(16, 1 << (q_len * heads - 1).bit_length()), 7
    scores = _select_scores(width, seed=width)
    scores = scores.repeat(1, (rows + 15) // 16, 1)[:, :rows]
    # 16 * 128 + 1 / + 2: the rows of one program mix L = 15 and L = 16 at (Q, H) = (2, 1)
    # (2 rows per program) and (3, 2) (4 rows per program)
    seq_lens = torch.tensor([width * 128, (width - 1) * 128 + 64, 16 * 128 + 2, width * 128 - 1,
                             17 * 128 + 1, 16 * 128 + 1, 0],
                            dtype=torch.int32).clamp(max=width * 128)
    buf = scores.reshape(-1).clone()
    outs = []
    for launch in (redux, wide):
        big, out = poisoned_out(b * q_len, heads)
        PS.run_select(launch, buf.to(DEV), seq_lens.to(DEV), out, width=width,
                      query_len=q_len, num_heads=heads, rows=rows)
        assert_guards(big)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])
    pos = seq_lens.long()[:, None] - q_len + torch.arange(q_len)[None, :]  # [B, Q]
    local = torch.where(pos >= 0, pos // 128, -1).reshape(-1)
    per_row = scores[:, :q_len * heads].reshape(b * q_len, heads, width)
    assert torch.equal(outs[0], ref.select_pages(per_row, local))


def _split_select_rounds(scores: torch.Tensor, local: torch.Tensor, keys_per_lane: int,
                         nan_key: int = -2 ** 31 + 1) -> torch.Tensor:
    """A torch replay of ``redux_select_split_kernel`` (GPU only), round by round, for rows
    ``scores [R, W]`` with local pages ``local [R]`` (>= 16): the kernel's slicing (page
    j = s * 32K + lane * K + k of warp s, ``split_shape``), its int32 keys (-0.0 as +0.0, NaN
    at ``nan_key``, pages j >= L at INT32_MIN), each round's per-lane max, smallest id holding
    it, warp max / min and the taken page set to INT32_MIN; phase 2 on the S kept entries per
    lane. Returns the 15 page ids ``[R, 15]``."""
    from nvfp4_indexer.reference.candidates import score_key
    low, no_id = -2 ** 31, 2 ** 31 - 1
    r, w = scores.shape
    k, s = split_shape(w, keys_per_lane)
    ids = (torch.arange(s)[:, None, None] * 32 * k + torch.arange(32)[None, :, None] * k
           + torch.arange(k)[None, None, :]).expand(r, s, 32, k)  # [R, S, 32, K]
    ok = ids < local[:, None, None, None]
    padded = torch.cat([scores, torch.zeros(r, s * 32 * k - w)], 1)
    sc = torch.where(ok, padded.gather(1, ids.reshape(r, -1)).reshape(ids.shape), 0.0)
    key = score_key(sc).long()
    key = torch.where(torch.isnan(sc), torch.full_like(key, nan_key), key)
    key = torch.where(ok, key, torch.full_like(key, low))

    def rounds(key, ids, lane_dim, warp_dim):
        picked_key, picked_id = [], []
        for _ in range(15):
            lane_key = key.max(lane_dim, keepdim=True).values
            lane_id = torch.where(key == lane_key, ids, no_id).min(lane_dim, keepdim=True).values
            best = lane_key.max(warp_dim, keepdim=True).values
            page = torch.where(lane_key == best, lane_id, no_id).min(warp_dim, keepdim=True).values
            picked_key.append(best)
            picked_id.append(page)
            key = torch.where(ids == page, low, key)
        return torch.cat(picked_key, warp_dim), torch.cat(picked_id, warp_dim)

    top_key, top_id = rounds(key, ids, 3, 2)  # [R, S, 15, 1]: each slice's best 15
    top_key, top_id = top_key[..., 0].transpose(1, 2), top_id[..., 0].transpose(1, 2)
    return rounds(top_key, top_id, 2, 1)[1][:, :, 0].to(torch.int32)  # [R, 15]


def _split_select_rows(width: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[113, W]`` of the select test's adversarial scores (7 groups of 16: random,
    ties everywhere, a class that never wins, NaN / +-0.0, +-inf and a NaN-only row,
    subnormals and NaN of both signs) plus one row whose 16 best pages are equal and straddle
    the first slice boundary 32K; local pages: each group's first 8 rows at slice boundaries,
    the rest random, all <= W - 1 (as seq_len <= W * 128 allows)."""
    scores = _select_scores(width, seed=seed).reshape(-1, width)
    tie = torch.randn(1, width, generator=torch.Generator().manual_seed(seed))
    tie[0, 32 * k - 8:32 * k + 8] = 1e6
    scores = torch.cat([scores, tie])
    g = torch.Generator().manual_seed(seed)
    edges = [16, 17, 32 * k - 1, 32 * k, 32 * k + 1, 32 * k + 15, 32 * k + 16, width - 1]
    local = []
    for _ in range(7):
        local += edges + torch.randint(16, width, (8,), generator=g).tolist()
    local = torch.tensor([min(x, width - 1) for x in local] + [min(32 * k + 8, width - 1)])
    return scores, local


@pytest.mark.parametrize("width", [513, 938, 1025, 1907, 2049, 4096, 8192])
@pytest.mark.parametrize("keys_per_lane", [8, 16])
def test_split_select_algorithm_matches_reference(width, keys_per_lane):
    """The split select's algorithm on the CPU (its kernel is GPU only): a round-by-round
    replay of the kernel (``_split_select_rounds``) equals SPEC 5's reference selection on
    adversarial scores (ties within and across slices, NaN of both signs, +-0.0, +-inf,
    subnormals, a NaN-only row) for local pages at slice boundaries. It fails if a slice keeps
    fewer than 15, if ties go to the larger id, or if NaN pages share the key of taken pages
    (then a taken page is picked again): the second half checks that the replay is that
    strict."""
    k, _ = split_shape(width, keys_per_lane)
    scores, local = _split_select_rows(width, k, seed=width + keys_per_lane)
    want = ref.select_pages(scores[:, None], local)[:, 0, :15]
    assert torch.equal(_split_select_rounds(scores, local, keys_per_lane), want)
    assert not torch.equal(_split_select_rounds(scores, local, keys_per_lane, -2 ** 31), want)
