"""`python -m dual_cache.cli ...`: the `dual-decoder` command (how `serve --tp N` starts its ranks under torchrun)."""

import sys

from .main import main

sys.exit(main())
