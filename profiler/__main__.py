"""`python -m profiler`: see profiler/__init__.py."""

import sys

from autoconf.procs import die_with_parent_if_launched

die_with_parent_if_launched()  # launched by `autoconf profile`: die with torchrun, never outlive it

from profiler.run import main  # noqa: E402

sys.exit(main())
