"""Batch lines yield to a person (issue 38, finding 9), on synthetic models: a person's
request admitted on a model cuts the batch lines in flight there; they run again once it
is done, each line answered once and charged once (one usage row); a person who leaves
only short gaps still lets a batch end (a line is cut at most ``CUTS`` times); and a
batch with no person about runs at ``batch_model_concurrency``.

No timing is asserted beyond generous deadlines: the figures are ``bench/batch.py``'s."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from router.batches.runner import CUTS
from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration

ALICE, BOB = "k-alice-yield-1a", "k-bob-yield-2b"
RATE = 20  # tokens per second of each request on these models
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  cache_dir: {cache}
  api_keys: [k-alice-yield-1a, k-bob-yield-2b]
  admin_api_keys: [k-admin-yield-3c]  # Alice and Bob are users: each sees their own usage
  batch_model_concurrency: 4
  batch_shared_concurrency: 2
models:
  cut: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 20}}
  gaps: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 20}}
  alone: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 20}}
  held: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 20}}
"""


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    cache = tmp_path_factory.mktemp("yield-cache")
    with running_router(PRESET, tmp_path_factory.mktemp("yield"), "yield",
                        {"cache": str(cache)}) as r:
        yield r


def chat(model: str, tokens: int, text: str = "hi") -> dict[str, Any]:
    return {"model": model, "max_tokens": tokens,
            "messages": [{"role": "user", "content": text}]}


def start_batch(r: RouterProcess, model: str, lines: int, tokens: int) -> str:
    c = openai.OpenAI(base_url=r.url + "/v1", api_key=ALICE, max_retries=0, timeout=60)
    body = "".join(json.dumps({"custom_id": f"{model}-{i}", "method": "POST",
                               "url": "/v1/chat/completions",
                               "body": chat(model, tokens, f"line {i}")}) + "\n"
                   for i in range(lines)).encode()
    file_id = c.files.create(file=("in.jsonl", body), purpose="batch").id
    return c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                            completion_window="24h").id


def in_flight(r: RouterProcess, model: str) -> int:
    got: int = r.client.get(f"{r.url}/v1/models/{model}",
                            headers={"Authorization": f"Bearer {ALICE}"}).json()["in_flight"]
    return got


def wait_for(what: Callable[[], bool], timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.02)


def finished(r: RouterProcess, batch_id: str, timeout: float = 120) -> Any:
    c = openai.OpenAI(base_url=r.url + "/v1", api_key=ALICE, max_retries=0, timeout=60)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = c.batches.retrieve(batch_id)
        if got.status in ("completed", "failed", "expired", "cancelled"):
            return got
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} still {got.status}")


def answers(r: RouterProcess, batch: Any) -> dict[str, int]:
    """Every answered custom_id and its status; each must come once."""
    c = openai.OpenAI(base_url=r.url + "/v1", api_key=ALICE, max_retries=0, timeout=60)
    out: dict[str, int] = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is None:
            continue
        for text in c.files.content(file_id).text.splitlines():
            item = json.loads(text)
            assert item["custom_id"] not in out, f"{item['custom_id']} answered twice"
            out[item["custom_id"]] = (item["response"] or {}).get("status_code", 0)
    return out


def rows(r: RouterProcess, model: str, expected: int) -> int:
    """Alice's usage rows on ``model`` once the ledger has written ``expected`` (it
    writes every second), and a little longer: a row too many has time to show."""
    deadline = time.monotonic() + 15
    settle: float | None = None
    while True:
        got = httpx.get(f"{r.url}/v1/usage?group_by=key,model", timeout=30,
                        headers={"Authorization": f"Bearer {ALICE}"}).json()["data"]
        count = int(sum(row["requests"] for row in got if row.get("model") == model))
        now = time.monotonic()
        if count >= expected and settle is None:
            settle = now + 2.5
        if (settle is not None and now > settle) or now > deadline:
            return count
        time.sleep(0.3)


