"""What one key may hold of the router (issue 26, findings 8-10): a background response
counts against its key's ``max_concurrent``; the stored-response bounds of the preset
apply, to each key on its own; an answer its client never reads is dropped after
``send_timeout``. The models are synthetic, so the router is cheap.

Each test here failed on 96966e8: five background creates of a key with
``max_concurrent: 1`` were all queued and ran at once; ``responses_store_items`` was
ignored (an empty store is falsy, and ``store or ResponseStore()`` replaced it), and one
key's writes evicted another key's responses; a non-streamed answer to a client that
never read stayed in the router, its connection open, for as long as the client stayed.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from router.api.responses.schema import normalize
from router.api.responses.store import ResponseStore, encode_items
from tests.conformance import validate_responses
from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration

ALICE, BOB, ADMIN = "k-alice-7a1b", "k-bob-8c2d", "k-admin-9e3f"
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  api_keys: [k-alice-7a1b, k-bob-8c2d]
  admin_api_keys: [k-admin-9e3f]
  send_timeout: 2
  responses_store_items: 2
models:
  m: {model: /synthetic, engine: synthetic, max_model_len: 100000,
      engine_args: {tokens_per_step: 500}}
  slow: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 20}}
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(PRESET, tmp_path_factory.mktemp("bounds"), "bounds") as r:
        yield r


def call(r: RouterProcess, key: str, method: str, path: str,
         body: object = None) -> httpx.Response:
    return r.client.request(method, r.url + path, json=body,
                            headers={"Authorization": f"Bearer {key}"}, timeout=60)


# -- 8. a background response counts against its key's max_concurrent ----------------------

def test_background_runs_count_against_max_concurrent(shared: RouterProcess) -> None:
    r = shared
    made = call(r, ADMIN, "POST", "/v1/keys", {"name": "solo", "max_concurrent": 1})
    assert made.status_code == 201, made.text
    solo = made.json()["key"]
    body = {"model": "slow", "input": "long", "background": True, "max_output_tokens": 400}
    answers = [call(r, solo, "POST", "/v1/responses", body) for _ in range(5)]
    # The first runs (20 s at 20 tokens/s); the others are refused as a foreground request
    # past the limit is, in the Responses error shape, and nothing of them is stored.
    assert [a.status_code for a in answers] == [200, 429, 429, 429, 429], \
        [(a.status_code, a.text) for a in answers]
    rid = answers[0].json()["id"]
    for refused in answers[1:]:
        validate_responses("ErrorResponse", refused.json())
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["retry-after"] == "1"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert call(r, solo, "POST", "/v1/chat/completions", chat).status_code == 429
    # The key can follow and stop the run that fills its limit.
    polled = call(r, solo, "GET", f"/v1/responses/{rid}")
    assert polled.status_code == 200 and polled.json()["status"] in ("queued", "in_progress")
    cancelled = call(r, solo, "POST", f"/v1/responses/{rid}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    # Its place came back with the run's end.
    assert call(r, solo, "POST", "/v1/chat/completions", chat).status_code == 200
    again = call(r, solo, "POST", "/v1/responses", body)
    assert again.status_code == 200, again.text
    assert call(r, solo, "DELETE", f"/v1/responses/{again.json()['id']}").status_code == 200
    assert call(r, solo, "POST", "/v1/chat/completions", chat).status_code == 200


# -- 9. the store's bounds are the preset's, and each key's own ----------------------------

def test_the_presets_store_bound_applies_to_each_key_alone(shared: RouterProcess) -> None:
    r = shared

    def create(key: str) -> str:
        made = call(r, key, "POST", "/v1/responses",
                    {"model": "m", "input": "remember this", "max_output_tokens": 2})
        assert made.status_code == 200, made.text
        rid: str = made.json()["id"]
        return rid

    alices = create(ALICE)
    bobs = [create(BOB) for _ in range(3)]  # one more than responses_store_items: 2
    # Bob's oldest is gone (on 96966e8 the preset's bound was replaced by 10 000) ...
    assert call(r, BOB, "GET", f"/v1/responses/{bobs[0]}").status_code == 404
    for rid in bobs[1:]:
        assert call(r, BOB, "GET", f"/v1/responses/{rid}").status_code == 200
    # ... and Alice's was never Bob's to evict.
    assert call(r, ALICE, "GET", f"/v1/responses/{alices}").status_code == 200
    metrics = call(r, ADMIN, "GET", "/metrics").text
    assert 'modelyard_responses_evicted_total{reason="count"} 1.0' in metrics


def test_one_keys_writes_never_evict_anothers() -> None:
    """The store itself: on 96966e8 its bounds were global, so Bob's writes dropped
    Alice's response (by count, and by bytes: three 25 MB creates)."""
    items = encode_items(normalize("hello"))
    by_count = ResponseStore(max_items=2)
    by_count.put("resp_a", {"status": "completed"}, items, "alice")
    for i in range(3):
        by_count.put(f"resp_b{i}", {"status": "completed"}, items, "bob")
    assert by_count.get("resp_a", "alice") is not None
    assert by_count.get("resp_b0", "bob") is None and by_count.get("resp_b2", "bob") is not None
    assert len(by_count) == 3 and by_count.evicted["count"] == 1

    big = {"status": "completed", "pad": "x" * 4_000}
    by_bytes = ResponseStore(max_bytes=10_000)
    by_bytes.put("resp_a", big, items, "alice")
    for i in range(3):
        by_bytes.put(f"resp_b{i}", big, items, "bob")
    assert by_bytes.get("resp_a", "alice") is not None
    assert by_bytes.get("resp_b0", "bob") is None and by_bytes.get("resp_b2", "bob") is not None
    assert by_bytes.evicted["bytes"] == 1


