"""`python -m hicache.runtime.cli`: the `hicache` command."""

import sys

from . import main

sys.exit(main())
