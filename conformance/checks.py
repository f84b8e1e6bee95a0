"""Conformance checks (SPEC 9): bit-exact formats and writes, boundary-explained fused insert,
tie-aware top-k.

``run_case(case, backend)`` calls one backend op on one :class:`~conformance.generator.Case`,
gets the expected result from the case (a golden set) or from the reference oracle, and
compares. Every mismatch becomes a :class:`Failure` carrying what a reproducer needs (seed,
case, row, expected vs got). Outputs are compared on the CPU.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nvfp4_indexer.constants import HEAD_DIM, PAGE_SIZE, TOPK
from nvfp4_indexer import reference as ref
from nvfp4_indexer.reference import formats as F
from nvfp4_indexer.reference.paging import code_byte_index, scale_byte_index
from nvfp4_indexer.reference.scores import row_positions

from .backends import Backend
from .generator import OUT_POISON, Case, cache_view

#: SPEC 3 band: 2^-16 x the magnitude of the terms that formed a value.
BAND_BITS = 16
#: Widening of intervals for the fp32 rounding of amax / 6 and v / s inside a kernel.
_FP32_SLACK = 2.0 ** -22

# Which check (report table) each op belongs to.
CHECK_OF_OP = {"encode_e4m3": "codec", "quantize_nvfp4": "codec", "dequantize_nvfp4": "codec",
               "write_index_k": "write", "insert_index_k": "insert",
               "prepare_index_q": "insert", "gather_index_k_fp8": "gather",
               "page_scores": "scores", "decode": "decode", "prefill": "prefill",
               "mixed": "mixed"}
# Backend callable each op needs.
BACKEND_OP = {"decode": "decode_indexer", "prefill": "prefill_indexer",
              "mixed": ("decode_indexer", "prefill_indexer")}


@dataclass
class Failure:
    """One mismatch, with what a reproducer needs."""

    check: str
    case: str
    seed: int
    row: int | None
    head: int | None
    expected: Any
    got: Any
    detail: str
    case_file: str | None = None

    def reproducer(self, backend: str = "BACKEND", rerun: str | None = None) -> str:
        """Seed, case, row, expected vs got; ``rerun``: a command template with ``{case}``."""
        where = "" if self.row is None else f" row={self.row}" + (
            "" if self.head is None else f" head={self.head}")
        lines = [f"[{self.check}] case={self.case} seed={self.seed}{where}: {self.detail}",
                 f"    expected: {self.expected}", f"    got:      {self.got}"]
        if rerun:
            lines.append("    rerun:    " + rerun.format(case=self.case))
        if self.case_file:
            lines.append(f"    replay:   python -m conformance replay {self.case_file} "
                         f"--backend {backend}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"check": self.check, "case": self.case, "seed": self.seed, "row": self.row,
                "head": self.head, "expected": _jsonable(self.expected),
                "got": _jsonable(self.got), "detail": self.detail, "case_file": self.case_file}


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (np.ndarray, np.generic)):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


@dataclass
class CaseResult:
    """Outcome of one case: counts of compared rows by verdict.

    ``exact``: identical to the expectation. ``tolerance``: different but valid (top-k within
    the SPEC 9 bound, insert differences each explained by SPEC 3's band). ``needed_bound``:
    top-k rows that are only valid because of the bound (they fail with e = 0).
    ``max_gap``: largest normalized gap max(S[w] - S[u]) / M over rows that needed the bound.
    """

    check: str
    op: str
    case: str
    seed: int
    rows: int = 0
    exact: int = 0
    tolerance: int = 0
    needed_bound: int = 0
    failed: int = 0
    max_gap: float | None = None
    bound: float | None = None
    skipped: str | None = None
    explained: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0
    case_obj: Case | None = None  # kept for failing cases only (to save a case file)
    expected: dict | None = None

    @property
    def ok(self) -> bool:
        return self.failed == 0 and not self.failures

    def fail(self, max_failures: int, **kw) -> None:
        if len(self.failures) < max_failures:
            self.failures.append(Failure(check=self.check, case=self.case, seed=self.seed, **kw))

    def to_json(self) -> dict:
        return {"check": self.check, "op": self.op, "case": self.case, "seed": self.seed,
                "rows": self.rows, "exact": self.exact, "tolerance": self.tolerance,
                "needed_bound": self.needed_bound, "failed": self.failed,
                "max_gap": _jsonable(self.max_gap), "bound": self.bound,
                "skipped": self.skipped,
                "explained": self.explained[:5], "seconds": round(self.seconds, 4),
                "failures": [f.to_json() for f in self.failures]}


class Skip(Exception):
    """The backend does not provide (or does not implement) an op."""


def call_op(backend: Backend, op: str, *args, **kwargs):
    """Call ``backend.<op>``; raise :class:`Skip` when it is absent or not implemented
    (``NotImplementedError``, or a Triton module / function that does not exist yet)."""
    fn = getattr(backend, op, None)
    if fn is None:
        raise Skip(f"backend {backend.name!r} provides no {op}")
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        raise Skip(f"{op}: NotImplementedError: {e}") from e
    except (ModuleNotFoundError, AttributeError) as e:
        if "nvfp4_indexer.triton" in str(e):
            raise Skip(f"{op}: {e.__class__.__name__}: {e}") from e
        raise


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------

def _bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view (CPU) of a float8 / uint8 tensor."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _hex(b) -> str:
    b = b.tolist() if isinstance(b, torch.Tensor) else b
    if isinstance(b, list):
        return "[" + " ".join(f"{int(x) & 0xFFFFFFFF:02x}" for x in b) + "]"
    return f"0x{int(b) & 0xFFFFFFFF:02x}"


def _dev(t, device):
    return t.to(device) if isinstance(t, torch.Tensor) else t


def _cache(inputs: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A private copy of the case's storage on ``device`` and its cache view."""
    st = inputs["storage"].to(device).clone()
    return st, cache_view(st, inputs["num_blocks"], inputs["page_stride"])


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
        K-1 distinct history ids in [0, L), and with S the exact scores (NaN ranks lowest):
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
    s64 = torch.where(torch.isnan(s64), torch.full_like(s64, -math.inf), s64)  # NaN ranks last
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
    valid = structure & (gap <= 2 * e)
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
    res.reasons = {"structure": structure, "top": top, "e": e, "scores": s64, "sel": sel}
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
    s = r["scores"][row, head]
    e = float(r["e"][row, head])
    worst, msg = -math.inf, ""
    for a, b in zip(sel[:-2], sel[1:-1]):
        g = float(s[b] - s[a]) if not (math.isinf(s[a]) and math.isinf(s[b])) else 0.0
        if g > worst:
            worst, msg = g, (f"page {b} (S={float(s[b]):.9g}) ranked after page {a} "
                             f"(S={float(s[a]):.9g})")
    chosen = set(sel[:-1])
    for wp in range(s.shape[0]):
        if wp >= sel[-1] or wp in chosen:
            continue
        lo = min(chosen, key=lambda u: float(s[u]))
        g = float(s[wp] - s[lo]) if not (math.isinf(s[wp]) and math.isinf(s[lo])) else 0.0
        if g > worst:
            worst, msg = g, (f"unselected page {wp} (S={float(s[wp]):.9g}) beats selected "
                             f"page {lo} (S={float(s[lo]):.9g})")
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
        of amax -+ band (widened by fp32 rounding) and every code lies between the codes of
        (v -+ band) / s with the kernel's own scale s (code 8, -0, never). ``proofs`` names
        each differing byte of the ok tokens and the boundary it straddles.
    """
    t = value.shape[0]
    v = value.to(torch.float64).reshape(t, 8, 16)
    band = (magnitude.to(torch.float64) * 2.0 ** -BAND_BITS).reshape(t, 8, 16)
    av = v.abs()
    amax_lo = torch.clamp(av - band, min=0).amax(-1) * (1 - _FP32_SLACK)
    amax_hi = (av + band).amax(-1) * (1 + _FP32_SLACK)
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
    code_ok = (gv >= c_lo) & (gv <= c_hi) & (codes != 8)
    ok = scale_ok.all(-1) & code_ok.flatten(1).all(-1)
    proofs: list[str] = []
    rcodes = F.unpack_e2m1(ref_codes).reshape(t, 8, 16)
    rs = ref_scales.view(torch.uint8)
    gsb = got_scales.view(torch.uint8)
    for tok, g in ((rs != gsb) & scale_ok).nonzero().tolist()[:8]:
        proofs.append(f"token {tok} group {g}: scale {_hex(rs[tok, g])} vs {_hex(gsb[tok, g])}: "
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
    within SPEC 3's band of the exact one; within the band of zero both 0x00 and 0x80 pass."""
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
    return ok


# --------------------------------------------------------------------------------------------
# Oracles: the expected outputs of a case from the reference
# --------------------------------------------------------------------------------------------

def _decode_rows(inputs, device):
    q = inputs["query_len"]
    b = inputs["block_table"].shape[0]
    return torch.arange(b + 1, dtype=torch.int32, device=device) * q


def oracle(case: Case) -> dict[str, torch.Tensor]:
    """Expected outputs of ``case`` computed by the reference on the inputs' device."""
    inp = case.inputs
    op = case.op
    if op == "encode_e4m3":
        return {"bytes": _bytes(F.encode_e4m3(inp["x"]))}
    if op == "quantize_nvfp4":
        c, s = F.quantize_nvfp4(inp["x"])
        return {"codes": c.cpu(), "scales": _bytes(s)}
    if op == "dequantize_nvfp4":
        dt = _DTYPES[inp["dtype"]]
        out = F.dequantize_nvfp4(inp["codes"], inp["scales"], dt)
        return {"out": out.cpu() if dt == torch.float32 else _bytes(out)}
    if op == "write_index_k":
        st, cache = _cache(inp, inp["storage"].device)
        c, s = F.quantize_nvfp4(inp["k"])
        ref.write_tokens(cache, c, s, inp["slot_mapping"])
        return {"storage": st.cpu()}
    if op == "insert_index_k":
        st, cache = _cache(inp, inp["storage"].device)
        ref.insert_index_k(cache, inp["k"], inp["positions"], inp["slot_mapping"], inp["weight"],
                           inp["cos_sin_cache"], inp["rotary_dim"], inp["eps"])
        val, mag = ref.norm_rope_exact(inp["k"], inp["positions"], inp["weight"],
                                       inp["cos_sin_cache"], inp["rotary_dim"], inp["eps"])
        return {"storage": st.cpu(), "value": val.cpu(), "magnitude": mag.cpu()}
    if op == "prepare_index_q":
        val, mag = ref.norm_rope_exact(inp["q"], inp["positions"], inp["weight"],
                                       inp["cos_sin_cache"], inp["rotary_dim"], inp["eps"])
        return {"q": _bytes(F.encode_e4m3(val.to(torch.float32))), "value": val.cpu(),
                "magnitude": mag.cpu()}
    if op == "gather_index_k_fp8":
        _, cache = _cache(inp, inp["storage"].device)
        ws, off = ref.gather_index_k_fp8(cache, inp["block_table"], inp["seq_lens"])
        return {"workspace": _bytes(ws), "page_offsets": off.cpu()}
    _, cache = _cache(inp, inp["storage"].device)
    q = inp["index_q"]
    dev = q.device
    if op == "page_scores":
        qsl = inp["query_start_loc"]
    elif op == "decode":
        qsl = _decode_rows(inp, dev)
    elif op == "prefill":
        qsl = inp["cu_seqlens_q"]
    elif op == "mixed":
        qsl = _mixed_qsl(inp)
    else:
        raise ValueError(f"unknown op {op!r}")
    scores, mag = ref.page_scores(q, cache, inp["block_table"], inp["seq_lens"], qsl,
                                  with_magnitude=True)
    _, pos = row_positions(inp["seq_lens"], qsl)
    local = torch.div(pos, PAGE_SIZE, rounding_mode="floor")
    sel = ref.select_pages(scores, local, TOPK)
    return {"selection": sel.cpu(), "scores": scores.cpu(), "magnitude": mag.cpu(),
            "local_page": local.cpu()}


def _mixed_qsl(inp) -> torch.Tensor:
    bd, q = inp["num_decode_reqs"], inp["query_len"]
    cu = inp["cu_seqlens_q"].to(torch.int64)
    dev = cu.device
    d = torch.arange(bd + 1, dtype=torch.int64, device=dev) * q
    return torch.cat([d, bd * q + cu[1:]]).to(torch.int32)


_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32}


