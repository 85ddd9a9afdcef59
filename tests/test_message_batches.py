"""Anthropic's Message Batches API (issue 29), with the official ``anthropic`` SDK as the
client, on synthetic models (their words are not asserted; each request's answer is):
create, progress, every ``custom_id`` once in the results, requests refused at create or
by the Messages handler as ``errored`` lines, listing page by page both ways, cancel
mid-way, delete, refused bodies, and ownership."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types.messages import (
    MessageBatch,
    MessageBatchCanceledResult,
    MessageBatchErroredResult,
    MessageBatchSucceededResult,
)

from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration

ALICE, BOB, ADMIN = "k-alice-msgbatch-1a", "k-bob-msgbatch-2b", "k-admin-msgbatch-3c"
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  cache_dir: {cache}
  api_keys: [k-alice-msgbatch-1a, k-bob-msgbatch-2b]
  admin_api_keys: [k-admin-msgbatch-3c]
  batch_model_concurrency: 4
  batch_max_lines: 60
  max_body_bytes: 65536
models:
  m: {model: /synthetic, engine: synthetic}
  other: {model: /synthetic, engine: synthetic}
  slow: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 10}}
"""
BATCH_KEYS = {"id", "type", "processing_status", "request_counts", "created_at",
              "expires_at", "ended_at", "cancel_initiated_at", "archived_at", "results_url"}


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    cache = tmp_path_factory.mktemp("msgbatch-cache")
    with running_router(PRESET, tmp_path_factory.mktemp("msgbatches"), "msgbatches",
                        {"cache": str(cache)}) as r:
        yield r


def client(r: RouterProcess, key: str = ALICE) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=r.url, api_key=key, max_retries=0, timeout=60)


def request(custom_id: str, model: str = "m", **params: Any) -> dict[str, Any]:
    return {"custom_id": custom_id,
            "params": {"model": model, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}], **params}}


def checked(c: anthropic.Anthropic, batch_id: str) -> MessageBatch:
    """The batch as the server answers it, every documented key there and valid."""
    raw = c.messages.batches.with_raw_response.retrieve(batch_id).http_response.json()
    assert set(raw) == BATCH_KEYS, raw
    batch = MessageBatch.model_validate(raw)  # validated, unlike the SDK's own parse
    counts = batch.request_counts
    assert batch.id.startswith("msgbatch_") and batch.archived_at is None
    assert (counts.processing + counts.succeeded + counts.errored + counts.canceled
            + counts.expired) > 0
    assert (batch.results_url is None) == (batch.processing_status != "ended")
    return batch


def ended(c: anthropic.Anthropic, batch_id: str, timeout: float = 30) -> MessageBatch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = checked(c, batch_id)
        if batch.processing_status == "ended":
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"message batch {batch_id} still {batch.processing_status}")


def results(c: anthropic.Anthropic, batch_id: str) -> dict[str, Any]:
    """Every request's result by custom_id; each must come once."""
    out: dict[str, Any] = {}
    for item in c.messages.batches.results(batch_id):
        assert item.custom_id not in out, f"{item.custom_id} answered twice"
        out[item.custom_id] = item.result
    return out


def raw_results(r: RouterProcess, batch_id: str, key: str = ALICE) -> httpx.Response:
    return r.client.get(f"{r.url}/v1/messages/batches/{batch_id}/results",
                        headers={"x-api-key": key})


def test_a_batch_answers_every_request_once_bad_ones_errored(router: RouterProcess) -> None:
    c = client(router)
    good = [request(f"ok-{i}", model="m" if i % 2 else "other") for i in range(6)]
    refused_at_create = [{"custom_id": "not-an-object", "params": "hi"},
                         request("streamed", stream=True),
                         {"custom_id": "no-model", "params": {"max_tokens": 4, "messages": []}},
                         request("nobody", model="no-such-model")]
    refused_by_handler = [{"custom_id": "no-max-tokens",  # Messages' required field
                           "params": {"model": "m", "messages": [{"role": "user",
                                                                  "content": "hi"}]}}]
    made = c.messages.batches.create(requests=good + refused_at_create + refused_by_handler)
    assert made.processing_status == "in_progress" and made.ended_at is None
    assert made.request_counts.errored == 4 and made.request_counts.processing == 7, made
    assert made.expires_at.timestamp() - made.created_at.timestamp() == pytest.approx(86400)
    done = ended(c, made.id)
    assert done.request_counts.model_dump() == {
        "processing": 0, "succeeded": 6, "errored": 5, "canceled": 0, "expired": 0}
    assert done.ended_at is not None and done.cancel_initiated_at is None
    assert done.results_url == f"/v1/messages/batches/{made.id}/results"
    raw = raw_results(router, made.id)
    assert raw.headers["content-type"].startswith("application/x-jsonl")
    assert len(raw.text.splitlines()) == 11 and raw.text.endswith("\n")
    got = results(c, made.id)
    assert set(got) == {f"ok-{i}" for i in range(6)} | {
        "not-an-object", "streamed", "no-model", "nobody", "no-max-tokens"}
    for i in range(6):
        result = got[f"ok-{i}"]
        assert isinstance(result, MessageBatchSucceededResult), result
        assert result.message.type == "message" and result.message.role == "assistant"
        assert result.message.model == ("m" if i % 2 else "other")
    for custom_id in ("not-an-object", "streamed", "no-model", "nobody", "no-max-tokens"):
        result = got[custom_id]
        assert isinstance(result, MessageBatchErroredResult), (custom_id, result)
        assert result.error.type == "error", result
        assert result.error.error.type == "invalid_request_error", (custom_id, result)
    assert "stream" in got["streamed"].error.error.message
    assert "no-such-model" in got["nobody"].error.error.message


