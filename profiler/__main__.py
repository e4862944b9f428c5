"""`python -m profiler`: see profiler/__init__.py."""

import sys

from .run import main

sys.exit(main())
