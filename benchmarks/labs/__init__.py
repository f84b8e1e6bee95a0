"""GPU labs: tuning experiments on the Triton launchers' configs (not part of the benchmark
suites ``python -m benchmarks`` runs).

- ``dequant_lab``: decode score-kernel variants (``DecodeConfig``), correctness and timing.
- ``knob_lab``: prefill / gather / insert launch options (``PrefillConfig``, ``GatherConfig``,
  ``InsertConfig``).
- ``profile_case``: one case for a profiler (``ncu``, ``nsys``).

Variants are keyword dicts turned into configs by ``profile_case.config_of``
(``dataclasses.replace`` on the launcher's default config); ``benchmarks/README.md`` lists
every lab.
"""