# --------------------------------------------------------------------------------------------
# Per-op runners
# --------------------------------------------------------------------------------------------

def _compare_bytes(res: CaseResult, exp: torch.Tensor, got: torch.Tensor, rows_of: int,
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
        res.fail(max_failures, row=r, head=None, expected=_hex(e2[r, c:c + 8]),
                 got=_hex(g2[r, c:c + 8]),
                 detail=f"{label}: {len(cols)} byte(s) differ, first at byte {c}{inp}")


def _run_encode(case, backend, exp, res, mf):
    x = case.inputs["x"]
    got = _bytes(call_op(backend, "encode_e4m3", x.to(backend.device)))
    flat = x.detach().cpu().reshape(-1)

    def show(i):
        v = flat[i]
        return f"{v.item()!r} ({v.dtype}, bits {v.view(_INT_OF[v.dtype]).item() & _MASK[v.dtype]:#x})"
    _compare_bytes(res, exp["bytes"].reshape(-1, 1), got.reshape(-1, 1), flat.numel(),
                   "encode_e4m3", mf, show)


_INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
           torch.float64: torch.int64}
_MASK = {torch.float32: 0xFFFFFFFF, torch.float16: 0xFFFF, torch.bfloat16: 0xFFFF,
         torch.float64: (1 << 64) - 1}


