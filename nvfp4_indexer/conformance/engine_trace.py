"""The "engine" check (SPEC 8.1): ``Indexer`` plan/forward over a seeded continuous-batching trace.

Requests arrive with cached context (a prefix-cache hit: their keys are already in the cache),
prefill their new tokens in chunks of the step's token budget, decode with one query length
Q in 1..max_decode_query_len per step (speculative decoding), and finish; their blocks go back
to a shuffled free list and are reused by later requests (block tables change as pages are
allocated). Decode-only steps are padded to the CUDA-graph batch sizes with zero-length
requests. Prefill host seq lens are sometimes upper bounds (async speculative decoding).

Every step: plan, poison the shared output, forward, and compare every row of the step with
the reference (exact, or tie-aware for the Triton scorer, SPEC 9); rows past the step must stay
poisoned. On a CUDA device with the Triton backend each decode-only step is a replay of a graph
captured once per (padded batch size, Q); elsewhere the same steps run eagerly.
"""

from __future__ import annotations

import fnmatch
import time

import numpy as np
import torch

from nvfp4_indexer.constants import HEAD_DIM, PAGE_SIZE

from . import generator as G
from .backends import Backend
from .fixtures import OUT_POISON, cache_view, poisoned_storage, selection_out
from .oracles import mixed_oracle, mixed_qsl
from .results import CaseResult, Skip, skip_unimplemented
from .runners import judge_selection

#: Trace sizes per profile: (steps, heads, max_decode_query_len, max_model_len,
#: max_num_batched_tokens, max_num_seqs, cudagraph sizes).
TRACE_SIZES = {
    "smoke": (8, 2, 4, 3072, 256, 4, (1, 2, 4, 8)),
    "default": (14, 4, 8, 8192, 512, 6, (1, 2, 4, 8)),
    "full": (40, 4, 8, 40_000, 4096, 24, (1, 2, 4, 8, 16, 32)),
}


def engine_steps(profile: G.Profile) -> int:
    return TRACE_SIZES.get(profile.name, TRACE_SIZES["default"])[0]


class _Req:
    def __init__(self, rid, context, new, decode):
        self.rid, self.context, self.new, self.decode = rid, context, new, decode
        self.computed = context  # tokens whose keys are in the cache
        self.target = context + new + decode
        self.blocks: list[int] = []

    @property
    def prefilling(self) -> bool:
        return self.computed < self.context + self.new


def _make_indexer(backend: Backend, config):
    if backend.make_indexer is not None:
        return backend.make_indexer(config)
    raise Skip(f"backend {backend.name!r} provides no make_indexer")


def engine_results(backend: Backend, profile: G.Profile, seed: int, *, max_failures: int = 5,
                   case_glob: str | None = None) -> list[CaseResult]:
    """One :class:`CaseResult` per step of the profile's trace."""
    name = "engine/trace"
    if case_glob and not fnmatch.fnmatch(name, case_glob) \
            and not fnmatch.fnmatch(name + "/step-000", case_glob):
        return []
    return engine_trace(backend, profile, G.case_seed(seed, "engine", 0), name,
                        max_failures=max_failures)


