"""The harness's judges: bit-exact byte comparison (SPEC 9), the SPEC 3 band ("boundary-
explained" insert and query bytes) and the SPEC 5 / 9 tie-aware top-k rule.

Each judge takes tensors and returns verdicts; ``compare_bytes`` and ``record_selection`` fold
verdicts into a :class:`~conformance.results.CaseResult`. Tests and benchmarks call these
instead of their own copies (``tests/bruteforce.py`` stays independent on purpose).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nvfp4_indexer import reference as ref
from nvfp4_indexer.reference import formats as F

from .results import CaseResult

#: SPEC 3 band: 2^-16 x the magnitude of the terms that formed a value.
BAND_BITS = 16
#: Widening of intervals for the fp32 rounding of amax / 6 and v / s inside a kernel.
_FP32_SLACK = 2.0 ** -22


def hex_bytes(b) -> str:
    """Bytes (or one byte) in hex, as failures show them."""
    b = b.tolist() if isinstance(b, torch.Tensor) else b
    if isinstance(b, list):
        return "[" + " ".join(f"{int(x) & 0xFFFFFFFF:02x}" for x in b) + "]"
    return f"0x{int(b) & 0xFFFFFFFF:02x}"


def round_e4m3_f64(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the E4M3 grid, ties to even, saturating at 448 (SPEC 1.1)
    without an intermediate fp32 rounding (used for interval end points)."""
    x = x.to(torch.float64)
    a = x.abs()
    _, k = torch.frexp(a)
    e = torch.clamp(k.to(torch.int64) - 1, min=-6)
    quantum = torch.ldexp(torch.ones_like(a), (e - 3).to(torch.float64))
    r = torch.round(torch.where(torch.isfinite(a), a, torch.zeros_like(a)) / quantum) * quantum
    r = torch.where(torch.isinf(a), torch.full_like(a, 448.0), torch.clamp(r, max=448.0))
    return torch.where(torch.isnan(x), x, torch.copysign(r, x))


# --------------------------------------------------------------------------------------------
# Tie-aware top-k (SPEC 5, 9)
# --------------------------------------------------------------------------------------------

@dataclass
class TieAwareResult:
    """Per-row verdicts of :func:`tie_aware_check` (``[N, H]`` tensors).

    status: 0 identical to the reference selection, 1 different but valid under the bound,
    2 invalid. needed_bound: valid only because e > 0. gap: max over violating pairs of
    S[later or unselected] - S[earlier or selected] (<= 0: valid with e = 0). gap_rel: gap / M.
    """

    status: torch.Tensor
    needed_bound: torch.Tensor
    gap: torch.Tensor
    gap_rel: torch.Tensor
    bound_rel: float | None
    reference: torch.Tensor
    reasons: dict = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return int((self.status == 2).sum())