def _run_quantize(case, backend, exp, res, mf):
    x = case.inputs["x"]
    codes, scales = call_op(backend, "quantize_nvfp4", x.to(backend.device))
    n = x.reshape(-1, HEAD_DIM).shape[0]
    got = torch.cat([_bytes(codes).reshape(n, -1), _bytes(scales).reshape(n, -1)], dim=1)
    want = torch.cat([exp["codes"].reshape(n, -1), exp["scales"].reshape(n, -1)], dim=1)
    _compare_bytes(res, want, got, n, "quantize_nvfp4 (64 code bytes then 8 scale bytes)", mf)


def _run_dequantize(case, backend, exp, res, mf):
    inp = case.inputs
    dt = _DTYPES[inp["dtype"]]
    scales = inp["scales"].view(torch.float8_e4m3fn)
    out = call_op(backend, "dequantize_nvfp4", inp["codes"].to(backend.device),
                  scales.to(backend.device), dt)
    n = inp["codes"].reshape(-1, 64).shape[0]
    if dt == torch.float32:
        want = exp["out"].reshape(n, -1)
        got = out.detach().cpu()
        if got.dtype != torch.float32 or got.numel() != want.numel():
            res.rows += n
            res.failed += n
            res.fail(mf, row=None, head=None, expected=f"float32 {tuple(want.shape)}",
                     got=f"{got.dtype} {tuple(got.shape)}", detail="dequantize_nvfp4 output")
            return
        got = got.reshape(n, -1)
        # Bits must match; NaN payloads are not compared.
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        got_bits = torch.where(same, want.view(torch.int32), got.view(torch.int32))
        _compare_bytes(res, want.view(torch.int32), got_bits, n,
                       "dequantize_nvfp4 float32 (bits, shown as int32)", mf)
    else:
        _compare_bytes(res, exp["out"].reshape(n, -1), _bytes(out).reshape(n, -1), n,
                       "dequantize_nvfp4 E4M3 bytes", mf)


