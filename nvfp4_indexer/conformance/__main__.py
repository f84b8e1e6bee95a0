"""``python -m nvfp4_indexer.conformance ...`` (see ``conformance.cli``)."""

import sys

from .cli import main

sys.exit(main())