def test_a_persons_request_cuts_the_lines_in_flight_they_run_again_later(
        router: RouterProcess) -> None:
    """On main 1a1e9ee the 4 lines in flight went on beside Bob's request (and 4 more
    after them, ``batch_shared_concurrency`` then): the model never had his alone."""
    lines = 6
    batch_id = start_batch(router, "cut", lines, 2 * RATE)  # 2 s a line
    wait_for(lambda: in_flight(router, "cut") == 4, 30, "the batch never ran 4 lines")
    time.sleep(0.5)  # their first tokens are out: a cut ends a line mid-answer
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        bob = pool.submit(httpx.post, f"{router.url}/v1/chat/completions", timeout=60,
                          json=chat("cut", 3 * RATE), headers={"Authorization": f"Bearer {BOB}"})
        seen: list[int] = []

        def alone() -> bool:
            seen.append(in_flight(router, "cut"))
            return seen[-1] == 1 or bob.done()

        wait_for(alone, 10, "Bob's request never ended")
        assert not bob.done() and seen[-1] == 1, (
            f"Bob's request never had the model alone: in flight {seen[-20:]}")
        assert bob.result().status_code == 200
    done = finished(router, batch_id)
    assert done.status == "completed", done
    assert done.request_counts.completed == lines and done.request_counts.failed == 0, done
    assert answers(router, done) == {f"cut-{i}": 200 for i in range(lines)}
    assert rows(router, "cut", lines) == lines  # the cut runs are no rows


def test_a_person_with_short_gaps_still_lets_a_batch_end(router: RouterProcess) -> None:
    """Bob keeps a request on the model but for 0.2 s gaps, each too short for a line
    (2 s) and shorter than ``GAP``: no line starts in them, but once none has moved for
    ``STARVED_AFTER`` s one runs to its end beside him, and the batch ends."""
    assert CUTS >= 1
    lines = 3
    stop = threading.Event()
    chats: list[int] = []

    def bob() -> None:
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {BOB}"}) as c:
            while not stop.is_set():
                chats.append(c.post(f"{router.url}/v1/chat/completions",
                                    json=chat("gaps", RATE)).status_code)  # 1 s
                time.sleep(0.2)

    person = threading.Thread(target=bob)
    person.start()
    try:
        wait_for(lambda: len(chats) >= 1, 30, "Bob's first chat never ended")
        batch_id = start_batch(router, "gaps", lines, 2 * RATE)
        done = finished(router, batch_id, timeout=120)
    finally:
        stop.set()
        person.join()
    assert done.status == "completed", done
    assert answers(router, done) == {f"gaps-{i}": 200 for i in range(lines)}
    assert set(chats) == {200}, chats
    assert rows(router, "gaps", lines) == lines


def test_a_batch_with_no_person_about_runs_at_batch_model_concurrency(
        router: RouterProcess) -> None:
    """Nobody's request on the model: the batch takes all of ``batch_model_concurrency``
    (a yield that costs when nobody is there would be a slower batch for nothing)."""
    batch_id = start_batch(router, "alone", 8, 2 * RATE)
    peak: list[int] = [0]

    def full() -> bool:
        peak[0] = max(peak[0], in_flight(router, "alone"))
        return peak[0] >= 4

    wait_for(full, 30, f"at most {peak[0]} lines ran at once")
    assert peak[0] == 4
    done = finished(router, batch_id)
    assert done.status == "completed" and done.request_counts.completed == 8, done


def test_a_batch_cancelled_while_its_cut_lines_wait_answers_each_once_and_leaks_no_place(
        router: RouterProcess) -> None:
    """Lines cut for Bob wait for him; their batch is cancelled meanwhile: each line is
    answered once (never run: cancelled), none is charged, and the model's batch places
    they held are all back (a later batch there runs at ``batch_model_concurrency``)."""
    c = openai.OpenAI(base_url=router.url + "/v1", api_key=ALICE, max_retries=0, timeout=60)
    batch_id = start_batch(router, "held", 4, 10 * RATE)
    wait_for(lambda: in_flight(router, "held") == 4, 30, "the batch never ran 4 lines")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        bob = pool.submit(httpx.post, f"{router.url}/v1/chat/completions", timeout=60,
                          json=chat("held", 6 * RATE), headers={"Authorization": f"Bearer {BOB}"})
        wait_for(lambda: in_flight(router, "held") == 1, 10, "the lines were not cut")
        c.batches.cancel(batch_id)
        done = finished(router, batch_id)
        assert not bob.done(), "Bob's request ended before the test could look"
        assert bob.result().status_code == 200
    assert done.status == "cancelled", done
    assert answers(router, done) == {f"held-{i}": 0 for i in range(4)}
    assert rows(router, "held", 0) == 0
    time.sleep(11)  # BATCH_QUIET: no person's request there lately
    again = start_batch(router, "held", 8, 2 * RATE)
    seen: list[int] = []

    def ended() -> bool:
        seen.append(in_flight(router, "held"))
        return c.batches.retrieve(again).status == "completed"

    wait_for(ended, 60, f"the next batch never ended: in flight {seen[-20:]}")
    assert max(seen) == 4, seen  # neither fewer places nor more than there are
