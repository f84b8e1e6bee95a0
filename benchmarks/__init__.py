"""Benchmark suite of nvfp4_indexer: ``python -m benchmarks --help`` (from the repository root).

Suites: decode-full (28 weighted cases), decode-lowlat (12), decode-variants (Q = 1, H = 1, 2),
prefill (18), gather (the prefill cases' pages), insert (16K tokens into a 1M-token cache),
engine (``Indexer.plan`` / ``forward`` per step of a continuous-batching trace),
decode-engine-width (decode cases with 8192-page block tables against their natural width).
Each run measures its own ceilings (device-to-device copy, cuBLAS FP8 matmul), times CUDA-graph
replays over cold-cache rotated page sets, compares once against the PyTorch reference, and
writes JSON, Markdown tables and a roofline PNG. ``--cpu-smoke`` runs every code path on CPU
at tiny sizes with the reference backend (no timing claims). Method: docs/performance.md.

Modules: ``__main__`` (the CLI), ``suites`` (suite registry, run, summaries), ``context``
(shared context and record fields), one module per op (``decode_suite``, ``prefill_suite``,
``gather_suite``, ``insert_suite``, ``engine_suite``), ``workloads`` (WORKLOADS.md cases, engine
steps included, and their traffic), ``pool`` (page pools), ``timing`` (protocol, ceilings), ``report`` (tables, plot),
``cp_model``, ``sass_stats`` (offline SASS counts), ``labs/`` (GPU tuning labs).
"""

SCHEMA = "nvfp4_indexer.benchmarks/1"