def tie_aware_check(selected: torch.Tensor, exact_scores: torch.Tensor,
                    magnitude: torch.Tensor, local_page: torch.Tensor, bound_bits: int | None,
                    *, reference: torch.Tensor | None = None) -> TieAwareResult:
    """Judge a selection against exact scores (SPEC 5, 9).

    Args:
        selected: int ``[N, H, K]`` logical page ids from the backend.
        exact_scores: float32 ``[N, H, W]`` exact page scores (reference), -inf off history.
        magnitude: float64 ``[N, H]``: max over the row's history tokens of sum_d |q_d K_d|.
        local_page: int ``[N]`` local page L of each row (negative for padding rows).
        bound_bits: b of e = 2^-b * magnitude; None for an exact backend, whose selection must
            equal ``reference`` bit for bit (ties by smaller id, SPEC 5).
        reference: int ``[N, H, K]`` expected selection (default: ``select_pages`` of the
            exact scores).
    Returns:
        :class:`TieAwareResult`. Rows with L <= K-1 and padding rows must equal the reference
        exactly (their content does not depend on scores). Rows with L >= K need slot K-1 = L,
        K-1 distinct history ids in [0, L), NaN pages (exact) ordered among themselves by
        smaller id, and with S the exact scores (NaN ranks lowest):
        S[u] + e >= S[w] - e for every selected u and unselected history page w, and
        S[a] + e >= S[b] - e for every consecutive pair (a before b).
    """
    sel = selected.detach().cpu().to(torch.long)
    scores = exact_scores.detach().cpu()
    n, h, k = sel.shape
    w = scores.shape[-1]
    L = local_page.detach().cpu().to(torch.long)
    if reference is None:
        reference = ref.select_pages(scores, L, k)
    reference = reference.detach().cpu().to(torch.long)
    equal = (sel == reference).all(dim=-1)
    Lr = L[:, None].expand(n, h)
    top = Lr > k - 1
    hist = sel[..., :k - 1]
    in_range = ((hist >= 0) & (hist < Lr[..., None])).all(-1)
    srt = torch.sort(hist, dim=-1).values
    distinct = (srt[..., 1:] != srt[..., :-1]).all(-1)
    structure = in_range & distinct & (sel[..., k - 1] == Lr)
    s64 = scores.to(torch.float64)
    nan = torch.isnan(s64)
    s64 = torch.where(nan, torch.full_like(s64, -math.inf), s64)  # NaN ranks last
    ids = hist.clamp(0, max(w - 1, 0))
    sg = torch.gather(s64, -1, ids) if w else torch.zeros_like(hist, dtype=torch.float64)
    d = sg[..., 1:] - sg[..., :-1]  # later minus earlier: > 0 violates the order
    d = torch.where(torch.isnan(d), torch.zeros_like(d), d)  # -inf - -inf: a NaN tie
    gap_c = d.amax(-1) if k > 2 else torch.full((n, h), -math.inf, dtype=torch.float64)
    pages = torch.arange(w)
    hist_mask = pages[None, None, :] < Lr[..., None]
    chosen = torch.zeros((n, h, w), dtype=torch.bool)
    if w:
        chosen.scatter_(-1, ids, True)
    unsel = torch.where(hist_mask & ~chosen, s64, torch.full_like(s64, -math.inf))
    best_unsel = unsel.amax(-1) if w else torch.full((n, h), -math.inf, dtype=torch.float64)
    gap_s = best_unsel - sg.amin(-1)
    gap_s = torch.where(torch.isnan(gap_s), torch.zeros_like(gap_s), gap_s)
    gap = torch.maximum(gap_c, gap_s)
    mag = magnitude.detach().cpu().to(torch.float64)
    if bound_bits is None:
        e = torch.zeros_like(mag)
        bound_rel = None
    else:
        e = mag * 2.0 ** -bound_bits
        bound_rel = 2.0 * 2.0 ** -bound_bits
    # NaN pages (exact: NaN bytes, no rounding) rank among themselves by smaller id (SPEC 5):
    # selected ones ascending, none kept over an unselected smaller-id NaN page.
    if w:
        nsel = torch.gather(nan, -1, ids)
        both = nsel[..., 1:] & nsel[..., :-1]
        nan_order = (~both | (hist[..., :-1] < hist[..., 1:])).all(-1)
        max_nan_sel = torch.where(nsel, hist, torch.full_like(hist, -1)).amax(-1)
        nan_unsel = hist_mask & ~chosen & nan
        min_nan_unsel = torch.where(nan_unsel, pages, torch.full_like(pages, w)).amin(-1)
        nan_order = nan_order & (max_nan_sel < min_nan_unsel)
    else:
        nan_order = torch.ones((n, h), dtype=torch.bool)
    valid = structure & nan_order & (gap <= 2 * e)
    valid = torch.where(top, valid, equal)
    status = torch.full((n, h), 2, dtype=torch.int8)
    if bound_bits is None:
        status[equal] = 0
    else:
        status[valid] = 1
        status[equal] = 0
    needed = (status == 1) & top & (gap > 0)
    gap_rel = torch.where(mag > 0, gap / mag, torch.where(gap > 0, math.inf, 0.0))
    res = TieAwareResult(status, needed, gap, gap_rel, bound_rel, reference.to(torch.int32))
    res.reasons = {"structure": structure, "nan_order": nan_order, "top": top, "e": e,
                   "scores": s64, "sel": sel}
    return res


def explain_row(res: TieAwareResult, row: int, head: int) -> str:
    """Why row (``row``, ``head``) failed, in words."""
    r = res.reasons
    sel = r["sel"][row, head].tolist()
    if not bool(r["top"][row, head]):
        return "output differs on a row whose content is fixed (L <= 15 or padding, SPEC 5)"
    if not bool(r["structure"][row, head]):
        return ("structure: slot 15 must be the local page and slots 0..14 distinct history "
                "pages in [0, L) (SPEC 5)")
    if not bool(r["nan_order"][row, head]):
        return "NaN pages must rank among themselves by smaller id (SPEC 5)"
    s = r["scores"][row, head]
    e = float(r["e"][row, head])
    def gap(hi, lo):  # S[hi] - S[lo]; 0 between two infinities
        return float(s[hi] - s[lo]) if not (math.isinf(s[hi]) and math.isinf(s[lo])) else 0.0
    # (gap, message) of every misordered pair: consecutive selections, then unselected pages
    # against the lowest selected one
    pairs = [(gap(b, a), f"page {b} (S={float(s[b]):.9g}) ranked after page {a} "
                         f"(S={float(s[a]):.9g})") for a, b in zip(sel[:-2], sel[1:-1])]
    chosen = set(sel[:-1])
    lo = min(chosen, key=lambda u: float(s[u]))
    pairs += [(gap(wp, lo), f"unselected page {wp} (S={float(s[wp]):.9g}) beats selected "
                            f"page {lo} (S={float(s[lo]):.9g})")
              for wp in range(s.shape[0]) if wp < sel[-1] and wp not in chosen]
    worst, msg = -math.inf, ""
    for g, text in pairs:  # the first of the largest gaps
        if g > worst:
            worst, msg = g, text
    if worst <= 2 * e:
        return ("selection differs from the reference only on tied scores, but the backend is "
                "exact: equal scores must rank by smaller id (SPEC 5, 9)")
    return f"{msg}: gap {worst:.9g} > 2e = {2 * e:.9g} (SPEC 9)"


