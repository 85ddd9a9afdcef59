"""The lifecycle simulation: the real supervisor, fake workers, virtual time (harness.py)."""
