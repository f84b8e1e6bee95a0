"""Shared step builders of the engine tests (not a test module): the Indexer config, random
steps, queries, the expected rows (the public ops on the same step), a forward into a poisoned
output checked against them, and a CUDA cache. The CPU cache the tests read: ``conftest.py``'s
``cache`` fixture."""

from __future__ import annotations

import numpy as np
import torch

import nvfp4_indexer as ni

from nvfp4_indexer.conformance.fixtures import OUT_POISON as POISON

H = 2
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: the interpreter off CUDA

# (query lengths, seq lens, decode requests): decode Q=2 + prefill requests (36 history pages)
MIXED = ([2, 2, 2, 100, 37, 300], [2500, 300, 2950, 2100, 37, 2600], 3)

# a step whose first prefill request (40 tokens x 2 heads: BLOCK_M 128, 18 history pages)
# is a chunk of its own on the Gluon kernel (2 splits of 9 pages), the other two a chunk of
# BLOCK_M 64 on the Triton kernel
GLUON_STEP = ([2, 40, 10, 30], [2500, 2400, 2100, 300], 1)


def make_config(**kw):
    """An ``IndexerConfig`` of ``H`` heads, max_model_len 3072 (24 pages), 512 batched tokens,
    6 sequences, decode Q up to 4, graph sizes 1, 2, 4, 8; ``kw`` overrides."""
    args = dict(num_heads=H, max_model_len=3072, max_num_batched_tokens=512, max_num_seqs=6,
                max_decode_query_len=4, cudagraph_batch_sizes=(1, 2, 4, 8))
    args.update(kw)
    return ni.IndexerConfig(**args)


def make_step(q_lens, seqs, nd, width=26, nb=96, seed=0, upper=None):
    """A CPU ``StepMetadata``: query lengths ``q_lens``, seq lens ``seqs``, the first ``nd``
    requests decodes, a random ``[len(seqs), width]`` block table of ids below ``nb``;
    ``upper``: host seq lens (an upper bound) instead of ``seqs``."""
    gen = torch.Generator().manual_seed(seed)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    sl = torch.tensor(seqs, dtype=torch.int32)
    bt = torch.randint(0, nb, (len(seqs), width), dtype=torch.int32, generator=gen)
    sl_cpu = sl.clone() if upper is None else torch.tensor(upper, dtype=torch.int32)
    return ni.StepMetadata(qsl.clone(), qsl, sl, sl_cpu, bt, nd)


def queries(rows, seed=1):
    """Random E4M3 index queries ``[rows, H, 128]``."""
    gen = torch.Generator().manual_seed(seed)
    return ni.encode_e4m3(torch.randn(rows, H, 128, generator=gen))


def check_forward(ix, cache, md, step, nd, extra, seed=1, truth=None):
    """``ix.forward`` of the step's rows plus ``extra`` random query rows into an output
    poisoned everywhere: the step's rows equal the public ops (``expected_rows``, decode query
    length 2) on ``truth`` (default ``step``), the rest stays poisoned. Returns ``(q, out)``."""
    rows = int(step.query_start_loc_cpu[-1])
    q = queries(rows + extra, seed=seed)
    out = torch.full((rows + extra, H, 16), POISON, dtype=torch.int32)
    assert ix.forward(q, cache, md, out) is out
    assert torch.equal(out[:rows], expected_rows(q, cache, step if truth is None else truth, nd, 2))
    assert bool((out[rows:] == POISON).all())
    return q, out


def expected_rows(q, cache, step, nd, qlen):
    """decode_indexer on the decode rows, prefill_indexer on the rest (public API)."""
    sl, bt, qsl = step.seq_lens, step.block_table, step.query_start_loc_cpu
    parts = []
    if nd:
        parts.append(ni.decode_indexer(q[:nd * qlen], cache, bt[:nd], sl[:nd], qlen,
                                       backend="reference"))
    if nd < len(sl):
        p0, p1 = int(qsl[nd]), int(qsl[-1])
        parts.append(ni.prefill_indexer(q[p0:p1], cache, bt[nd:], qsl[nd:] - qsl[nd], sl[nd:],
                                        backend="reference"))
    return torch.cat(parts)


def gpu_cache(nb, gen=None):
    """A CUDA cache of ``nb`` blocks: random keys (``gen``: a CUDA generator) in a random slot
    order."""
    dev = torch.device("cuda")
    c = ni.new_index_cache(nb, device=dev)
    ni.write_index_k(c, torch.randn(nb * 128, 128, device=dev, generator=gen),
                     torch.randperm(nb * 128, device=dev, generator=gen))
    return c
