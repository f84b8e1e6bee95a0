"""``copy_graphs.CopyGraphs``: repeated device-to-device copies replayed from CUDA graphs
(host time of ``Indexer.plan``). CPU: the bookkeeping (when a key is captured, replays, LRU),
with the capture replaced by a recorded copy. GPU: real graphs, contents changed between
replays, a busy stream (the Indexer's use: tests/engine/test_graphs.py,
``test_decode_steps_replay_their_copies``)."""

from __future__ import annotations

import warnings

import pytest
import torch

import nvfp4_indexer as ni
from nvfp4_indexer.copy_graphs import CopyGraphs


class _FakeGraph:
    """What a captured copy does when replayed: the same copy, reading the sources then."""

    def __init__(self, dst, src):
        self.dst, self.src = dst, src

    def replay(self):
        for d, s in zip(self.dst, self.src):
            d.copy_(s)


def _indexer():
    """A reference-backend Indexer whose decode wrappers copy block tables of up to 24 pages."""
    return ni.Indexer(ni.IndexerConfig(num_heads=2, max_model_len=3072,
                                       max_num_batched_tokens=512, max_num_seqs=6,
                                       max_decode_query_len=4,
                                       cudagraph_batch_sizes=(1, 2, 4, 8)),
                      backend="reference")


def _fake(monkeypatch):
    monkeypatch.setattr(CopyGraphs, "_capture", lambda self, dst, src: _FakeGraph(dst, src))


def test_capture_after_and_replays(monkeypatch):
    _fake(monkeypatch)
    cg = CopyGraphs(capacity=2, capture_after=2)
    dst = [torch.zeros(4, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32)]
    src = [torch.arange(4, dtype=torch.int32), torch.ones(2, 3, dtype=torch.int32)]
    cg.copy("a", dst, src)
    assert (cg.captures, cg.replays, len(cg)) == (0, 0, 0)
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[1], src[1])
    src[0] += 10  # sources rewritten in place between steps: the next copy sees them
    cg.copy("a", dst, src)
    assert (cg.captures, cg.replays, len(cg)) == (1, 0, 1)
    assert torch.equal(dst[0], src[0])
    src[1].fill_(7)
    cg.copy("a", dst, src)
    assert (cg.captures, cg.replays) == (1, 1)
    assert torch.equal(dst[1], src[1])


def test_lru_and_one_time_keys(monkeypatch):
    _fake(monkeypatch)
    cg = CopyGraphs(capacity=2, capture_after=1)
    dst, src = [torch.zeros(3)], [torch.ones(3)]
    for k in ("a", "b", "a", "c"):  # "a" used again before "c": "b" is the one dropped
        cg.copy(k, dst, src)
    assert list(cg._graphs) == ["a", "c"] and cg.captures == 3 and cg.replays == 1
    cg2 = CopyGraphs(capacity=2, capture_after=3)
    for i in range(100):  # keys seen once only: never captured, the memory stays bounded
        cg2.copy(i, dst, src)
    assert len(cg2) == 0 and len(cg2._seen) <= 8


def test_max_captures_then_eager(monkeypatch):
    _fake(monkeypatch)
    cg = CopyGraphs(capacity=2, capture_after=1, max_captures=3)
    dst, src = [torch.zeros(3)], [torch.ones(3)]
    for i in range(10):  # a new key every step (fresh tensors): 3 captures, then eager
        src[0].fill_(i)
        cg.copy(i, dst, src)
        assert torch.equal(dst[0], src[0])
    assert cg.captures == 3 and list(cg._graphs) == [1, 2]
    cg.copy(2, dst, src)  # a kept graph still replays
    assert cg.replays == 1