def test_list_walks_every_batch_newest_first_both_ways(router: RouterProcess) -> None:
    c = client(router)
    made = [c.messages.batches.create(requests=[request(f"l-{i}")]).id for i in range(3)]
    walked = [b.id for b in c.messages.batches.list(limit=1)]  # one page per batch
    assert len(walked) == len(set(walked)) >= 3
    assert walked == [b.id for b in c.messages.batches.list(limit=1000).data]
    assert [i for i in walked if i in made] == made[::-1]  # newest first
    # before_id: the pages newer than the oldest, nearest first (the SDK asks before_id)
    back = [b.id for b in c.messages.batches.list(before_id=walked[-1], limit=1)]
    assert back == walked[-2::-1]
    newer = c.messages.batches.list(before_id=walked[-1], limit=2)
    assert [b.id for b in newer.data] == walked[-3:-1] and newer.first_id == walked[-3]
    page = c.messages.batches.list(limit=2)
    assert page.has_more == (len(walked) > 2) and page.first_id == walked[0]
    assert page.last_id == walked[1]
    for batch_id in made:
        ended(c, batch_id)


def test_cancel_mid_way_ends_the_rest_canceled(router: RouterProcess) -> None:
    c = client(router)
    made = c.messages.batches.create(
        requests=[request(f"c-{i}", model="slow", max_tokens=20) for i in range(40)])
    early = raw_results(router, made.id)
    assert early.status_code == 400, early.text
    assert early.json()["type"] == "error" and "has not ended" in early.json()["error"]["message"]
    with pytest.raises(anthropic.AnthropicError, match="results_url"):
        c.messages.batches.results(made.id)
    deadline = time.monotonic() + 30
    while checked(c, made.id).request_counts.succeeded == 0:  # 4 at once, 2 s each
        assert time.monotonic() < deadline
        time.sleep(0.1)
    cancelling = c.messages.batches.cancel(made.id)
    assert cancelling.processing_status in ("canceling", "ended"), cancelling
    assert cancelling.cancel_initiated_at is not None
    if cancelling.processing_status == "canceling":
        with pytest.raises(anthropic.BadRequestError):
            c.messages.batches.delete(made.id)
    done = ended(c, made.id)
    counts = done.request_counts
    assert counts.processing == 0 and counts.succeeded + counts.canceled == 40, done
    assert 0 < counts.succeeded < 40 and counts.canceled >= 20, done
    got = results(c, made.id)
    assert set(got) == {f"c-{i}" for i in range(40)}
    assert sum(isinstance(v, MessageBatchCanceledResult) for v in got.values()) \
        == counts.canceled
    # Its events on /v1/events, as an OpenAI batch's: its owner's, never another key's.
    def told(key: str) -> list[dict[str, Any]]:
        reply = router.client.get(f"{router.url}/v1/events", headers={"x-api-key": key})
        return [e for e in reply.json()["data"]
                if e["type"] == "batch" and e["batch"] == made.id]

    actions = [e["action"] for e in told(ALICE)]
    assert actions[:2] == ["created", "in_progress"] and "cancelling" in actions, actions
    end = told(ALICE)[-1]
    assert (end["action"], end["shape"], end["status"]) == ("ended", "anthropic", "cancelled")
    assert (end["succeeded"], end["canceled"]) == (counts.succeeded, counts.canceled)
    assert told(BOB) == []


def test_delete_an_ended_batch(router: RouterProcess) -> None:
    c = client(router)
    made = c.messages.batches.create(requests=[request("d")])
    ended(c, made.id)
    gone = c.messages.batches.delete(made.id)
    assert (gone.id, gone.type) == (made.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        c.messages.batches.retrieve(made.id)
    assert raw_results(router, made.id).status_code == 404
    assert made.id not in [b.id for b in c.messages.batches.list(limit=1000)]


def test_refused_bodies(router: RouterProcess) -> None:
    c = client(router)
    cases: list[list[Any]] = [
        [request("twice"), request("twice")],
        [],
        [request(f"n-{i}") for i in range(61)],  # batch_max_lines: 60
        [request("bad id!")],
        [{"custom_id": "x"}],
    ]
    for requests in cases:
        with pytest.raises(anthropic.BadRequestError) as err:
            c.messages.batches.create(requests=requests)
        body = err.value.body
        assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.APIStatusError) as big:  # max_body_bytes: 65536
        c.messages.batches.create(requests=[request("big", system="x" * 70_000)])
    assert big.value.status_code == 413, big.value
    assert isinstance(big.value.body, dict) and \
        big.value.body["error"]["type"] == "request_too_large"


def test_another_key_finds_nothing_an_admin_everything(router: RouterProcess) -> None:
    alice, bob, admin = client(router), client(router, BOB), client(router, ADMIN)
    made = alice.messages.batches.create(requests=[request("mine")])
    for call in (lambda: bob.messages.batches.retrieve(made.id),
                 lambda: bob.messages.batches.cancel(made.id),
                 lambda: bob.messages.batches.delete(made.id)):
        with pytest.raises(anthropic.NotFoundError) as err:
            call()
        body = err.value.body
        assert isinstance(body, dict) and body["error"]["type"] == "not_found_error"
    assert made.id not in [b.id for b in bob.messages.batches.list(limit=1000)]
    assert admin.messages.batches.retrieve(made.id).id == made.id
    assert made.id in [b.id for b in admin.messages.batches.list(limit=1000)]
    assert ended(alice, made.id).request_counts.succeeded == 1
    assert raw_results(router, made.id, BOB).status_code == 404
    assert isinstance(results(admin, made.id)["mine"], MessageBatchSucceededResult)
    # nor is it an OpenAI batch
    assert router.client.get(f"{router.url}/v1/batches/{made.id}",
                             headers={"authorization": f"Bearer {ALICE}"}).status_code == 404
