"""``Indexer.memory_bytes()`` and the buffers it sizes (SPEC 8.1, 10): the figures equal the
allocations, the Triton score scratch covers every decode runner, configs the device cannot
hold are refused before anything is allocated."""

from __future__ import annotations

import pytest
import torch

import nvfp4_indexer as ni

from .step_inputs import DEV, H, make_config


def test_memory_report():
    c = make_config()
    ix = ni.Indexer(c, backend="reference")
    m = ix.memory_bytes()
    assert m["workspace"] == c.gather_pages * 128 * 128
    assert m["decode_buffers"] == c.max_decode_reqs * (c.max_pages + 1) * 4
    assert m["total_device"] == m["workspace"] + m["score_scratch"] + m["decode_buffers"] + \
        m["staging_device"]
    big = ni.Indexer(make_config(max_model_len=6144), backend="reference").memory_bytes()
    assert big["workspace"] == 2 * m["workspace"]


def test_memory_report_triton_scratch_covers_every_decode_runner():
    from nvfp4_indexer.triton.decode import score_buffer_size
    c = make_config()
    ix = ni.Indexer(c, backend="triton")
    need = max(score_buffer_size(b, c.max_pages, H, q) for b in range(1, 9) for q in range(1, 5))
    assert ix.score_buffer.numel() >= need
    assert ix.memory_bytes()["score_scratch"] == ix.score_buffer.numel() * 4


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_indexer_buffers_past_memory_name_the_field(backend):
    """SPEC 10: configs whose buffers the device cannot hold are refused before anything is
    allocated, naming the field that sized the largest buffer, the bytes and
    ``memory_bytes()``'s figures (before: the allocator's own message, or a 1 TB
    workspace on a large host)."""
    huge = dict(max_model_len=2 ** 31 - 1, max_num_batched_tokens=2 ** 31 - 1, device=DEV)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens: expected a size that fits "
                       r".*workspace, 1099511627776 bytes; memory_bytes\(\): workspace="):
        ni.Indexer(make_config(**huge), backend=backend)
    from nvfp4_indexer.validation import device_memory_bytes
    if device_memory_bytes(torch.device(DEV)) < 275 * 10 ** 9:  # the 275 GB workspace
        with pytest.raises(ValueError, match=r"max_model_len: expected .*2147483647 sizes "
                           r"workspace, 274877906944 bytes"):
            ni.Indexer(make_config(max_model_len=2 ** 31 - 1, device=DEV), backend=backend)


def test_memory_bytes_computed_before_allocating_equal_the_buffers():
    """``memory_bytes()`` comes from the config (computed before allocating) and equals the
    buffers' sizes."""
    for backend in ("reference", "triton"):
        ix = ni.Indexer(make_config(), backend=backend)
        nb = lambda t: t.numel() * t.element_size()  # noqa: E731
        m = ix.memory_bytes()
        assert m["workspace"] == nb(ix.workspace)
        assert m["score_scratch"] == nb(ix.score_buffer)
        assert m["decode_buffers"] == nb(ix.decode_block_table) + nb(ix.decode_seq_lens)
        assert m["staging_host"] == sum(nb(s.host) for s in ix._staging)
        assert m["staging_device"] == (0 if ix.device.type == "cpu" else
                                       sum(nb(s.dev) for s in ix._staging))
