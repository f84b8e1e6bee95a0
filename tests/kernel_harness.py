"""Shared test harness of the Triton kernel tests (not a test module).

Importing it sets ``TRITON_INTERPRET=1`` when there is no CUDA GPU (before any
``nvfp4_indexer.triton`` kernel module is imported: Triton reads it when ``@triton.jit``
decorates a function) and reloads the kernel modules if something imported them compiled.
Under the interpreter the scorers use an IEEE fp32 dot of exactly decoded E4M3 values.

- ``Batch``: paged requests with random page bytes, scattered blocks and poisoned
  everything-else; ``random_q``, ``decode_qsl``.
- Checks (SPEC 9): ``check_selection`` (output structure bit-exact; scores tie-aware against
  the exact reference scores with e = 2^-b * max_t sum_d |q_d K_d|, b = ``SCORE_ERROR_BITS``
  of the dot mode; exact ties by smaller id), ``check_scores``, ``decode_check``;
  ``poisoned_out`` / ``assert_guards`` (poisoned output buffers), ``snapshot`` /
  ``assert_unchanged`` (inputs untouched).
- ``offline_stdout`` / ``offline_lines``: run an offline-compile script (no GPU) in a
  subprocess;
  ``strict_equal``: fp16 bit patterns equal, NaN by position; ``as_bytes`` /
  ``assert_bytes_equal`` / ``random_cache`` (byte-exact kernels); ``prefill_batch``;
  ``gluon_twin_kernel`` / ``gluon_twin_in_place``: the Gluon prefill branch run on the CPU
  through its Triton twin.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede triton's and the kernels' import

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


from bruteforce import storage_view as cache_storage  # noqa: E402  (padding bytes included)
from nvfp4_indexer import reference as ref  # noqa: E402

from nvfp4_indexer.conformance.fixtures import OUT_POISON, selection_out  # noqa: E402
from nvfp4_indexer.conformance.judges import explain_row, tie_aware_check  # noqa: E402
from nvfp4_indexer.conformance.oracles import local_pages as harness_local_pages  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
PAD_STRIDE = 9216 + 48  # a page stride with padding bytes (SPEC 2)
GARBAGE_IDS = (-1, 10**9, 2**31 - 1, -(2**31), 123456)
_MODULES = ("numerics", "dequantize", "layout", "dot_modes", "ptx", "operands", "topk", "scan",
            "prefill.gather", "scoring", "decode.lut", "decode.split_kernel", "decode.select",
            "decode.page_scores", "decode.runner", "scores", "prefill.prefill", "prefill.launch")

def load_kernels(modules=_MODULES) -> dict:
    """The ``nvfp4_indexer.triton.<name>`` modules of ``modules`` (dependency order, numerics
    first) by name, interpreted when there is no GPU (reloaded if imported compiled)."""
    mods = {n: importlib.import_module(f"nvfp4_indexer.triton.{n}") for n in modules}
    if not HAS_CUDA:
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(mods["numerics"].e4m3_round, InterpretedFunction):
            for name in modules:
                mods[name] = importlib.reload(sys.modules[f"nvfp4_indexer.triton.{name}"])
    return mods


K = load_kernels()
TOPK_MOD, DECODE, SCORES, PREFILL = (K["topk"], K["decode.runner"], K["scores"],
                                     K["prefill.launch"])
EMPTY = TOPK_MOD.EMPTY
empty_topk, pack_candidate, topk_insert = (TOPK_MOD.empty_topk, TOPK_MOD.pack_candidate,
                                           TOPK_MOD.topk_insert)
store_candidates, load_candidates, write_selection = (
    TOPK_MOD.store_candidates, TOPK_MOD.load_candidates, TOPK_MOD.write_selection)
nvfp4_page_operands = K["operands"].nvfp4_page_operands
BITS = DECODE.SCORE_ERROR_BITS["fp32" if not HAS_CUDA else K["dot_modes"].DEFAULT_GPU_DOT]


# ------------------------------------------------------------------------------- batch builder

def cache_to_device(cache: torch.Tensor) -> torch.Tensor:
    """Copy a cache view (page stride kept) to the GPU."""
    raw = cache_storage(cache).to(DEV)
    return raw.as_strided(cache.shape, cache.stride())


class Batch:
    """Paged requests with random page bytes, scattered blocks and poisoned everything-else.

    Page bytes are random: codes uniform, scale bytes uniform in [lo, hi] (valid E4M3, no NaN)
    so token norms vary over a few binades. ``alias`` ``(request, j_from, j_to)`` points logical
    page j_to at j_from's physical block (exact ties). Every block that is not a history page
    of some request is poisoned (codes 0xAB, NaN scales), the page stride's padding bytes are
    0xFF, and block-table entries at or past a request's history page count hold garbage ids,
    so a read of anything that is not history shows up as NaN scores or a crash.
    """

    def __init__(self, seq_lens, seed: int, *, page_stride: int = PAD_STRIDE, spare: int = 3,
                 alias=(), width_extra: int = 1, scale_range=(0x28, 0x48), device=DEV):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens_list = [int(s) for s in seq_lens]
        hist = [max(s - 1, 0) // 128 for s in self.seq_lens_list]
        need = [math.ceil(s / 128) for s in self.seq_lens_list]
        total = sum(need) + spare
        self.width = max(need + [1]) + width_extra
        phys = torch.randperm(total, generator=g)
        choice = torch.randint(0, len(GARBAGE_IDS), (len(need), self.width), generator=g)
        bt = torch.tensor(GARBAGE_IDS, dtype=torch.int64)[choice]
        at = 0
        for r, n in enumerate(need):
            bt[r, :hist[r]] = phys[at:at + hist[r]]
            at += n
        for r, j_from, j_to in alias:
            bt[r, j_to] = bt[r, j_from]
        self.cache = ref.new_index_cache(total, device="cpu", page_stride=page_stride)
        raw = cache_storage(self.cache)
        raw.fill_(0xFF)  # padding bytes
        pages = raw.view(total, page_stride)[:, :9216]
        pages[:, :8192] = torch.randint(0, 256, (total, 8192), generator=g, dtype=torch.uint8)
        pages[:, 8192:] = torch.randint(scale_range[0], scale_range[1] + 1, (total, 1024),
                                        generator=g, dtype=torch.uint8)
        history = {int(bt[r, j]) for r in range(len(need)) for j in range(hist[r])}
        for b in range(total):
            if b not in history:
                pages[b, :8192] = 0xAB
                pages[b, 8192:] = 0x7F
        self.history = hist
        if device != "cpu":  # keep the page stride: copy the storage, rebuild the view
            self.cache = cache_to_device(self.cache)
        self.block_table = bt.to(torch.int32).to(device)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32, device=device)

    def page_bytes(self, block: int) -> torch.Tensor:
        """Writable uint8 view of physical page ``block``'s 9216 bytes."""
        flat = cache_storage(self.cache)
        s = self.cache.stride(0)
        return flat[block * s:block * s + 9216]


