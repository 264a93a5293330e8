"""`python -m spherepde.validation [SUITE ...] --out DIR`: the same suites as `spherepde validate`."""

import sys

from .suites import main

sys.exit(main())
