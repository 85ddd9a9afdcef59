"""``python -m router.access``: the access table as Markdown (README's copy);
``python -m router.access limits``: the limits × ways-in matrix (``limit_table``)."""

import sys

from router.access import limit_table, rules

print(limit_table.markdown() if sys.argv[1:] == ["limits"] else rules.markdown())
