"""`python -m spherepde ...`: the same command line as `spherepde ...`."""

import sys

from .cli import main

sys.exit(main())
