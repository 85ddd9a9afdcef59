"""``python -m router`` is the ``modelyard`` command."""

import sys

from router.cli import main

sys.exit(main())