def random_q(rows: int, heads: int, seed: int, device=DEV) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((rows, heads, 128), generator=g) * 3.0
    return ref.encode_e4m3(x).to(device)


def decode_qsl(b: int, q: int, device=DEV) -> torch.Tensor:
    return torch.arange(b + 1, dtype=torch.int32, device=device) * q


def decode_lens(q_len: int) -> list[int]:
    """0 (padding), tiny, page edges, and long enough for L >= 16 with rows on both sides of
    a page boundary (2050 - Q + i crosses 2048)."""
    return [max(s, q_len) if s else 0 for s in (2100, 0, 1, 127, 128, 129, 2050, 2333)]


def realistic_lens(b: int, max_len: int, q_len: int, seed: int, padding: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(q_len, max_len + 1, (b,), generator=g).tolist()
    lens[0] = max_len
    for i in range(1, 1 + padding):
        lens[i] = 0
    return lens


# ---------------------------------------------------------------------------------- checking

def local_pages(seq_lens: torch.Tensor, qsl: torch.Tensor) -> torch.Tensor:
    """Local page of every row (-1 for padding rows), the harness's ``oracles.local_pages``."""
    return harness_local_pages(seq_lens.cpu(), qsl.cpu())


def check_selection(out, exact, mag, local, bits, aliases=(), rows_request=None):
    """Assert that ``out [N, H, 16]`` passes the harness's SPEC 5 / 9 judge
    (``conformance.judges.tie_aware_check``) against exact scores ``exact [N, H, W]`` (float32,
    -inf off history), magnitudes ``mag [N, H]`` and local pages ``local [N]`` (-1 for padding
    rows). ``aliases``: (request, u, w) pairs of logical pages with identical bytes (u < w): w
    never ranks before u. Returns the number of long rows whose selection differs from the
    reference's (rows that needed the tolerance).
    """
    out, local = out.cpu(), local.cpu()
    tie = tie_aware_check(out, exact.cpu(), mag.cpu(), local, bits)
    bad = (tie.status == 2).nonzero().tolist()
    assert not bad, "; ".join(f"row {t} head {hh}: {explain_row(tie, t, hh)}"
                              for t, hh in bad[:4])
    long_rows = (local >= 16).nonzero().flatten()
    # Exact ties from aliased pages (identical bytes score identically): the smaller id first.
    sel = out[long_rows][..., :15]
    for r, u, v in aliases:
        for k, row in enumerate(long_rows.tolist()):
            if rows_request[row] != r or int(local[row]) <= v:
                continue
            for hh in range(out.shape[1]):
                lst = sel[k, hh].tolist()
                if v in lst:
                    assert u in lst and lst.index(u) < lst.index(v), \
                        f"exact tie {u} < {v} misordered in row {row} head {hh}: {lst}"
    return int((tie.status[long_rows] != 0).any(-1).sum())


def rows_request_of(qsl: torch.Tensor) -> list[int]:
    q = qsl.tolist()
    return [r for r in range(len(q) - 1) for _ in range(q[r + 1] - q[r])]


def check_scores(got, exact, mag, bits):
    """Page scores: -inf / NaN exactly where the reference has them, finite within e."""
    got, exact, mag = got.cpu().double(), exact.cpu().double(), mag.cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(exact)), "-inf positions differ"
    assert torch.equal(torch.isnan(got), torch.isnan(exact)), "NaN positions differ"
    fin = torch.isfinite(exact)
    err = (got - exact).abs()
    e = (2.0 ** -bits) * mag[..., None].expand_as(got)
    bad = fin & (err > e)
    assert not bad.any(), f"score error beyond 2^-{bits} * magnitude at {bad.nonzero()[:4]}"
    rel = torch.where(fin & (mag[..., None] > 0), err / mag[..., None].clamp(min=1e-300),
                      torch.zeros_like(err))
    worst = float(rel.max()) if rel.numel() else 0.0
    return math.inf if worst == 0 else -math.log2(worst)