def _written_mask(storage_len, slots, num_blocks, page_stride):
    """Bool mask over storage bytes of the written tokens (72 bytes each)."""
    mask = torch.zeros(storage_len, dtype=torch.bool)
    s = slots.cpu().to(torch.long)
    s = s[s >= 0]
    blk, off = s // PAGE_SIZE, s % PAGE_SIZE
    base = (blk * page_stride)[:, None]
    mask[(base + code_byte_index(off)).flatten()] = True
    mask[(base + scale_byte_index(off)).flatten()] = True
    return mask


def _token_bytes(storage, slots, page_stride):
    """``(codes [n, 64], scales [n, 8])`` bytes of the tokens at non-negative ``slots``."""
    s = slots.cpu().to(torch.long)
    blk, off = s // PAGE_SIZE, s % PAGE_SIZE
    base = (blk * page_stride)[:, None]
    return storage[base + code_byte_index(off)], storage[base + scale_byte_index(off)]


def _stray_bytes(res, initial, exp, got, mask, page_stride, mf, label):
    """Bytes outside the written tokens must keep their initial value."""
    outside = ~mask
    bad = outside & (got != initial)
    n = int(bad.sum())
    if n:
        res.failed += 1
        for off in bad.nonzero().flatten().tolist()[:min(mf, 4)]:
            blk, inpage = divmod(off, page_stride)
            res.fail(mf, row=None, head=None, expected=_hex(initial[off]), got=_hex(got[off]),
                     detail=f"{label}: {n} byte(s) outside the written tokens changed; first at "
                            f"storage byte {off} (block {blk}, page byte {inpage}) (SPEC 2)")


