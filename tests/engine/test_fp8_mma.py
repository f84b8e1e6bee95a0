"""``IndexerConfig(allow_fp8_mma=True)`` (SPEC 9): on SM90 large decode batches and prefill
chunks score with E4M3 operands (rows tie-aware at b = 5), small ones stay exact; on the CPU
the planned launches of the Gluon and Triton prefill chunks."""

from __future__ import annotations

import pytest
import torch

import nvfp4_indexer as ni

from .step_inputs import GLUON_STEP, POISON, gpu_cache, make_config, make_step


@pytest.mark.gpu
def test_allow_fp8_mma_decode_steps():
    """``IndexerConfig(allow_fp8_mma=True)``: on SM90 a decode batch of >= 2048 pages runs the
    "wgflat" scorer with E4M3 operands (kernel dot "fp8", SPEC 9 b = 5; a small one the exact
    kernels), its rows valid tie-aware at b = 5 against the exact scores, in a replayed CUDA
    graph; the shared score scratch covers it."""
    from nvfp4_indexer.conformance.judges import tie_aware_check
    from nvfp4_indexer import reference as ref
    dev = torch.device("cuda")
    nb, b, qlen, width = 2400, 8, 2, 300
    gen = torch.Generator(device=dev).manual_seed(4)
    c = gpu_cache(nb, gen)
    ix = ni.Indexer(make_config(device=dev, max_model_len=width * 128, max_num_seqs=b,
                            allow_fp8_mma=True, num_heads=16))
    seqs = [width * 128 - 5 * i for i in range(b)]
    step = ni.StepMetadata(
        torch.arange(0, b * qlen + 1, qlen, dtype=torch.int32, device=dev),
        torch.arange(0, b * qlen + 1, qlen, dtype=torch.int32),
        torch.tensor(seqs, dtype=torch.int32, device=dev), torch.tensor(seqs, dtype=torch.int32),
        torch.randperm(nb, device=dev)[:b * width].view(b, width).to(torch.int32), b)
    md = ix.plan(step)
    runner = ix.decoder(b, qlen)._runner
    if torch.cuda.get_device_capability(dev) == (9, 0):
        assert runner.dequant == "wgflat" and runner.kernel_dot == "fp8"
        assert runner.error_bits == 5
    q = ni.encode_e4m3(torch.randn(b * qlen, 16, 128, device=dev, generator=gen))
    out = torch.full((b * qlen, 16, 16), POISON, dtype=torch.int32, device=dev)
    ix.forward(q, c, md, out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ix.forward(q, c, md, out)
    out.fill_(POISON)
    g.replay()
    torch.cuda.synchronize()
    qsl = step.query_start_loc
    exact, mag = ref.page_scores(q, c, step.block_table, step.seq_lens, qsl, with_magnitude=True)
    pos = step.seq_lens.repeat_interleave(qlen) - qlen + torch.arange(qlen, device=dev).repeat(b)
    res = tie_aware_check(out, exact, mag, torch.div(pos, 128, rounding_mode="floor"),
                          runner.error_bits)
    assert res.failed == 0
    small = ix.decoder(1, 1)._runner  # 1 request: below FP8_MIN_PAGES_NARROW, exact kernels
    assert small.kernel_dot == "fp16" and small.error_bits == 15


@pytest.mark.gpu
def test_allow_fp8_mma_prefill_step():
    """``IndexerConfig(allow_fp8_mma=True)`` on SM90: prefill chunks score in dot mode "fp8"
    (the Gluon kernel's E4M3 form for a chunk with context), rows valid tie-aware at b = 5;
    without it the same step stays exact (dot fp16)."""
    from nvfp4_indexer.conformance.judges import tie_aware_check
    from nvfp4_indexer import reference as ref
    from nvfp4_indexer.triton.decode import SCORE_ERROR_BITS
    from nvfp4_indexer.triton.prefill.dispatch import prefill_wgmma_ok
    dev = torch.device("cuda")
    nb, new, ctx = 400, 1024, 40000
    gen = torch.Generator(device=dev).manual_seed(6)
    c = gpu_cache(nb, gen)
    seq = new + ctx
    width = -(-seq // 128)
    step = ni.StepMetadata(
        torch.tensor([0, new], dtype=torch.int32, device=dev),
        torch.tensor([0, new], dtype=torch.int32),
        torch.tensor([seq], dtype=torch.int32, device=dev), torch.tensor([seq], dtype=torch.int32),
        torch.randperm(nb, device=dev)[:width].view(1, width).to(torch.int32), 0)
    q = ni.encode_e4m3(torch.randn(new, 4, 128, device=dev, generator=gen))
    exact, mag = ref.page_scores(q, c, step.block_table, step.seq_lens, step.query_start_loc,
                                 with_magnitude=True)
    pos = torch.arange(seq - new, seq, device=dev)
    local = torch.div(pos, 128, rounding_mode="floor")
    for fp8 in (True, False):
        ix = ni.Indexer(make_config(device=dev, max_model_len=width * 128, max_num_seqs=1,
                                max_num_batched_tokens=new, allow_fp8_mma=fp8, num_heads=4))
        want = "fp8" if fp8 and prefill_wgmma_ok(dev, "fp8", True) else "fp16"
        assert ix._settings.fp8 == (want == "fp8") and ix._settings.dot == "fp16"
        md = ix.plan(step)
        out = torch.full((new, 4, 16), POISON, dtype=torch.int32, device=dev)
        ix.forward(q, c, md, out)
        torch.cuda.synchronize()
        bits = SCORE_ERROR_BITS[want]
        assert tie_aware_check(out, exact, mag, local, bits).failed == 0
        # the same launches as the stateless call with the same opt-in (same FP8 kernel form)
        assert torch.equal(out, ni.prefill_indexer(q, c, step.block_table, step.query_start_loc,
                                                   step.seq_lens, allow_fp8_mma=fp8))
        if want == "fp16":
            assert torch.equal(out, ni.prefill_indexer(q, c, step.block_table,
                                                       step.query_start_loc, step.seq_lens,
                                                       backend="reference"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU plumbing check (the GPU test runs it)")
@pytest.mark.parametrize("fp8", [False, True])
def test_engine_fp8_prefill_routing_on_cpu(gluon_twin, monkeypatch, fp8):
    """``IndexerConfig(allow_fp8_mma=True)`` with the Gluon branch forced (CPU): the Gluon
    chunks' planned launches take ``launch_options(fp8=True)``, the Triton chunks the exact
    dot mode; without it, the fp16 form. (Plans only: nothing is launched.)"""
    from nvfp4_indexer.triton.prefill import prefill_wgmma as pw
    monkeypatch.setattr(gluon_twin, "resolve_dot", lambda dot, dev: dot or "fp16")
    ix = ni.Indexer(make_config(max_model_len=2560, max_num_seqs=8, allow_fp8_mma=fp8),
                    backend="triton")
    assert ix._settings.fp8 == fp8 and ix._settings.dot == "fp16"
    md = ix.plan(make_step(*GLUON_STEP, seed=25))
    seen = [(ch.launch["plan"].shape["kernel"], ch.launch["plan"].score.kwargs)
            for ch in md.prefill_chunks]
    assert [k for k, _ in seen] == ["wgmma", "triton"], seen
    opts = {k: v for k, v in seen[0][1].items() if k not in ("H", "BLOCK_M", "NUM_SPLITS")}
    assert opts == pw.launch_options(fp8)
    assert seen[1][1]["DOT"] == "fp16" and seen[1][1]["TOKENS_N"]
