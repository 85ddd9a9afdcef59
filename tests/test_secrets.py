"""A model's ``env`` (where an ``HF_TOKEN`` goes) reaches its worker and nothing else: not
``/v1/models``, not the router's log, not the worker's command line (``ps`` shows it to
every user of the machine). ``smollm2-b`` carries such a token in the shared preset."""

from __future__ import annotations

import httpx
import psutil
import pytest

pytestmark = pytest.mark.integration

SECRET = "hf_secret_for_tests_only"


def test_a_models_env_reaches_its_worker_and_is_shown_nowhere(router, client) -> None:  # type: ignore[no-untyped-def]
    client.chat.completions.create(model="smollm2-b", max_tokens=1,
                                   messages=[{"role": "user", "content": "hi"}])
    listing = httpx.get(f"{router.url}/v1/models").text
    one = httpx.get(f"{router.url}/v1/models/smollm2-b")
    assert SECRET not in listing and SECRET not in one.text and "HF_TOKEN" not in one.text
    assert one.json()["placement"] == {"VLLM_CPU_OMP_THREADS_BIND": "1",
                                       "VLLM_CPU_KVCACHE_SPACE": "1"}
    worker = psutil.Process(one.json()["pid"])
    assert SECRET not in " ".join(worker.cmdline())
    assert worker.environ().get("HF_TOKEN") == SECRET
    assert SECRET not in router.tail(100_000)