def decode_check(batch, q, q_len, out, bits, aliases=()):
    qsl = decode_qsl(batch.seq_lens.shape[0], q_len, q.device)
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    return check_selection(out, exact, mag, local_pages(batch.seq_lens, qsl), bits, aliases,
                           rows_request_of(qsl))


def snapshot(batch, q):
    return (cache_storage(batch.cache).clone(), batch.block_table.clone(), batch.seq_lens.clone(),
            q.view(torch.uint8).clone())


def assert_unchanged(batch, q, snap):
    assert torch.equal(cache_storage(batch.cache), snap[0]), "cache modified"
    assert torch.equal(batch.block_table, snap[1]) and torch.equal(batch.seq_lens, snap[2])
    assert torch.equal(q.view(torch.uint8), snap[3]), "index_q modified"


def poisoned_out(rows: int, heads: int, device=DEV):
    """A [rows + 2, H, 16] buffer of OUT_POISON and the contiguous [rows, H, 16] view inside it."""
    big = selection_out(rows + 2, heads, device)
    return big, big[1:rows + 1]


def assert_guards(big):
    assert (big[0] == OUT_POISON).all() and (big[-1] == OUT_POISON).all(), "wrote outside out"




def strict_equal(got_bits: torch.Tensor, want_bits: torch.Tensor) -> None:
    """fp16 bit patterns equal, NaN results compared by position only."""
    got_bits, want_bits = got_bits.cpu(), want_bits.cpu()
    nan = want_bits == 0x7E00
    gnan = ((got_bits & 0x7C00) == 0x7C00) & ((got_bits & 0x3FF) != 0)
    assert torch.equal(nan, gnan)
    assert torch.equal(got_bits[~nan], want_bits[~nan])


ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))


def offline_stdout(script: str, args=(), *, gluon: bool = True, timeout: int = 900) -> str:
    """Run an offline-compile script (``script``: Python source, ``args``: its argv) in a
    subprocess without the interpreter, from the repository root; its stdout. Skips without
    Triton's NVIDIA backend (and Gluon when ``gluon``) or its bundled ptxas; fails on a nonzero
    exit with the end of stderr."""
    try:
        importlib.import_module("triton.backends.nvidia.compiler")
        if gluon:
            importlib.import_module("triton.experimental.gluon._runtime")
    except ImportError:
        pytest.skip("Triton's NVIDIA backend / Gluon is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's bundled ptxas is unavailable")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def offline_lines(script: str) -> list[str]:
    """The stdout lines of an offline-compile report (``offline_stdout``, Gluon needed)."""
    return offline_stdout(script).strip().splitlines()


