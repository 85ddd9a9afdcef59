"""``python -m router.access``: the access table as Markdown (README's copy)."""

from router.access.rules import markdown

print(markdown())
