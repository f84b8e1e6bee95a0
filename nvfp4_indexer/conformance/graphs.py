"""Decode wrapper replays (SPEC 6): plan once per step, run after in-place buffer changes.

On a CUDA device with a capturable backend, ``run()`` is captured once in a CUDA graph and
every later step is a graph replay; elsewhere (CPU, the reference backend) the same sequence
runs eagerly, which still checks that ``run()`` reads the planned buffers afresh.

Each step mutates the persistent buffers in place — a new q, longer and shorter seq lens, new
block tables over the same cache, padding rows (seq_len 0 with a garbage block-table row) —
calls ``plan()``, poisons the output, replays and checks every row against the reference.
"""

from __future__ import annotations

import fnmatch
import math
import time

import numpy as np
import torch

from nvfp4_indexer.constants import HEAD_DIM, PAGE_SIZE

from . import generator as G
from .backends import Backend
from .fixtures import OUT_POISON, cache_view, poisoned_storage, selection_out
from .oracles import decode_oracle, decode_rows
from .results import CaseResult, Skip, skip_unimplemented
from .runners import judge_selection

_MUTATIONS = ("longer", "shorter", "new-block-table", "padding", "all")


def wrapper_sessions(profile: G.Profile) -> list[tuple[int, int]]:
    """(Q, H) of each wrapper session of a profile."""
    return [(1, 4), (4, 2)] if profile.name != "full" else [(1, 4), (8, 4), (2, 1)]