def engine_trace(backend: Backend, profile: G.Profile, seed: int, name: str, *,
                 max_failures: int = 5) -> list[CaseResult]:
    import nvfp4_indexer as ni
    steps, heads, max_q, max_len, max_tok, max_seqs, graph_sizes = TRACE_SIZES.get(
        profile.name, TRACE_SIZES["default"])
    rng = np.random.default_rng(seed)
    dev = torch.device(backend.device)
    config = ni.IndexerConfig(heads, max_len, max_tok, max_seqs, max_decode_query_len=max_q,
                              cudagraph_batch_sizes=graph_sizes, device=dev)
    results: list[CaseResult] = []

    def result(step, **kw):
        return CaseResult(check="engine", op="engine", case=f"{name}/step-{step:03d}",
                          seed=seed, rows=0, **kw)
    try:
        indexer = skip_unimplemented("make_indexer", _make_indexer, backend, config)
    except Skip as e:
        return [result(0, skipped=str(e))]
    use_graph = dev.type == "cuda" and backend.capturable and \
        getattr(indexer, "backend", "triton") == "triton"

    max_pages = config.max_pages
    num_blocks = max_seqs * max_pages + 8
    page_stride = G.PAGE_BYTES + 16 * int(rng.integers(0, 2))
    dist = ("gaussian", "outlier", "ties")[seed % 3]
    ctx = G.dist_context(rng, dist)
    storage = poisoned_storage(rng, num_blocks, page_stride, dev)
    cache = cache_view(storage, num_blocks, page_stride)
    free = list(rng.permutation(num_blocks))
    max_rows = max(max_tok, config.max_decode_reqs * max_q)
    width = max_pages + 2
    bt_buf = torch.zeros((config.max_decode_reqs + max_seqs, width), dtype=torch.int32,
                         device=dev)
    sl_buf = torch.zeros(config.max_decode_reqs + max_seqs, dtype=torch.int32, device=dev)
    qsl_buf = torch.zeros(config.max_decode_reqs + max_seqs + 1, dtype=torch.int32, device=dev)
    q_buf = torch.zeros((max_rows + 3, heads, HEAD_DIM), dtype=torch.uint8,
                        device=dev).view(torch.float8_e4m3fn)
    out_buf = selection_out(max_rows + 3, heads, dev)
    graphs: dict = {}
    active: list[_Req] = []
    next_id = 0

    def write(req, lo, hi):
        """Keys of tokens [lo, hi) of ``req`` into its blocks (allocating pages as needed)."""
        while len(req.blocks) * PAGE_SIZE < hi:
            req.blocks.append(int(free.pop()))
        t = np.arange(lo, hi)
        blocks = np.asarray(req.blocks)
        slots = torch.from_numpy(blocks[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE)
        keys = torch.from_numpy(G.request_keys(rng, hi - lo, dist, ctx))
        G.write_keys(storage, num_blocks, page_stride, keys, slots)

    for step in range(steps):
        res = result(step)
        t0 = time.perf_counter()
        # Arrivals in bursts (one step in four; the first admits max_num_seqs - 1): cached
        # context (written now: a prefix-cache hit) and new tokens to prefill.
        burst = step % 4 == 0
        room = max_seqs - (step == 0)  # leave a seat for a later arrival (a mixed step)
        while len(active) < room and (step == 0 or not active
                                      or rng.random() < (0.6 if burst else 0.3)):
            ctx_len = int(rng.choice([0, int(rng.integers(1, max_len // 2)),
                                      int(rng.integers(max_len * 2 // 3, max_len - 600))],
                                     p=[0.2, 0.3, 0.5]))
            if next_id == 0:  # one long request (pages beyond 15: scored rows) in every trace
                ctx_len = int(rng.integers(max_len - 900, max_len - 600))
            new = int(rng.integers(1, min(max_len - ctx_len - 16, max_tok // 2) + 1))
            dec = int(rng.integers(1, max(2, min(12, max_len - ctx_len - new - 8))))
            req = _Req(next_id, ctx_len, new, dec)
            next_id += 1
            if sum(-(-r.target // PAGE_SIZE) for r in active) + -(-(req.target + 8)
                                                                 // PAGE_SIZE) > num_blocks:
                break
            if ctx_len:
                write(req, 0, ctx_len)
            active.append(req)
        q = int(rng.integers(1, max_q + 1))
        decodes = [r for r in active if not r.prefilling][:max_tok // q]
        prefills = [r for r in active if r.prefilling]
        budget = max_tok - q * len(decodes)
        sched = []
        for r in prefills:
            if budget <= 0:
                break
            n = min(r.context + r.new - r.computed, budget)
            sched.append((r, n))
            budget -= n
        nd_real = len(decodes)
        if nd_real == 0 and not sched:
            continue  # nothing to run (the pool is full of finished-but-unfreed requests)
        # Padding to a CUDA-graph size: decode-only steps only.
        nd = config.padded_batch_size(nd_real) if not sched else nd_real
        reqs = decodes[:nd_real]
        q_lens = [q] * nd_real + [0] * (nd - nd_real) + [n for _, n in sched]
        seqs = [r.computed + q for r in reqs] + [0] * (nd - nd_real) + \
            [r.computed + n for r, n in sched]
        for r in reqs:
            write(r, r.computed, r.computed + q)
        for r, n in sched:
            write(r, r.computed, r.computed + n)
        rows_req = reqs + [None] * (nd - nd_real) + [r for r, _ in sched]
        bt = np.empty((len(rows_req), width), dtype=np.int32)
        for i, r in enumerate(rows_req):
            n = len(r.blocks) if r is not None else 0
            n = min(n, -(-seqs[i] // PAGE_SIZE))
            if n:
                bt[i, :n] = r.blocks[:n]
            bt[i, n:] = G.garbage_ids(rng, width - n, num_blocks)
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        host_sl = np.array(seqs, dtype=np.int32)
        if sched and rng.random() < 0.5:  # prefill host seq lens as upper bounds
            up = host_sl[nd:] + rng.integers(0, 3, size=len(sched))
            host_sl[nd:] = np.minimum(up, max_len).astype(np.int32)
        rr = len(rows_req)
        bt_buf[:rr].copy_(torch.from_numpy(bt))
        sl_buf[:rr].copy_(torch.tensor(seqs, dtype=torch.int32))
        qsl_buf[:rr + 1].copy_(torch.from_numpy(qsl))
        rows = max(nd * q, int(qsl[-1]))
        qv = G.encode_queries(G.query_values(rng, rows, heads, dist, ctx))
        q_buf[:rows].copy_(qv.to(dev))
        stepmd = ni.StepMetadata(qsl_buf[:rr + 1], torch.from_numpy(qsl), sl_buf[:rr],
                                 torch.from_numpy(host_sl), bt_buf[:rr], nd)
        kind = "decode-only" if not sched else ("prefill-only" if not nd else "mixed")
        try:
            md = indexer.plan(stepmd)
            out_buf.fill_(OUT_POISON)
            key = (nd, q)
            if use_graph and not sched and nd:
                g = graphs.get(key)
                if g is None:
                    indexer.forward(q_buf, cache, md, out_buf)  # warm-up outside capture
                    torch.cuda.synchronize()
                    g = graphs[key] = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        indexer.forward(q_buf, cache, md, out_buf)
                    out_buf.fill_(OUT_POISON)
                g.replay()
            else:
                indexer.forward(q_buf, cache, md, out_buf)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            got = out_buf.detach().cpu()
        except Exception as e:  # plan/forward/capture raised
            res.raised(e, "engine", max_failures,
                       f"engine step {step} ({kind}, nd={nd}, Q={q}) raised")
            results.append(res)
            break
        if bool((got[rows:] != OUT_POISON).any()):
            res.count_failure(max_failures, row=rows, head=None,
                              expected="untouched rows past the step", got="modified",
                              detail="Indexer.forward wrote past the step's rows (SPEC 8.1)")
        cu = torch.from_numpy(qsl[nd:] - qsl[nd]).to(torch.int32)
        case = G.Case("mixed", res.case, seed,
                      dict(storage=storage.cpu().clone(), num_blocks=num_blocks,
                           page_stride=page_stride, block_table=torch.from_numpy(bt),
                           seq_lens=torch.tensor(seqs, dtype=torch.int32),
                           index_q=q_buf[:rows].cpu().clone() if rows else
                           torch.zeros((0, heads, HEAD_DIM), dtype=torch.float8_e4m3fn),
                           query_len=q if nd else 1, num_decode_reqs=nd, cu_seqlens_q=cu,
                           max_gather_pages=config.gather_pages),
                      meta=dict(B=nd, Q=q, R=len(sched), H=heads, T=rows, seq_lens=seqs,
                                dist=dist, page_stride=page_stride, kind=kind,
                                graph=use_graph and not sched and bool(nd)))
        if rows:
            exp = mixed_oracle(case.inputs)
            bits_op = "prefill_indexer" if sched else "decode_indexer"
            judge_selection(res, case, backend, exp, got[:rows], mixed_qsl(case.inputs),
                            bits_op, max_failures)
            if not res.ok:
                res.case_obj, res.expected = case, exp
        res.seconds = time.perf_counter() - t0
        results.append(res)
        # Advance: computed tokens, finished requests free their blocks.
        for r in reqs:
            r.computed += q
        for r, n in sched:
            r.computed += n
        for r in [r for r in active if r.computed >= r.target]:
            active.remove(r)
            for b in r.blocks:
                free.insert(int(rng.integers(0, len(free) + 1)), b)
    return results