def test_failed_capture_warns_and_stays_eager(monkeypatch):
    def boom(self, dst, src):
        raise RuntimeError("capture refused")
    monkeypatch.setattr(CopyGraphs, "_capture", boom)
    cg = CopyGraphs(capture_after=1)
    dst, src = [torch.zeros(3)], [torch.ones(3)]
    with pytest.warns(RuntimeWarning, match="capture refused"):
        cg.copy("k", dst, src)
    assert torch.equal(dst[0], src[0]) and not cg.enabled and len(cg) == 0
    src[0].fill_(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cg.copy("k", dst, src)  # eager, no second warning
    assert torch.equal(dst[0], src[0])


class _DropShape(CopyGraphs):  # a wrong key: without the block table's shape
    def copy(self, key, dst, src):
        super().copy((key[0], key[2], key[3]), dst, src)


class _DropStride(CopyGraphs):  # a wrong key: without its strides
    def copy(self, key, dst, src):
        super().copy((key[0], key[1], key[3]), dst, src)


class _DropSeqLens(CopyGraphs):  # a wrong key: without the seq lens' address
    def copy(self, key, dst, src):
        super().copy(key[:3], dst, src)


@pytest.mark.parametrize("cls", [CopyGraphs, _DropShape, _DropStride, _DropSeqLens])
def test_indexer_key_separates_views_of_one_storage(monkeypatch, cls):
    """The Indexer's key (block table address, shape, stride; seq lens address) tells apart
    three block tables over one storage ([4, 26], its [:, :20] view, a contiguous [4, 20]),
    each planned with two seq lens tensors in turn. Every plan copies exactly the step's
    entries (the rest of the buffer stays -7) and seq lens; a key without the shape, the
    stride or the seq lens' address fails this."""
    _fake(monkeypatch)
    ix = _indexer()
    dec = ix.decoder(4, 1)
    dec._copies = cls(capture_after=1)
    qsl = torch.arange(5, dtype=torch.int32)
    store = torch.randint(0, 90, (4 * 26,), dtype=torch.int32)
    views = [store.view(4, 26), store.view(4, 26)[:, :20], store[:80].view(4, 20)]
    seq_lens = [torch.tensor([100, 200, 300, 400], dtype=torch.int32),
                torch.tensor([1500, 700, 2500, 9], dtype=torch.int32)]
    ok = True
    for _ in range(2):
        for bt in views:
            for sl in seq_lens:
                ix.decode_block_table.fill_(-7)
                ix.plan(ni.StepMetadata(qsl, qsl, sl, sl.clone(), bt, 4))
                w = min(bt.shape[1], 24)
                ok &= torch.equal(ix.decode_block_table[:4, :w], bt[:, :w])
                ok &= bool((ix.decode_block_table[:4, w:] == -7).all())
                ok &= torch.equal(ix.decode_seq_lens[:4], sl)
    assert ok == (cls is CopyGraphs)
    assert dec._copies.replays > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity"):
        CopyGraphs(capacity=0)
    with pytest.raises(ValueError, match="capture_after"):
        CopyGraphs(capture_after=0)
    with pytest.raises(ValueError, match="max_captures"):
        CopyGraphs(max_captures=0)


def test_cpu_indexer_copies_eagerly():
    """Off CUDA the decode wrappers copy with ``torch._foreach_copy_`` (no cache)."""
    ix = _indexer()
    assert ix.decoder(2, 1)._copies is None


# ------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_graph_copies_read_the_sources_at_replay():
    dev = torch.device("cuda")
    cg = CopyGraphs(dev, capacity=2, capture_after=2)  # its stream made here
    dst = [torch.zeros(8, dtype=torch.int32, device=dev),
           torch.zeros(8, 40, dtype=torch.int32, device=dev)[:, :30]]
    src = [torch.zeros(8, dtype=torch.int32, device=dev),
           torch.zeros(8, 30, dtype=torch.int32, device=dev)]
    torch._foreach_copy_(dst, src)  # first use of each kernel (lazy loading) outside the loop
    torch.randint(0, 1000, (8, 30), device=dev).fill_(0)
    torch.cuda.synchronize()
    for i in range(5):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: copies and the capture are queued behind it
        src[0].fill_(i)
        src[1].copy_(torch.randint(0, 1000, (8, 30), device=dev))
        cg.copy("k", dst, src)
        assert not torch.cuda.current_stream().query()  # no sync: the sleep still runs
        want = [s.clone() for s in src]
        torch.cuda.synchronize()
        assert torch.equal(dst[0], want[0]) and torch.equal(dst[1], want[1])
    assert (cg.captures, cg.replays) == (1, 3)
    base = dst[1].as_strided((8, 40), (40, 1))
    assert bool((base[:, 30:] == 0).all())  # nothing past the destination view