def _written_tokens(inp, st, exp, res, mf, op):
    """After a paged write by ``op``: flag stray bytes outside the written tokens, and return
    ``(slots, tok, got codes, got scales, expected codes, expected scales)`` of the tokens with
    a non-negative slot (SPEC 2)."""
    got, initial, want = st.cpu(), inp["storage"].cpu(), exp["storage"]
    slots = inp["slot_mapping"].cpu()
    keep = slots >= 0
    mask = _written_mask(got.numel(), slots, inp["num_blocks"], inp["page_stride"])
    _stray_bytes(res, initial, want, got, mask, inp["page_stride"], mf, op)
    gc, gsc = _token_bytes(got, slots[keep], inp["page_stride"])
    ec, esc = _token_bytes(want, slots[keep], inp["page_stride"])
    return slots, keep.nonzero().flatten(), gc, gsc, ec, esc


def _run_write(case, backend, exp, res, mf):
    inp = case.inputs
    st, cache = _cache(inp, backend.device)
    call_op(backend, "write_index_k", cache, inp["k"].to(backend.device),
            inp["slot_mapping"].to(backend.device))
    slots, tok, gc, gsc, ec, esc = _written_tokens(inp, st, exp, res, mf, "write_index_k")
    _compare_bytes(res, torch.cat([ec, esc], 1), torch.cat([gc, gsc], 1), len(tok),
                   "write_index_k token bytes (64 codes then 8 scales)", mf,
                   lambda r: f"token {int(tok[r])} slot {int(slots[tok[r]])}")


def _run_insert(case, backend, exp, res, mf):
    inp = case.inputs
    st, cache = _cache(inp, backend.device)
    d = backend.device
    call_op(backend, "insert_index_k", cache, _dev(inp["k"], d), _dev(inp["positions"], d),
            _dev(inp["slot_mapping"], d), _dev(inp["weight"], d), _dev(inp["cos_sin_cache"], d),
            rotary_dim=inp["rotary_dim"], eps=inp["eps"])
    slots, tok, gc, gsc, ec, esc = _written_tokens(inp, st, exp, res, mf, "insert_index_k")
    same = (gc == ec).all(-1) & (gsc == esc).all(-1)
    n = len(tok)
    res.rows += n
    res.exact += int(same.sum())
    diff = ~same
    if not bool(diff.any()):
        return
    if backend.exact_insert:
        ok = torch.zeros(n, dtype=torch.bool)
        proofs = []
    else:
        ok, proofs = explain_keys(exp["value"][tok], exp["magnitude"][tok], gc, gsc, ec, esc)
    res.tolerance += int((diff & ok).sum())
    res.explained.extend(proofs)
    bad = diff & ~ok
    res.failed += int(bad.sum())
    for r in bad.nonzero().flatten().tolist()[:mf]:
        t = int(tok[r])
        res.fail(mf, row=t, head=None,
                 expected=f"codes {_hex(ec[r][:8])}.. scales {_hex(esc[r])}",
                 got=f"codes {_hex(gc[r][:8])}.. scales {_hex(gsc[r])}",
                 detail=f"insert_index_k token {t} slot {int(slots[t])}: difference not "
                        "explained by SPEC 3's band"
                        + (" (exact backend)" if backend.exact_insert else ""))