def record_selection(res: CaseResult, got: torch.Tensor, tie: TieAwareResult, rows_meta,
                     max_failures: int) -> None:
    """Fold a :class:`TieAwareResult` into ``res`` (counts, max gap, failures)."""
    st = tie.status
    res.rows += st.numel()
    res.exact += int((st == 0).sum())
    res.tolerance += int((st == 1).sum())
    res.failed += int((st == 2).sum())
    res.needed_bound += int(tie.needed_bound.sum())
    res.bound = tie.bound_rel
    if bool(tie.needed_bound.any()):
        g = float(tie.gap_rel[tie.needed_bound].max())
        res.max_gap = g if res.max_gap is None else max(res.max_gap, g)
    for t, hh in (st == 2).nonzero().tolist()[:max_failures]:
        extra = rows_meta(t) if rows_meta else ""
        res.fail(max_failures, row=t, head=hh, expected=tie.reference[t, hh].tolist(),
                 got=got[t, hh].tolist(), detail=f"{extra}{explain_row(tie, t, hh)}")


# --------------------------------------------------------------------------------------------
# Boundary-explained insert (SPEC 3)
# --------------------------------------------------------------------------------------------

def _e4m3_scale(a: torch.Tensor) -> torch.Tensor:
    """SPEC 1.3 step 2 in float64: E4M3(max(a, 1e-12) / 6) with the 2^-9 floor."""
    s = round_e4m3_f64(torch.clamp(a, min=1e-12) / 6)
    return torch.where(s == 0, torch.full_like(s, 2.0 ** -9), s)


