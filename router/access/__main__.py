"""``python -m router.access``: the access table as Markdown (docs/security.md's copy);
``python -m router.access limits``: the limits × ways-in matrix (``limit_table``)."""

import sys

from router.access import limit_table, rules

PRINTS = {(): rules.markdown, ("limits",): limit_table.markdown}

printer = PRINTS.get(tuple(sys.argv[1:]))
if printer is None:
    sys.exit("usage: python -m router.access [limits]")
print(printer())