def _run_query(case, backend, exp, res, mf):
    inp = case.inputs
    d = backend.device
    out = call_op(backend, "prepare_index_q", _dev(inp["q"], d), _dev(inp["positions"], d),
                  _dev(inp["weight"], d), _dev(inp["cos_sin_cache"], d),
                  rotary_dim=inp["rotary_dim"], eps=inp["eps"])
    got = _bytes(out)
    want = exp["q"]
    if got.shape != want.shape:
        res.rows += want.shape[0]
        res.failed += want.shape[0]
        res.fail(mf, row=None, head=None, expected=f"shape {tuple(want.shape)}",
                 got=f"shape {tuple(got.shape)}", detail="prepare_index_q: wrong shape")
        return
    t, h, _ = want.shape
    same = (got == want).all(-1)
    if backend.exact_insert:
        ok = got == want
    else:
        ok = explain_queries(exp["value"], exp["magnitude"], got)
    row_ok = ok.all(-1)
    res.rows += t * h
    res.exact += int(same.sum())
    res.tolerance += int((~same & row_ok).sum())
    res.failed += int((~row_ok).sum())
    for tt, hh, dd in ((got != want) & ok).nonzero().tolist()[:4]:
        res.explained.append(f"row {tt} head {hh} dim {dd}: {_hex(want[tt, hh, dd])} vs "
                             f"{_hex(got[tt, hh, dd])}: exact value "
                             f"{float(exp['value'][tt, hh, dd]):.9g} within the band of an E4M3 "
                             "boundary")
    for tt, hh in (~row_ok).nonzero().tolist()[:mf]:
        dd = int((~ok[tt, hh]).nonzero()[0, 0])
        res.fail(mf, row=tt, head=hh, expected=_hex(want[tt, hh, dd]),
                 got=_hex(got[tt, hh, dd]),
                 detail=f"prepare_index_q dim {dd}: exact value "
                        f"{float(exp['value'][tt, hh, dd]):.9g} does not round to the got byte "
                        "within SPEC 3's band")


def _run_gather(case, backend, exp, res, mf):
    inp = case.inputs
    _, cache = _cache(inp, backend.device)
    ws, off = call_op(backend, "gather_index_k_fp8", cache,
                      inp["block_table"].to(backend.device), inp["seq_lens"].to(backend.device))
    want_off = exp["page_offsets"].to(torch.int64)
    got_off = off.detach().cpu()
    if off.dtype != torch.int32 or not torch.equal(got_off.to(torch.int64), want_off):
        res.failed += 1
        res.fail(mf, row=None, head=None, expected=want_off.tolist(),
                 got=f"{got_off.tolist()} ({off.dtype})", detail="page_offsets (SPEC 7)")
    if ws.dtype != torch.float8_e4m3fn:
        res.failed += 1
        res.fail(mf, row=None, head=None, expected="float8_e4m3fn", got=str(ws.dtype),
                 detail="workspace dtype (SPEC 2)")
        return
    p = exp["workspace"].shape[0]
    _compare_bytes(res, exp["workspace"], _bytes(ws), p,
                   "workspace page (token-major E4M3, SPEC 7)", mf)


def _local_pages(inp, qsl):
    _, pos = row_positions(inp["seq_lens"].cpu(), qsl.cpu())
    return torch.div(pos, PAGE_SIZE, rounding_mode="floor")