def sass_report_lines(report: str, archs=(None,)) -> list[str]:
    """The lines of ``benchmarks.sass_stats.<report>(arch)`` for each of ``archs`` (None: the
    report's default target), compiled offline in a subprocess (``offline_lines``)."""
    calls = "".join(f"for line in {report}({'' if a is None else a}):\n    print(line)\n"
                    for a in archs)
    return offline_lines("import os\nos.environ.pop('TRITON_INTERPRET', None)\n"
                         f"from benchmarks.sass_stats import {report}\n" + calls)


def score_bits() -> int:
    """SPEC 9's b of the default dot mode here (fp32 under the interpreter, fp16 on a GPU)."""
    from nvfp4_indexer.triton.decode import SCORE_ERROR_BITS
    from nvfp4_indexer.triton.dot_modes import DEFAULT_GPU_DOT
    return SCORE_ERROR_BITS["fp32" if not HAS_CUDA else DEFAULT_GPU_DOT]

def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as uint8."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t

def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Fail naming the count and the first differing byte of ``got`` and ``want``."""
    got, want = as_bytes(got).cpu(), as_bytes(want).cpu()
    assert got.shape == want.shape
    bad = (got != want).nonzero()
    if len(bad):
        first = tuple(bad[0].tolist())
        pytest.fail(f"{len(bad)} bytes differ, first at {list(first)}: got {int(got[first])}, "
                    f"want {int(want[first])}")

def random_cache(num_blocks: int, gen, page_stride: int = PAD_STRIDE) -> torch.Tensor:
    """A padded cache full of random bytes (corrupt scales included: the gather decodes any)."""
    cache = ref.new_index_cache(num_blocks, device=DEV, page_stride=page_stride)
    st = cache_storage(cache)
    st.copy_(torch.randint(0, 256, (st.numel(),), generator=gen, dtype=torch.int32)
             .to(torch.uint8).to(DEV))
    return cache

def prefill_batch(specs, seed, **kw):
    """A ``Batch`` of prefill requests and its int32 ``cu_seqlens_q``; ``specs``: (q_len,
    seq_len) per request."""
    batch = Batch([s for _, s in specs], seed=seed, **kw)
    qsl = torch.tensor([0] + [sum(q for q, _ in specs[:i + 1]) for i in range(len(specs))],
                       dtype=torch.int32, device=DEV)
    return batch, qsl


# the Gluon prefill kernel's Triton twin (the Gluon branch on the CPU)
prefill_score_kernel = K["prefill.prefill"].prefill_score_kernel


@triton.jit
def gluon_twin_kernel(q_ptr, q_tok_stride, q_head_stride, ws_ptr, ws_off_ptr, req_base, qsl_ptr,
                      seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr, win_ptr, out_ptr,
                      H: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      MMA: tl.constexpr, LD: tl.constexpr, TL: tl.constexpr,
                      K_SL: tl.constexpr, NB: tl.constexpr = 6, FP8: tl.constexpr = 0):
    """The Gluon prefill kernel's parameters (``prefill_wgmma.prefill_wgmma_kernel``) running
    its Triton twin under the Gluon contract (window 1, KEEP 16; fp32 dot, tokens on M: the
    interpreter's): put in the Gluon kernel's place, it lets the Gluon branch run on the CPU."""
    prefill_score_kernel(q_ptr, q_tok_stride, q_head_stride, ws_ptr, ws_off_ptr, req_base,
                         qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr,
                         win_ptr, out_ptr, H, BLOCK_M, NUM_SPLITS, "fp32", 1, 16, False)


def gluon_twin_in_place(monkeypatch):
    """Let the Gluon prefill branch run on the CPU: its probe (``prefill.launch``'s
    ``prefill_wgmma_ok``) says yes and the Gluon kernel is ``gluon_twin_kernel``; the cached
    chunk plans are dropped (drop them again after the test: ``plan_prefill_chunk.
    cache_clear()``). Returns the ``prefill.launch`` module. (An Indexer resolves the branch
    at construction: build it after this call.)"""
    from nvfp4_indexer.triton.prefill import launch, prefill_wgmma
    monkeypatch.setattr(launch, "prefill_wgmma_ok", lambda *a: True)
    monkeypatch.setattr(prefill_wgmma, "prefill_wgmma_kernel", gluon_twin_kernel)
    launch.plan_prefill_chunk.cache_clear()
    return launch
