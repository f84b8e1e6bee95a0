"""Per-op runners: call one backend op on one case's inputs (on the backend's device) and
judge its outputs against the expected ones (SPEC 9). Each runner has the signature
``run(case, backend, expected, result, max_failures)`` and folds its verdicts into ``result``;
``conformance.ops`` names the runner of each op.

Outputs are compared on the CPU. A backend op that is ``None`` or raises
``NotImplementedError`` is skipped (:class:`~conformance.results.Skip`); any other exception,
an import error included, is the backend's failure (``conformance.ops.run_case``).
"""

from __future__ import annotations

import math

import torch

from nvfp4_indexer.constants import HEAD_DIM, PAGE_SIZE
from nvfp4_indexer.reference.paging import code_byte_index, scale_byte_index
from nvfp4_indexer.reference.scores import row_positions

from .backends import Backend
from .fixtures import OUT_POISON, as_bytes, case_cache, selection_out
from .judges import (compare_bytes, explain_keys, explain_queries, hex_bytes, record_selection,
                     tie_aware_check)
from .oracles import DEQUANT_DTYPES, decode_rows, local_pages, mixed_qsl
from .results import CaseResult, Skip, skip_unimplemented


def call_op(backend: Backend, op: str, *args, **kwargs):
    """Call ``backend.<op>``.

    Raises:
        Skip: the backend declares the op absent (``None``) or raises ``NotImplementedError``.
        Any other exception of the op propagates (the case fails with it).
    """
    fn = getattr(backend, op)
    if fn is None:
        raise Skip(f"backend {backend.name!r} provides no {op}")
    return skip_unimplemented(f"{op}: NotImplementedError", fn, *args, **kwargs)


def _dev(t, device):
    return t.to(device) if isinstance(t, torch.Tensor) else t


def run_encode(case, backend, exp, res, mf):
    x = case.inputs["x"]
    got = as_bytes(call_op(backend, "encode_e4m3", x.to(backend.device)))
    flat = x.detach().cpu().reshape(-1)

    def show(i):
        v = flat[i]
        bits = v.view(_INT_OF[v.dtype]).item() & _MASK[v.dtype]
        return f"{v.item()!r} ({v.dtype}, bits {bits:#x})"
    compare_bytes(res, exp["bytes"].reshape(-1, 1), got.reshape(-1, 1), flat.numel(),
                  "encode_e4m3", mf, show)


_INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
           torch.float64: torch.int64}
_MASK = {torch.float32: 0xFFFFFFFF, torch.float16: 0xFFFF, torch.bfloat16: 0xFFFF,
         torch.float64: (1 << 64) - 1}


def run_quantize(case, backend, exp, res, mf):
    x = case.inputs["x"]
    codes, scales = call_op(backend, "quantize_nvfp4", x.to(backend.device))
    n = x.reshape(-1, HEAD_DIM).shape[0]
    got = torch.cat([as_bytes(codes).reshape(n, -1), as_bytes(scales).reshape(n, -1)], dim=1)
    want = torch.cat([exp["codes"].reshape(n, -1), exp["scales"].reshape(n, -1)], dim=1)
    compare_bytes(res, want, got, n, "quantize_nvfp4 (64 code bytes then 8 scale bytes)", mf)


