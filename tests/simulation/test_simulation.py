"""The lifecycle simulation over many seeds (``harness.py`` says what one seed does).

    SIM_SEEDS=5000 pytest tests/simulation          # seeds 0..4999 (default 2000)
    SIM_SEED_BASE=100000 pytest tests/simulation    # another range of seeds
    SIM_SEED=1234 pytest tests/simulation -k one_seed -s   # one seed, its whole trace

Seeds run in groups of ``CHUNK`` per test; a failing group names every failing seed with
its findings, and the first one's trace.
"""

from __future__ import annotations

import os

import pytest

from tests.simulation.harness import run_seed

SEEDS = int(os.environ.get("SIM_SEEDS", "2000"))
BASE = int(os.environ.get("SIM_SEED_BASE", "0"))
CHUNK = 100


@pytest.mark.parametrize("first", range(BASE, BASE + SEEDS, CHUNK),
                         ids=lambda first: f"seeds{first}-{min(first + CHUNK, BASE + SEEDS) - 1}")
def test_seeds(first: int) -> None:
    failed = [result for seed in range(first, min(first + CHUNK, BASE + SEEDS))
              if (result := run_seed(seed)).violations]
    if failed:
        lines = [f"{len(failed)} seed(s) failed:"]
        lines += [f"  seed {r.seed}: " + " | ".join(r.violations) for r in failed]
        pytest.fail("\n".join(lines) + "\n\n" + failed[0].report(short=True), pytrace=False)


def test_one_seed() -> None:
    """``SIM_SEED=n``: one seed, its whole trace printed (``-s``) and in the failure."""
    result = run_seed(int(os.environ.get("SIM_SEED", "0")))
    print(result.trace)
    if result.violations:
        pytest.fail(result.report(), pytrace=False)


def test_a_seed_replays_identically() -> None:
    """Virtual time makes a run a function of its seed: a failure found once is a seed
    number forever."""
    for seed in (1, 7, 42):
        assert run_seed(seed).digest == run_seed(seed).digest
