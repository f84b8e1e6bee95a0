"""Tests of ``nvfp4_indexer.triton.prefill``, one file per module (a package: its basenames
may repeat those of other kernel families' test folders)."""