def explain_keys(value: torch.Tensor, magnitude: torch.Tensor, got_codes: torch.Tensor,
                 got_scales: torch.Tensor, ref_codes: torch.Tensor,
                 ref_scales: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """Prove that a fused kernel's quantized keys differ from the reference only inside SPEC
    3's band.

    Args:
        value, magnitude: float64 ``[T, 128]`` from ``norm_rope_exact``.
        got_codes / ref_codes: uint8 ``[T, 64]``; got_scales / ref_scales: uint8 ``[T, 8]``.
    Returns:
        ``(ok bool [T], proofs)``: a token is ok when every scale byte lies between the scales
        of amax -+ band (widened by fp32 rounding; amax over the group's non-NaN values, 0 when
        all are NaN, SPEC 1.3) and every code lies between the codes of (v -+ band) / s with
        the kernel's own scale s (code 8, -0, never; a NaN value must give code 0). ``proofs``
        names each differing byte of the ok tokens and the boundary it straddles.
    """
    t = value.shape[0]
    v = value.to(torch.float64).reshape(t, 8, 16)
    band = (magnitude.to(torch.float64) * 2.0 ** -BAND_BITS).reshape(t, 8, 16)
    nan = torch.isnan(v)
    av = v.abs()
    zero = torch.zeros_like(av)
    amax_lo = torch.where(nan, zero, torch.clamp(av - band, min=0)).amax(-1) * (1 - _FP32_SLACK)
    amax_hi = torch.where(nan, zero, av + band).amax(-1) * (1 + _FP32_SLACK)
    s_lo, s_hi = _e4m3_scale(amax_lo), _e4m3_scale(amax_hi)
    gs = F.decode_e4m3(got_scales.view(torch.uint8)).to(torch.float64)
    scale_ok = (gs >= s_lo) & (gs <= s_hi) & (gs > 0) & torch.isfinite(gs)
    s = gs[..., None]
    lo = (v - band) / s
    hi = (v + band) / s
    lo = lo - lo.abs() * _FP32_SLACK
    hi = hi + hi.abs() * _FP32_SLACK
    codes = F.unpack_e2m1(got_codes).reshape(t, 8, 16)
    gv = F.e2m1_value(codes).to(torch.float64)
    c_lo = F.e2m1_value(F.e2m1_encode(lo)).to(torch.float64)
    c_hi = F.e2m1_value(F.e2m1_encode(hi)).to(torch.float64)
    code_ok = torch.where(nan, codes == 0, (gv >= c_lo) & (gv <= c_hi) & (codes != 8))
    ok = scale_ok.all(-1) & code_ok.flatten(1).all(-1)
    proofs: list[str] = []
    rcodes = F.unpack_e2m1(ref_codes).reshape(t, 8, 16)
    rs = ref_scales.view(torch.uint8)
    gsb = got_scales.view(torch.uint8)
    for tok, g in ((rs != gsb) & scale_ok).nonzero().tolist()[:8]:
        proofs.append(f"token {tok} group {g}: scale {hex_bytes(rs[tok, g])} vs "
                      f"{hex_bytes(gsb[tok, g])}: "
                      f"amax/6 in [{float(amax_lo[tok, g]) / 6:.9g}, "
                      f"{float(amax_hi[tok, g]) / 6:.9g}] spans E4M3 values "
                      f"{float(s_lo[tok, g]):.9g} .. {float(s_hi[tok, g]):.9g}")
    for tok, g, i in ((rcodes != codes) & code_ok).nonzero().tolist()[:8]:
        proofs.append(f"token {tok} dim {16 * g + i}: code {int(rcodes[tok, g, i])} vs "
                      f"{int(codes[tok, g, i])}: v/s in [{float(lo[tok, g, i]):.9g}, "
                      f"{float(hi[tok, g, i]):.9g}] with kernel scale {float(gs[tok, g]):.9g} "
                      "straddles an E2M1 threshold")
    return ok, proofs


def explain_queries(value: torch.Tensor, magnitude: torch.Tensor,
                    got: torch.Tensor) -> torch.Tensor:
    """Per-element verdict (bool, shape of ``value``) that a query byte is E4M3 of some value
    within SPEC 3's band of the exact one; within the band of zero both 0x00 and 0x80 pass; a
    NaN value must give 0x7F (SPEC 1.1)."""
    v = value.to(torch.float64)
    band = magnitude.to(torch.float64) * 2.0 ** -BAND_BITS
    lo = v - band - (v - band).abs() * _FP32_SLACK
    hi = v + band + (v + band).abs() * _FP32_SLACK
    e_lo, e_hi = round_e4m3_f64(lo), round_e4m3_f64(hi)
    gb = got.view(torch.uint8)
    gv = F.decode_e4m3(gb).to(torch.float64)
    ok = (gv >= e_lo) & (gv <= e_hi)
    zero = gv == 0
    neg = (gb & 0x80) != 0
    # -0 needs some x <= 0 in the band (or a negative value rounding to zero), +0 some x >= 0.
    ok = ok & ~(zero & neg & ~(lo <= 0)) & ~(zero & ~neg & ~(hi >= 0))
    return torch.where(torch.isnan(v), gb == 0x7F, ok)


# --------------------------------------------------------------------------------------------
# Bit-exact bytes (SPEC 9)
# --------------------------------------------------------------------------------------------

def compare_bytes(res: CaseResult, exp: torch.Tensor, got: torch.Tensor, rows_of: int,
                   label: str, max_failures: int, inputs_of=None) -> None:
    """Bit-exact comparison of ``[rows, ...]`` byte tensors: a row is exact when all its bytes
    match."""
    if tuple(exp.shape) != tuple(got.shape):
        res.rows += rows_of
        res.failed += rows_of
        res.fail(max_failures, row=None, head=None, expected=f"shape {tuple(exp.shape)}",
                 got=f"shape {tuple(got.shape)}", detail=f"{label}: wrong output shape")
        return
    e2 = exp.reshape(rows_of, -1)
    g2 = got.reshape(rows_of, -1)
    bad = (e2 != g2).any(-1)
    res.rows += rows_of
    res.failed += int(bad.sum())
    res.exact += rows_of - int(bad.sum())
    for r in bad.nonzero().flatten().tolist()[:max_failures]:
        cols = (e2[r] != g2[r]).nonzero().flatten()
        c = int(cols[0])
        inp = f" input {inputs_of(r)}" if inputs_of else ""
        res.fail(max_failures, row=r, head=None, expected=hex_bytes(e2[r, c:c + 8]),
                 got=hex_bytes(g2[r, c:c + 8]),
                 detail=f"{label}: {len(cols)} byte(s) differ, first at byte {c}{inp}")

