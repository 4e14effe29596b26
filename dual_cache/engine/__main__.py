"""`python -m dual_cache.engine`: build every native engine variant this CPU runs and say which one is used."""

import sys

from .native import main

sys.exit(main())
