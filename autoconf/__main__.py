import sys

from autoconf.cli import main

sys.exit(main())