def _fill_pool(rng, num_blocks, page_stride, n_valid, device, dist):
    """A pool whose first ``n_valid`` blocks (in a random order) hold full pages of keys and
    whose other blocks are poison."""
    storage = poisoned_storage(rng, num_blocks, page_stride, device)
    perm = rng.permutation(num_blocks)
    valid = perm[:n_valid]
    ctx = G.dist_context(rng, dist)
    keys = torch.from_numpy(G.request_keys(rng, n_valid * PAGE_SIZE, dist, ctx))
    t = np.arange(n_valid * PAGE_SIZE)
    slots = torch.from_numpy(valid[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE)
    G.write_keys(storage, num_blocks, page_stride, keys, slots)
    return storage, valid, ctx


def _state(rng, prev_lens, batch, q, max_len, mutation, step):
    """New seq lens for one step."""
    lens = []
    for b in range(batch):
        s = prev_lens[b] if prev_lens is not None else 0
        if prev_lens is None or s == 0:
            s = int(rng.integers(q, max_len + 1)) if b else max_len - int(rng.integers(0, 64))
        elif mutation in ("longer", "all"):
            s = min(max_len, s + int(rng.integers(1, 300)))
        elif mutation == "shorter":
            s = max(q, s - int(rng.integers(1, 1500)))
        lens.append(max(s, q))
    if mutation in ("padding", "all") and batch > 1:
        for b in rng.choice(np.arange(1, batch), size=max(1, batch // 3), replace=False):
            lens[int(b)] = 0
    return lens


def _block_table(rng, lens, width, valid, num_blocks, prev=None, prev_lens=None,
                 remap=True):
    """Block table for ``lens``: fresh random blocks (``remap``), or the previous table's
    blocks for pages a request already had and fresh ones for new pages; entries past a
    request's pages are garbage."""
    bt = np.empty((len(lens), width), dtype=np.int32)
    for b, s in enumerate(lens):
        n = (s + PAGE_SIZE - 1) // PAGE_SIZE
        bt[b, :n] = rng.choice(valid, size=n, replace=len(valid) < n)
        if not remap and prev is not None and prev_lens[b]:
            keep = min(n, (prev_lens[b] + PAGE_SIZE - 1) // PAGE_SIZE)
            bt[b, :keep] = prev[b, :keep]
        bt[b, n:] = G.garbage_ids(rng, width - n, num_blocks)
    return bt


def wrapper_results(backend: Backend, profile: G.Profile, seed: int, *, max_failures: int = 5,
                    case_glob: str | None = None) -> list[CaseResult]:
    """All wrapper sessions of ``profile``; one :class:`CaseResult` per step (plan + run)."""
    out = []
    for i, (q, h) in enumerate(wrapper_sessions(profile)):
        name = f"wrapper/q{q}-h{h}/{i:03d}"
        if case_glob and not fnmatch.fnmatch(name, case_glob) \
                and not fnmatch.fnmatch(name + "/step-000", case_glob):
            continue
        out.extend(wrapper_session(backend, profile, G.case_seed(seed, "wrapper", i), name, q, h,
                                   max_failures=max_failures))
    return out


def wrapper_session(backend: Backend, profile: G.Profile, seed: int, name: str, q: int,
                    heads: int, *, max_failures: int = 5) -> list[CaseResult]:
    """One wrapper for a padded batch: plan + run (or capture once and replay) for
    ``profile.wrapper_replays + 1`` steps, each checked against the reference."""
    rng = np.random.default_rng(seed)
    dev = torch.device(backend.device)
    use_graph = dev.type == "cuda" and backend.capturable
    check = "wrapper"
    batch = profile.wrapper_batch
    max_len = max(2049 + q, min(max(profile.long_lens), profile.case_tokens // batch))
    max_pages = math.ceil(max_len / PAGE_SIZE)
    width = max_pages + 2
    n_valid = min(max_pages + 8, batch * max_pages)
    num_blocks = n_valid + 6
    dist = "gaussian" if seed % 2 else "outlier"
    page_stride = G.PAGE_BYTES + 16 * int(rng.integers(0, 2))
    storage, valid, ctx = _fill_pool(rng, num_blocks, page_stride, n_valid, dev, dist)
    cache = cache_view(storage, num_blocks, page_stride)
    bt_buf = torch.full((batch, width), -1, dtype=torch.int32, device=dev)
    sl_buf = torch.zeros(batch, dtype=torch.int32, device=dev)
    q_buf = torch.zeros((batch * q, heads, HEAD_DIM), dtype=torch.uint8,
                        device=dev).view(torch.float8_e4m3fn)
    out_buf = selection_out(batch * q, heads, dev)
    results: list[CaseResult] = []

    def result(step, **kw):
        return CaseResult(check=check, op="decode", case=f"{name}/step-{step:03d}",
                          seed=seed, rows=0, **kw)

    try:
        if backend.make_decode_wrapper is None:
            raise Skip(f"backend {backend.name!r} provides no make_decode_wrapper")
        wrapper = skip_unimplemented("make_decode_wrapper", backend.make_decode_wrapper, heads,
                                     block_table_buffer=bt_buf, seq_lens_buffer=sl_buf,
                                     use_cuda_graph=use_graph)
    except Skip as e:
        return [result(0, skipped=str(e))]

    lens, bt = None, None
    graph = None
    for step in range(profile.wrapper_replays + 1):
        mutation = "initial" if step == 0 else _MUTATIONS[(step - 1) % len(_MUTATIONS)]
        prev_lens = lens
        lens = _state(rng, lens, batch, q, max_len, mutation, step)
        bt = _block_table(rng, lens, width, valid, num_blocks, prev=bt, prev_lens=prev_lens,
                          remap=mutation in ("initial", "new-block-table", "all"))
        qv = G.encode_queries(G.query_values(rng, batch * q, heads, dist, ctx))
        # In-place updates of the planned buffers (addresses never change).
        bt_buf.copy_(torch.from_numpy(bt))
        sl_buf.copy_(torch.tensor(lens, dtype=torch.int32))
        q_buf.copy_(qv.to(dev))
        res = result(step)
        t0 = time.perf_counter()
        try:
            wrapper.plan(bt_buf, sl_buf, q, num_blocks=num_blocks)
            out_buf.fill_(OUT_POISON)
            if use_graph and graph is None:
                wrapper.run(q_buf, cache, out_buf)  # warm-up / compile outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    wrapper.run(q_buf, cache, out_buf)
                out_buf.fill_(OUT_POISON)
            if graph is not None:
                graph.replay()
                torch.cuda.synchronize()
            else:
                wrapper.run(q_buf, cache, out_buf)
            got = out_buf.detach().cpu()
        except Exception as e:  # plan/run/capture raised
            res.raised(e, "wrapper", max_failures, f"wrapper step {step} ({mutation}) raised")
            results.append(res)
            break
        case = G.Case("decode", res.case, seed,
                      dict(storage=storage, num_blocks=num_blocks, page_stride=page_stride,
                           block_table=bt_buf.clone(), seq_lens=sl_buf.clone(),
                           index_q=q_buf.clone(), query_len=q),
                      meta=dict(B=batch, Q=q, H=heads, seq_lens=lens, dist=dist,
                                page_stride=page_stride, mutation=mutation,
                                graph=graph is not None))
        exp = decode_oracle(case.inputs)
        judge_selection(res, case, backend, exp, got, decode_rows(case.inputs, "cpu"),
                        "decode_indexer", max_failures)
        if not res.ok:
            case.inputs["storage"] = storage.clone()
            res.case_obj, res.expected = case, exp
        res.seconds = time.perf_counter() - t0
        results.append(res)
    return results