def test_all_keys_together_lose_from_the_one_holding_most() -> None:
    items = encode_items(normalize("hello"))
    store = ResponseStore(max_items=3, total_items=4)
    store.put("resp_a", {"status": "completed"}, items, "alice")
    for i in range(3):
        store.put(f"resp_b{i}", {"status": "completed"}, items, "bob")
    store.put("resp_c", {"status": "completed"}, items, "carol")  # the fifth: over the total
    assert len(store) == 4 and store.evicted["total"] == 1
    assert store.get("resp_b0", "bob") is None  # Bob held the most: his oldest went
    assert store.get("resp_a", "alice") is not None and store.get("resp_c", "carol") is not None
    assert store.delete("resp_a", "alice") and not store.delete("resp_a", "alice")
    assert store.get("resp_c", "alice") is None  # another key's id: not there for Alice


# -- 10. an answer its client never reads is dropped after send_timeout --------------------

def router_holds(r: RouterProcess, port: int) -> bool:
    """Whether the router still has a connection from the test's ``port``."""
    assert r.proc is not None
    return any(c.raddr and c.raddr.port == port
               for c in psutil.Process(r.proc.pid).net_connections(kind="tcp"))


def test_an_unread_answer_is_dropped_after_send_timeout(shared: RouterProcess) -> None:
    r = shared
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "n": 64, "max_tokens": 40_000, "ignore_eos": True}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Authorization: Bearer {ALICE}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
        sock.connect(("127.0.0.1", r.port))
        port = sock.getsockname()[1]
        sock.sendall(request)
        # The answer (about 10 MB) is written; the client reads none of it. The router
        # must give up on it after send_timeout (2 s); on 96966e8 it held it, and the
        # connection, for as long as the client stayed.
        deadline = time.monotonic() + 60
        while router_holds(r, port):
            assert time.monotonic() < deadline, "the router still holds the unread answer"
            time.sleep(0.2)
        # What reached the client is a cut answer: the connection ends (reset or closed)
        # before the length its head announced.
        sock.settimeout(30)
        got = bytearray()
        try:
            while chunk := sock.recv(1 << 16):
                got += chunk
        except ConnectionResetError:
            pass
    head, _, rest = bytes(got).partition(b"\r\n\r\n")
    if head:
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        assert len(rest) < length
    # The router still serves.
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert call(r, ALICE, "POST", "/v1/chat/completions", chat).status_code == 200
