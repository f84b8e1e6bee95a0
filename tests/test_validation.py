"""The shared checks of ``nvfp4_indexer.validation`` (SPEC 10): byte spans and overlap, the
same-tensor test and plan() copies, device resolution and comparison, the fp32 eps rule
(SPEC 3), allocation sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvfp4_indexer import validation as v

HAS_CUDA = torch.cuda.is_available()


def test_byte_span_covers_every_element():
    t = torch.zeros(4, 6, dtype=torch.int32)
    lo = t.data_ptr()
    assert v.byte_span(t) == (lo, lo + 96)
    assert v.byte_span(t[1:, 2:4]) == (lo + 32, lo + 32 + (2 * 6 + 1 + 1) * 4)
    assert v.byte_span(t[:1].expand(3, 6)) == (lo, lo + 24)  # stride 0: one row
    assert v.byte_span(t.t()) == (lo, lo + 96)
    assert v.byte_span(t[:, :0]) == (0, 0)


def test_overlaps_and_check_no_overlap():
    buf = torch.zeros(64, dtype=torch.int32)
    a, b, c = buf[:16], buf[16:32], buf[15:20]
    assert not v.overlaps(a, b) and v.overlaps(a, c) and v.overlaps(b, c)
    assert v.overlaps(buf[::2], buf[1::2])  # interleaved: conservative
    assert not v.overlaps(buf[:0], buf)
    assert not v.overlaps(buf, torch.zeros(64, dtype=torch.int32))
    v.check_no_overlap("out", a, (("x", b), ("y", None), ("z", buf[:0])))
    with pytest.raises(ValueError, match=r"out: expected memory that overlaps no input \(it "
                       r"is written while y is read\), got bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\) "
                       r"overlapping y's"):
        v.check_no_overlap("out", a, (("x", b), ("y", c)))
    with pytest.raises(ValueError, match="span"):
        v.check_no_overlap("out", a, (("span", v.byte_span(buf)),))
    u8 = buf.view(torch.uint8)  # other dtypes: bytes count
    with pytest.raises(ValueError, match="bytes"):
        v.check_no_overlap("out", u8[60:70], (("bytes", a),))
    v.check_no_overlap("out", u8[64:70], (("bytes", a),))


def test_same_tensor_is_more_than_the_first_address():
    t = torch.arange(8, dtype=torch.int32)
    assert v.same_tensor(t, t.view(8)) and v.same_tensor(t[:4], t[:4])
    assert not v.same_tensor(t[:2], t[:1].expand(2))  # same address, stride 0
    assert not v.same_tensor(t[:4], t[:2])
    assert not v.same_tensor(t, t.view(torch.float32))
    assert not v.same_tensor(t.view(2, 4), t.view(4, 2))


def test_copy_planned_copies_aliases_from_clones():
    buf = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    v.copy_planned(((buf[:1].expand(4), buf),))
    assert buf.tolist() == [5, 5, 5, 5]
    buf = torch.arange(6, dtype=torch.int32)
    v.copy_planned(((buf[:5], buf[1:]),))  # torch alone refuses this overlap
    assert buf.tolist() == [0, 0, 1, 2, 3, 4]
    bt, sl = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    src = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    # the seq lens source is inside the block table buffer: read before that is overwritten
    bt.view(-1)[4:6] = torch.tensor([9, 10], dtype=torch.int32)
    v.copy_planned(((bt.view(-1)[4:6], sl), (src, bt)))
    assert sl.tolist() == [9, 10] and torch.equal(bt, src)
    v.copy_planned(((bt, bt), (sl, sl)))  # the buffers themselves: nothing to do
    assert sl.tolist() == [9, 10] and torch.equal(bt, src)


def test_on_device_follows_torch():
    cpu = torch.zeros(1)
    assert v.on_device(cpu, "cpu") and v.on_device(cpu, "cpu:0")
    assert v.on_device(cpu, torch.device("cpu", 0))
    assert not v.on_device(cpu, "meta") and not v.on_device(cpu, "cuda")
    v.check_tensor("x", cpu, device="cpu:0")
    with pytest.raises(ValueError, match="x: expected a tensor on cuda"):
        v.check_tensor("x", cpu, device="cuda")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_on_device_cuda_index_only_where_given():
    cur = torch.cuda.current_device()
    t = torch.zeros(1, device="cuda")
    assert t.device.index == cur
    assert v.on_device(t, "cuda") and v.on_device(t, f"cuda:{cur}")
    assert v.check_device("device", "cuda") == torch.device("cuda", cur)
    if torch.cuda.device_count() > 1:
        other = torch.zeros(1, device=f"cuda:{(cur + 1) % torch.cuda.device_count()}")
        assert not v.on_device(other, "cuda")  # "cuda" is the current device
        assert not v.on_device(t, other.device)


def test_check_device():
    assert v.check_device("device", "cpu:0") == torch.device("cpu")
    assert v.check_device("device", None) == torch.get_default_device()
    assert v.check_device("device", torch.device("cpu")) == torch.device("cpu")
    for bad in ("bogus", 3.5, "cuda:64"):
        with pytest.raises(ValueError, match="dev: expected"):
            v.check_device("dev", bad)
    if not HAS_CUDA:
        with pytest.raises(ValueError, match=r"dev: expected a device that exists \(no CUDA"):
            v.check_device("dev", "cuda")


@pytest.mark.parametrize("eps", [1e-300, 1e-46, 1e39, float("inf"), -float("inf"),
                                 float("nan"), 0.0, -1e-6, True, "1e-6", None,
                                 np.float64(1e-60), 10 ** 400])
def test_check_eps_refuses(eps):
    with pytest.raises(ValueError, match="eps: expected a real number"):
        v.check_eps(eps)


@pytest.mark.parametrize("eps", [1e-6, 1e-40, np.float32(1e-5), 1, 3.4e38])
def test_check_eps_accepts(eps):
    assert v.check_eps(eps) == float(eps)


def test_check_fits_and_allocate():
    cpu = torch.device("cpu")
    v.check_fits("n", 1024, cpu, "n=1")
    with pytest.raises(ValueError, match=r"n: expected a size that fits .*, got "
                       r"9223372036854775808 bytes \(n=huge\)"):
        v.check_fits("n", 2 ** 63, cpu, "n=huge")
    assert v.allocate("n", 8, cpu, "n=2", lambda: torch.zeros(2)).shape == (2,)

    def refused():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 bytes")
    with pytest.raises(ValueError, match=r"n: expected a size cpu can allocate, got 8 bytes "
                       r"\(n=2\): CUDA out of memory"):
        v.allocate("n", 8, cpu, "n=2", refused)


def test_check_plan_buffers_refuses_overlapping_buffers():
    buf = torch.zeros(10, dtype=torch.int32)
    bt = buf[:8].view(2, 4)
    assert v.check_plan_buffers(bt, buf[8:]) == torch.device("cpu")
    with pytest.raises(ValueError, match="seq_lens_buffer: .*block_table_buffer"):
        v.check_plan_buffers(bt, buf[6:8])
