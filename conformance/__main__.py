"""``python -m conformance ...`` (see ``conformance.cli``)."""

import sys

from .cli import main

sys.exit(main())