def _row_meta(inp, qsl):
    req, pos = row_positions(inp["seq_lens"].cpu(), qsl.cpu())

    def f(t):
        return (f"request {int(req[t])} position {int(pos[t])} "
                f"L={int(pos[t]) // PAGE_SIZE if pos[t] >= 0 else -1}: ")
    return f


def _run_scores(case, backend, exp, res, mf):
    inp = case.inputs
    d = backend.device
    _, cache = _cache(inp, d)
    got = call_op(backend, "page_scores", inp["index_q"].to(d), cache,
                  inp["block_table"].to(d), inp["seq_lens"].to(d),
                  inp["query_start_loc"].to(d)).detach().cpu()
    want = exp["scores"]
    if got.shape != want.shape or got.dtype != torch.float32:
        res.failed += 1
        res.fail(mf, row=None, head=None, expected=f"float32 {tuple(want.shape)}",
                 got=f"{got.dtype} {tuple(got.shape)}", detail="page_scores output")
        return
    bits = backend.bits("page_scores")
    mag = exp["magnitude"][..., None]
    hist = torch.isfinite(want) | torch.isnan(want)
    both_nan = torch.isnan(want) & torch.isnan(got)
    same = (got == want) | both_nan
    if bits is None:
        ok = same
    else:
        e = mag * 2.0 ** -bits
        err = (got.to(torch.float64) - want.to(torch.float64)).abs()
        ok = torch.where(hist, (err <= e) | both_nan, got == want)
        res.bound = 2.0 ** -bits
    row_ok = ok.all(-1)
    row_same = same.all(-1)
    res.rows += row_ok.numel()
    res.exact += int(row_same.sum())
    res.tolerance += int((row_ok & ~row_same).sum())
    res.failed += int((~row_ok).sum())
    if bits is not None and bool((~same & hist).any()):
        rel = torch.where(mag > 0, (got.to(torch.float64) - want).abs() / mag, 0.0)
        rel = torch.where(hist & ~both_nan, rel, 0.0)
        g = float(torch.nan_to_num(rel, nan=math.inf).max())
        res.max_gap = g if res.max_gap is None else max(res.max_gap, g)
    meta = _row_meta(inp, inp["query_start_loc"])
    for t, hh in (~row_ok).nonzero().tolist()[:mf]:
        j = int((~ok[t, hh]).nonzero()[0, 0])
        res.fail(mf, row=t, head=hh, expected=float(want[t, hh, j]), got=float(got[t, hh, j]),
                 detail=f"{meta(t)}page {j} score "
                        + ("(exact backend)" if bits is None else f"beyond e = 2^-{bits} M"))


def _selection_out(t, h, device):
    return torch.full((t, h, TOPK), OUT_POISON, dtype=torch.int32, device=device)


def _judge(res, case, backend, exp, got, qsl, op_bits, mf):
    inp = case.inputs
    local = exp.get("local_page")
    if local is None:
        local = _local_pages(inp, qsl)
    tie = tie_aware_check(got, exp["scores"], exp["magnitude"], local, backend.bits(op_bits),
                          reference=exp["selection"])
    record_selection(res, got, tie, _row_meta(inp, qsl), mf)


def _run_decode(case, backend, exp, res, mf):
    inp = case.inputs
    d = backend.device
    _, cache = _cache(inp, d)
    q = inp["index_q"].to(d)
    out = _selection_out(q.shape[0], q.shape[1], d)
    r = call_op(backend, "decode_indexer", q, cache, inp["block_table"].to(d),
                inp["seq_lens"].to(d), inp["query_len"], out=out)
    got = out.detach().cpu()
    if r is not None and r.data_ptr() != out.data_ptr():
        got = r.detach().cpu()
    _judge(res, case, backend, exp, got, _decode_rows(inp, "cpu"), "decode_indexer", mf)


