"""Tests of ``nvfp4_indexer.engine`` (SPEC 8.1), one file per concept (a package: its basenames
may repeat those of other test folders)."""
