"""The backend hook: one callable per operation under test.

A backend is a :class:`Backend` — a dataclass of callables with the signatures of the public
API (SPEC 11) minus its ``backend=`` keyword. Any callable may be ``None``: checks of that op
are then reported as skipped. Built-ins:

* ``reference`` — ``nvfp4_indexer`` with ``backend="reference"`` (exact: no score tolerance).
* ``triton`` — ``nvfp4_indexer`` with ``backend="triton"``; its score error bound is
  ``nvfp4_indexer.triton.decode.SCORE_ERROR_BITS`` of the dot mode the API uses on the device.
  On a CPU it needs the Triton interpreter (``--interpret``).
* ``triton-fp8`` — ``triton`` with the decode wrappers' opt-in ``allow_fp8_mma=True`` (E4M3
  operands on SM90's FP8 tensor cores where faster), judged with dot mode "fp8"'s bound
  (b = 5); its ``decode_indexer`` runs such a wrapper (plan, then one eager run), its
  ``prefill_indexer`` passes ``allow_fp8_mma=True`` (the Gluon prefill kernel's E4M3 form on
  SM90) and its ``make_indexer`` builds an ``Indexer`` of ``IndexerConfig(allow_fp8_mma=True)``.

A third-party backend is named ``module:attr`` (``--backend mypkg.mymod:make_backend``):
``attr`` is a :class:`Backend` instance or a callable returning one; a callable is given the
requested device (``make_backend(device="cuda")``) when it accepts a ``device`` keyword.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

#: SPEC 9's default b (e = 2^-16 * max over the row's history tokens of sum_d |q_d K_d|): the
#: Triton interpreter's "fp32" dot mode documents it.
DEFAULT_TRITON_BITS = 16


@dataclass
class Backend:
    """Callables under test (signatures as in ``nvfp4_indexer``, without ``backend=``).

    Attributes:
        name: label in reports and reproducers.
        device: torch device the callables take tensors on (``"cpu"`` or ``"cuda"``).
        encode_e4m3: ``(x) -> float8_e4m3fn`` (SPEC 1.1).
        quantize_nvfp4: ``(x [..., 128]) -> (codes uint8 [..., 64], scales float8 [..., 8])``.
        dequantize_nvfp4: ``(codes, scales, dtype) -> [..., 128]`` (dtype float8 or float32).
        write_index_k: ``(cache, k [T, 128], slot_mapping [T]) -> None``.
        insert_index_k: ``(cache, k, positions, slot_mapping, k_norm_weight, cos_sin_cache, *,
            rotary_dim, eps) -> None``.
        prepare_index_q: ``(q [T, H, 128], positions, q_norm_weight, cos_sin_cache, *,
            rotary_dim, eps) -> float8_e4m3fn [T, H, 128]``.
        gather_index_k_fp8: ``(cache, block_table, seq_lens) -> (workspace, page_offsets)``.
        page_scores: ``(index_q, cache, block_table, seq_lens, query_start_loc) -> float32
            [T, H, W]`` (optional: checked within the score bound).
        decode_indexer: ``(index_q, cache, block_table, seq_lens, query_len, *, out) -> int32``.
        prefill_indexer: ``(index_q, cache, block_table, cu_seqlens_q, seq_lens, *,
            max_gather_pages, out) -> int32``.
        make_decode_wrapper: ``(num_heads, *, block_table_buffer, seq_lens_buffer,
            use_cuda_graph) -> wrapper`` with ``plan(block_table, seq_lens, query_len, *,
            num_blocks)`` and ``run(index_q, cache, out)`` (SPEC 6).
        make_indexer: ``(config: nvfp4_indexer.IndexerConfig) -> indexer`` with ``plan(step)``
            and ``forward(index_q, cache, metadata, out)`` (SPEC 8.1; the ``engine`` check).
        score_error_bits: b of SPEC 9's bound e = 2^-b * max sum |q K| — an int, ``None`` for
            exact scores (selection must then equal the reference bit for bit), or a mapping
            from op name ("decode_indexer", "prefill_indexer", "page_scores") to either, with an
            optional "default" entry.
        exact_insert: True when insert/prepare must match the reference bit for bit (no SPEC 3
            boundary band).
        capturable: True when the wrapper's ``run()`` can be captured in a CUDA graph.
    """

    name: str
    device: str = "cpu"
    encode_e4m3: Callable | None = None
    quantize_nvfp4: Callable | None = None
    dequantize_nvfp4: Callable | None = None
    write_index_k: Callable | None = None
    insert_index_k: Callable | None = None
    prepare_index_q: Callable | None = None
    gather_index_k_fp8: Callable | None = None
    page_scores: Callable | None = None
    decode_indexer: Callable | None = None
    prefill_indexer: Callable | None = None
    make_decode_wrapper: Callable | None = None
    make_indexer: Callable | None = None
    score_error_bits: int | None | Mapping[str, int | None] = None
    exact_insert: bool = False
    capturable: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def bits(self, op: str) -> int | None:
        """Score bound bits for ``op`` (None: exact)."""
        b = self.score_error_bits
        if isinstance(b, Mapping):
            if op in b:
                return b[op]
            short = op.replace("_indexer", "")
            if short in b:
                return b[short]
            if "default" in b:
                return b["default"]
            vals = [v for v in b.values() if v is not None]
            return min(vals) if vals else None  # the loosest bound any op documents
        return b

    def describe(self) -> dict:
        return {"name": self.name, "device": self.device,
                "score_error_bits": dict(self.score_error_bits)
                if isinstance(self.score_error_bits, Mapping) else self.score_error_bits,
                "exact_insert": self.exact_insert, "capturable": self.capturable,
                "ops": [op for op in OPS if getattr(self, op) is not None], **self.info}


#: Operations a backend may provide (its callable fields), in the order checks run them.
OPS = tuple(f.name for f in dataclasses.fields(Backend) if f.type == "Callable | None")


def api_backend(name: str, device: str, **overrides) -> Backend:
    """A backend made of ``nvfp4_indexer`` API calls with ``backend=name``."""
    import nvfp4_indexer as nv

    def bind(fn):
        return functools.partial(fn, backend=name)

    def wrapper(num_heads, *, block_table_buffer, seq_lens_buffer, use_cuda_graph=True):
        return nv.DecodeIndexerWrapper(num_heads, block_table_buffer=block_table_buffer,
                                       seq_lens_buffer=seq_lens_buffer,
                                       use_cuda_graph=use_cuda_graph, backend=name)

    def make_indexer(config):
        return nv.Indexer(config, backend=name)

    ops = {op: bind(getattr(nv, op)) for op in OPS
           if op not in ("make_decode_wrapper", "make_indexer")}
    ops["make_decode_wrapper"] = wrapper
    ops["make_indexer"] = make_indexer
    ops.update(overrides)
    return Backend(name=name, device=device, **ops)


def reference_backend(device: str = "cpu") -> Backend:
    """The bit-exact reference (exact scores, exact insert; its wrapper is not capturable)."""
    return api_backend("reference", device, score_error_bits=None, exact_insert=True,
                       capturable=False)


def triton_score_bits(device="cpu") -> tuple[Any, str]:
    """(bits, source) of the Triton backend on ``device`` (SPEC 9's b).

    ``nvfp4_indexer.triton.decode.SCORE_ERROR_BITS`` is an int or a dict keyed by dot mode;
    the mode the API uses on ``device`` is ``dot_modes.resolve_dot(None, device)`` ("fp32" in the
    interpreter / off CUDA, the GPU default dot mode on a GPU).

    Raises:
        ImportError: Triton or the Triton backend cannot be imported.
        KeyError: ``SCORE_ERROR_BITS`` documents no bound for that dot mode.
    """
    from nvfp4_indexer.triton import decode
    from nvfp4_indexer.triton.dot_modes import resolve_dot
    bits = decode.SCORE_ERROR_BITS
    if not isinstance(bits, Mapping):
        return bits, "nvfp4_indexer.triton.decode.SCORE_ERROR_BITS"
    key = resolve_dot(None, torch.device(device))
    return bits[key], f"nvfp4_indexer.triton.decode.SCORE_ERROR_BITS[{key!r}]"


def triton_backend(device: str | None = None) -> Backend:
    """The Triton backend on ``device`` (CUDA when available, else CPU under the interpreter)."""
    import os
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the triton backend on CPU needs the Triton interpreter: pass "
                           "--interpret (sets TRITON_INTERPRET=1 before Triton is imported)")
    bits, source = triton_score_bits(device)
    b = api_backend("triton", device, score_error_bits=bits, exact_insert=False,
                    capturable=torch.device(device).type == "cuda")
    b.info["score_error_bits_source"] = source
    b.info["interpreter"] = os.environ.get("TRITON_INTERPRET") == "1"
    return b


def triton_fp8_backend(device: str | None = None) -> Backend:
    """The Triton backend with ``allow_fp8_mma=True`` decode wrappers, prefill calls and
    indexers (see the module doc);
    score bound ``SCORE_ERROR_BITS["fp8"]`` (exact paths are inside it)."""
    import nvfp4_indexer as nv
    from nvfp4_indexer.triton.decode import SCORE_ERROR_BITS
    b = triton_backend(device)

    def wrapper(num_heads, *, block_table_buffer, seq_lens_buffer, use_cuda_graph=True):
        return nv.DecodeIndexerWrapper(num_heads, block_table_buffer=block_table_buffer,
                                       seq_lens_buffer=seq_lens_buffer,
                                       use_cuda_graph=use_cuda_graph, backend="triton",
                                       allow_fp8_mma=True)

    def decode_indexer(index_q, cache, block_table, seq_lens, query_len, *, out=None):
        w = wrapper(index_q.shape[1], block_table_buffer=block_table.contiguous().clone(),
                    seq_lens_buffer=seq_lens.contiguous().clone(), use_cuda_graph=False)
        w.plan(block_table, seq_lens, query_len, num_blocks=cache.shape[0])
        if out is None:
            out = torch.empty((index_q.shape[0], index_q.shape[1], 16), dtype=torch.int32,
                              device=index_q.device)
        return w.run(index_q, cache, out)

    def make_indexer(config):
        return nv.Indexer(dataclasses.replace(config, allow_fp8_mma=True), backend="triton")

    b = dataclasses.replace(b, name="triton-fp8", make_decode_wrapper=wrapper,
                            decode_indexer=decode_indexer, make_indexer=make_indexer,
                            prefill_indexer=functools.partial(nv.prefill_indexer,
                                                              backend="triton",
                                                              allow_fp8_mma=True),
                            score_error_bits=SCORE_ERROR_BITS["fp8"])
    b.info["score_error_bits_source"] = 'nvfp4_indexer.triton.decode.SCORE_ERROR_BITS["fp8"]'
    return b


def load_backend(spec: str, device: str | None = None) -> Backend:
    """Resolve ``spec``: "reference", "triton", "triton-fp8", or "module:attr" (see the module
    doc).

    Raises:
        ValueError: a malformed spec, or ``attr`` that is neither a Backend nor a factory of one.
        ImportError: the module cannot be imported.
    """
    if spec == "reference":
        return reference_backend(device or "cpu")
    if spec == "triton":
        return triton_backend(device)
    if spec == "triton-fp8":
        return triton_fp8_backend(device)
    if ":" not in spec:
        raise ValueError(f"--backend: expected 'reference', 'triton', 'triton-fp8' or "
                         f"'module:attr', got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    obj = getattr(importlib.import_module(mod_name), attr)
    if callable(obj) and not isinstance(obj, Backend):
        kwargs = {}
        if device is not None and "device" in inspect.signature(obj).parameters:
            kwargs["device"] = device
        obj = obj(**kwargs)
    if not isinstance(obj, Backend):
        raise ValueError(f"--backend {spec}: expected a conformance.Backend or a callable "
                         f"returning one, got {type(obj).__name__}")
    return obj