def _run_prefill(case, backend, exp, res, mf):
    inp = case.inputs
    d = backend.device
    _, cache = _cache(inp, d)
    q = inp["index_q"].to(d)
    out = _selection_out(q.shape[0], q.shape[1], d)
    r = call_op(backend, "prefill_indexer", q, cache, inp["block_table"].to(d),
                inp["cu_seqlens_q"].to(d), inp["seq_lens"].to(d),
                max_gather_pages=inp["max_gather_pages"], out=out)
    got = out.detach().cpu()
    if r is not None and r.data_ptr() != out.data_ptr():
        got = r.detach().cpu()
    _judge(res, case, backend, exp, got, inp["cu_seqlens_q"], "prefill_indexer", mf)


def _run_mixed(case, backend, exp, res, mf):
    """Decode-first batch (SPEC 8): decode writes rows [0, nd), prefill rows [nd, T) of one
    shared output; neither may touch the other's rows."""
    inp = case.inputs
    d = backend.device
    _, cache = _cache(inp, d)
    q = inp["index_q"].to(d)
    bd, ql = inp["num_decode_reqs"], inp["query_len"]
    nd = bd * ql
    bt, sl = inp["block_table"].to(d), inp["seq_lens"].to(d)
    out = _selection_out(q.shape[0], q.shape[1], d)
    call_op(backend, "decode_indexer", q[:nd], cache, bt[:bd], sl[:bd], ql, out=out[:nd])
    if bool((out[nd:] != OUT_POISON).any()):
        res.failed += 1
        res.fail(mf, row=nd, head=None, expected="untouched prefill rows",
                 got="modified", detail="decode_indexer wrote outside its rows of the shared "
                                        "output (SPEC 8)")
    snap = out[:nd].clone()
    call_op(backend, "prefill_indexer", q[nd:], cache, bt[bd:], inp["cu_seqlens_q"].to(d),
            sl[bd:], max_gather_pages=inp["max_gather_pages"], out=out[nd:])
    if not torch.equal(out[:nd], snap):
        res.failed += 1
        res.fail(mf, row=0, head=None, expected="untouched decode rows", got="modified",
                 detail="prefill_indexer wrote outside its rows of the shared output (SPEC 8)")
    got = out.detach().cpu()
    bits_op = "decode_indexer"
    b_dec, b_pre = backend.bits("decode_indexer"), backend.bits("prefill_indexer")
    if b_dec is None or (b_pre is not None and b_pre < b_dec):
        bits_op = "prefill_indexer"  # the looser of the two bounds
    _judge(res, case, backend, exp, got, _mixed_qsl(inp), bits_op, mf)


_RUNNERS = {"encode_e4m3": _run_encode, "quantize_nvfp4": _run_quantize,
            "dequantize_nvfp4": _run_dequantize, "write_index_k": _run_write,
            "insert_index_k": _run_insert, "prepare_index_q": _run_query,
            "gather_index_k_fp8": _run_gather, "page_scores": _run_scores,
            "decode": _run_decode, "prefill": _run_prefill, "mixed": _run_mixed}


def run_case(case: Case, backend: Backend, *, max_failures: int = 5,
             check: str | None = None) -> CaseResult:
    """Run one case on ``backend`` and judge it (expected outputs from ``case.expected`` or the
    reference oracle). Exceptions from the backend become failures; an absent or not
    implemented op makes the case skipped."""
    res = CaseResult(check=check or CHECK_OF_OP[case.op], op=case.op, case=case.name,
                     seed=case.seed, case_obj=case)
    t0 = time.perf_counter()
    exp = None
    try:
        exp = case.expected if case.expected is not None else oracle(case)
        _RUNNERS[case.op](case, backend, exp, res, max_failures)
    except Skip as e:
        res.skipped = str(e)
    except Exception as e:  # the backend (or, with exp None, the oracle) raised
        res.failed += 1
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        who = case.op if exp is not None else "the reference oracle"
        res.fail(max_failures, row=None, head=None, expected="no exception",
                 got=f"{e.__class__.__name__}: {e}", detail=f"{who} raised{where}")
    if not res.ok:
        res.expected = exp
    if torch.device(backend.device).type == "cuda":
        torch.cuda.synchronize()
    if res.ok:
        res.case_obj = None  # free the inputs of passing cases
    res.seconds = time.perf_counter() - t0
    return res