def run_dequantize(case, backend, exp, res, mf):
    inp = case.inputs
    dt = DEQUANT_DTYPES[inp["dtype"]]
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
        compare_bytes(res, want.view(torch.int32), got_bits, n,
                      "dequantize_nvfp4 float32 (bits, shown as int32)", mf)
    else:
        compare_bytes(res, exp["out"].reshape(n, -1), as_bytes(out).reshape(n, -1), n,
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
            res.fail(mf, row=None, head=None, expected=hex_bytes(initial[off]),
                     got=hex_bytes(got[off]),
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


def run_write(case, backend, exp, res, mf):
    inp = case.inputs
    st, cache = case_cache(inp, backend.device)
    call_op(backend, "write_index_k", cache, inp["k"].to(backend.device),
            inp["slot_mapping"].to(backend.device))
    slots, tok, gc, gsc, ec, esc = _written_tokens(inp, st, exp, res, mf, "write_index_k")
    compare_bytes(res, torch.cat([ec, esc], 1), torch.cat([gc, gsc], 1), len(tok),
                  "write_index_k token bytes (64 codes then 8 scales)", mf,
                  lambda r: f"token {int(tok[r])} slot {int(slots[tok[r]])}")


def run_insert(case, backend, exp, res, mf):
    inp = case.inputs
    st, cache = case_cache(inp, backend.device)
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
                 expected=f"codes {hex_bytes(ec[r][:8])}.. scales {hex_bytes(esc[r])}",
                 got=f"codes {hex_bytes(gc[r][:8])}.. scales {hex_bytes(gsc[r])}",
                 detail=f"insert_index_k token {t} slot {int(slots[t])}: difference not "
                        "explained by SPEC 3's band"
                        + (" (exact backend)" if backend.exact_insert else ""))


def run_query(case, backend, exp, res, mf):
    inp = case.inputs
    d = backend.device
    out = call_op(backend, "prepare_index_q", _dev(inp["q"], d), _dev(inp["positions"], d),
                  _dev(inp["weight"], d), _dev(inp["cos_sin_cache"], d),
                  rotary_dim=inp["rotary_dim"], eps=inp["eps"])
    got = as_bytes(out)
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
        res.explained.append(f"row {tt} head {hh} dim {dd}: {hex_bytes(want[tt, hh, dd])} vs "
                             f"{hex_bytes(got[tt, hh, dd])}: exact value "
                             f"{float(exp['value'][tt, hh, dd]):.9g} within the band of an E4M3 "
                             "boundary")
    for tt, hh in (~row_ok).nonzero().tolist()[:mf]:
        dd = int((~ok[tt, hh]).nonzero()[0, 0])
        res.fail(mf, row=tt, head=hh, expected=hex_bytes(want[tt, hh, dd]),
                 got=hex_bytes(got[tt, hh, dd]),
                 detail=f"prepare_index_q dim {dd}: exact value "
                        f"{float(exp['value'][tt, hh, dd]):.9g} does not round to the got byte "
                        "within SPEC 3's band")


def run_gather(case, backend, exp, res, mf):
    inp = case.inputs
    _, cache = case_cache(inp, backend.device)
    ws, off = call_op(backend, "gather_index_k_fp8", cache,
                      inp["block_table"].to(backend.device), inp["seq_lens"].to(backend.device))
    want_off = exp["page_offsets"].to(torch.int64)
    got_off = off.detach().cpu()
    if off.dtype != torch.int32 or not torch.equal(got_off.to(torch.int64), want_off):
        res.count_failure(mf, row=None, head=None, expected=want_off.tolist(),
                          got=f"{got_off.tolist()} ({off.dtype})", detail="page_offsets (SPEC 7)")
    if ws.dtype != torch.float8_e4m3fn:
        res.count_failure(mf, row=None, head=None, expected="float8_e4m3fn", got=str(ws.dtype),
                          detail="workspace dtype (SPEC 2)")
        return
    p = exp["workspace"].shape[0]
    compare_bytes(res, exp["workspace"], as_bytes(ws), p,
                  "workspace page (token-major E4M3, SPEC 7)", mf)


def row_meta(inp, qsl):
    """``f(row)``: "request r position p L=l: ", the prefix of a selection failure."""
    req, pos = row_positions(inp["seq_lens"].cpu(), qsl.cpu())

    def f(t):
        return (f"request {int(req[t])} position {int(pos[t])} "
                f"L={int(pos[t]) // PAGE_SIZE if pos[t] >= 0 else -1}: ")
    return f


def run_scores(case, backend, exp, res, mf):
    inp = case.inputs
    d = backend.device
    _, cache = case_cache(inp, d)
    got = call_op(backend, "page_scores", inp["index_q"].to(d), cache,
                  inp["block_table"].to(d), inp["seq_lens"].to(d),
                  inp["query_start_loc"].to(d)).detach().cpu()
    want = exp["scores"]
    if got.shape != want.shape or got.dtype != torch.float32:
        res.count_failure(mf, row=None, head=None, expected=f"float32 {tuple(want.shape)}",
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
    meta = row_meta(inp, inp["query_start_loc"])
    for t, hh in (~row_ok).nonzero().tolist()[:mf]:
        j = int((~ok[t, hh]).nonzero()[0, 0])
        res.fail(mf, row=t, head=hh, expected=float(want[t, hh, j]), got=float(got[t, hh, j]),
                 detail=f"{meta(t)}page {j} score "
                        + ("(exact backend)" if bits is None else f"beyond e = 2^-{bits} M"))


def judge_selection(res: CaseResult, case, backend: Backend, exp: dict, got: torch.Tensor,
                    qsl: torch.Tensor, op_bits: str, mf: int) -> None:
    """Judge a selection ``got`` of the rows ``qsl`` tie-aware (SPEC 5, 9) with the bound the
    backend documents for ``op_bits`` and fold the verdicts into ``res``."""
    inp = case.inputs
    local = exp.get("local_page")
    if local is None:
        local = local_pages(inp["seq_lens"].cpu(), qsl.cpu())
    tie = tie_aware_check(got, exp["scores"], exp["magnitude"], local, backend.bits(op_bits),
                          reference=exp["selection"])
    record_selection(res, got, tie, row_meta(inp, qsl), mf)


def _selection_inputs(case, backend):
    """``(inputs, device, cache, index_q, poisoned out)`` of a selection case on the backend's
    device."""
    inp = case.inputs
    d = backend.device
    _, cache = case_cache(inp, d)
    q = inp["index_q"].to(d)
    return inp, d, cache, q, selection_out(q.shape[0], q.shape[1], d)


def _run_selection(case, backend, exp, res, mf, op: str, args: tuple[str, ...], kwargs: dict,
                   qsl: torch.Tensor) -> None:
    """Call the selection op ``op(index_q, cache, *inputs[args], **kwargs, out=poisoned)`` and
    judge the rows ``qsl`` (a returned tensor other than ``out`` is what gets judged)."""
    inp, d, cache, q, out = _selection_inputs(case, backend)
    r = call_op(backend, op, q, cache, *(_dev(inp[a], d) for a in args), **kwargs, out=out)
    got = out.detach().cpu()
    if r is not None and r.data_ptr() != out.data_ptr():
        got = r.detach().cpu()
    judge_selection(res, case, backend, exp, got, qsl, op, mf)


def run_decode(case, backend, exp, res, mf):
    _run_selection(case, backend, exp, res, mf, "decode_indexer",
                   ("block_table", "seq_lens", "query_len"), {},
                   decode_rows(case.inputs, "cpu"))


def run_prefill(case, backend, exp, res, mf):
    inp = case.inputs
    _run_selection(case, backend, exp, res, mf, "prefill_indexer",
                   ("block_table", "cu_seqlens_q", "seq_lens"),
                   {"max_gather_pages": inp["max_gather_pages"]}, inp["cu_seqlens_q"])


def run_mixed(case, backend, exp, res, mf):
    """Decode-first batch (SPEC 8): decode writes rows [0, nd), prefill rows [nd, T) of one
    shared output; neither may touch the other's rows."""
    inp, d, cache, q, out = _selection_inputs(case, backend)
    bd, ql = inp["num_decode_reqs"], inp["query_len"]
    nd = bd * ql
    bt, sl = inp["block_table"].to(d), inp["seq_lens"].to(d)
    call_op(backend, "decode_indexer", q[:nd], cache, bt[:bd], sl[:bd], ql, out=out[:nd])
    if bool((out[nd:] != OUT_POISON).any()):
        res.count_failure(mf, row=nd, head=None, expected="untouched prefill rows",
                          got="modified", detail="decode_indexer wrote outside its rows of the "
                                                 "shared output (SPEC 8)")
    snap = out[:nd].clone()
    call_op(backend, "prefill_indexer", q[nd:], cache, bt[bd:], inp["cu_seqlens_q"].to(d),
            sl[bd:], max_gather_pages=inp["max_gather_pages"], out=out[nd:])
    if not torch.equal(out[:nd], snap):
        res.count_failure(mf, row=0, head=None, expected="untouched decode rows", got="modified",
                          detail="prefill_indexer wrote outside its rows of the shared output "
                                 "(SPEC 8)")
    got = out.detach().cpu()
    bits_op = "decode_indexer"
    b_dec, b_pre = backend.bits("decode_indexer"), backend.bits("prefill_indexer")
    if b_dec is None or (b_pre is not None and b_pre < b_dec):
        bits_op = "prefill_indexer"  # the looser of the two bounds
    judge_selection(res, case, backend, exp, got, mixed_qsl(inp), bits_op, mf)

