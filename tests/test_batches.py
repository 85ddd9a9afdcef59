"""OpenAI's Files and Batches APIs (issue 29), with the official SDK as the client, on
synthetic models (their words are not asserted; each line's answer is): upload, create,
progress, output and error files with every ``custom_id`` once, bad lines as error-file
lines, cancel, expiry, ownership, and a router killed mid-batch and started again."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conformance import validate_batch
from tests.conftest import RouterProcess, running_router

pytestmark = pytest.mark.integration

ALICE, BOB, ADMIN = "k-alice-batch-1a", "k-bob-batch-2b", "k-admin-batch-3c"
PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  cache_dir: {cache}
  api_keys: [k-alice-batch-1a, k-bob-batch-2b]
  admin_api_keys: [k-admin-batch-3c]
  batch_model_concurrency: 4
  files_max_mib: 0.1  # about 100 KiB: test_an_upload_past_files_max_mib_is_refused
  files_quota_mib: 0.25  # a key's files together: test_a_keys_files_stay_within_its_quota
models:
  m: {model: /synthetic, engine: synthetic}
  other: {model: /synthetic, engine: synthetic}
  slow: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 10}}
  base: {model: /synthetic, engine: synthetic, max_loras: 2}
  poet: {base: base, adapter: {poet}}
  vectors: {model: /synthetic, engine: synthetic, task: embed}
  ranker: {model: /synthetic, engine: synthetic, task: score}
"""


def adapter_folder(path: Path) -> str:
    """A LoRA folder the synthetic engine takes (it reads the config only)."""
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


@pytest.fixture(scope="module")
def poet(tmp_path_factory: pytest.TempPathFactory) -> str:
    return adapter_folder(tmp_path_factory.mktemp("adapters") / "poet")


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, poet: str) -> Iterator[RouterProcess]:
    cache = tmp_path_factory.mktemp("batch-cache")
    with running_router(PRESET, tmp_path_factory.mktemp("batches"), "batches",
                        {"cache": str(cache), "poet": poet}) as r:
        yield r


def client(r: RouterProcess, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=r.url + "/v1", api_key=key, max_retries=0, timeout=60)


def line(custom_id: str, model: str = "m", url: str = "/v1/chat/completions",
         **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 4, **body}}


def jsonl(items: list[Any]) -> bytes:
    return "".join((i if isinstance(i, str) else json.dumps(i)) + "\n" for i in items).encode()


def upload(c: openai.OpenAI, items: list[Any]) -> str:
    made = c.files.create(file=("in.jsonl", jsonl(items)), purpose="batch")
    validate_batch("OpenAIFile", made.model_dump(exclude_unset=True))
    return made.id


def finished(c: openai.OpenAI, batch_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = c.batches.retrieve(batch_id)
        if got.status in ("completed", "failed", "expired", "cancelled"):
            return got
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} still {got.status}")


def results(c: openai.OpenAI, batch: Any) -> dict[str, dict[str, Any]]:
    """Every output and error line by custom_id; each must come once."""
    out: dict[str, dict[str, Any]] = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is None:
            continue
        for text in c.files.content(file_id).text.splitlines():
            item = json.loads(text)
            validate_batch("BatchRequestOutput", item)
            assert item["custom_id"] not in out, f"{item['custom_id']} answered twice"
            out[item["custom_id"]] = item
    return out


def test_a_batch_runs_every_line_once_bad_lines_in_the_error_file(
        router: RouterProcess) -> None:
    c = client(router)
    good = [line(f"ok-{i}", model="m" if i % 2 else "other") for i in range(6)]
    bad = ["{not json", line("elsewhere", url="/v1/completions"),
           line("nobody", model="no-such-model"), line("streamed", stream=True),
           line("too-long", max_tokens=10**9)]
    file_id = upload(c, good + bad)
    batch = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                             completion_window="24h", metadata={"run": "one"})
    validate_batch("Batch", batch.model_dump(exclude_unset=True))
    assert batch.status == "validating" and batch.request_counts.total == 11
    done = finished(c, batch.id)
    validate_batch("Batch", done.model_dump(exclude_unset=True))
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 5), done
    assert done.metadata == {"run": "one"} and done.in_progress_at and done.completed_at
    got = results(c, done)
    assert set(got) == {f"ok-{i}" for i in range(6)} | {
        "line-7", "elsewhere", "nobody", "streamed", "too-long"}
    for i in range(6):
        response = got[f"ok-{i}"]["response"]
        assert response["status_code"] == 200
        assert response["body"]["model"] == ("m" if i % 2 else "other")
        assert response["body"]["object"] == "chat.completion"
    assert got["line-7"]["error"]["code"] == "invalid_json"
    assert got["elsewhere"]["error"]["code"] == "invalid_url"
    assert got["nobody"]["error"]["code"] == "model_not_found"
    assert got["streamed"]["error"]["code"] == "invalid_body"
    assert got["too-long"]["response"]["status_code"] == 400  # the handler's own refusal
    listed = c.batches.list()
    validate_batch("ListBatchesResponse", listed.model_dump(exclude_unset=True))
    assert batch.id in [b.id for b in listed.data]


def test_a_line_may_name_a_lora_adapter(router: RouterProcess) -> None:
    """An adapter is a model name like any other in a batch's line: its base serves it
    with the adapter (the synthetic engine answers with the adapter's name)."""
    c = client(router)
    items = [line("plain", model="base"), line("tuned", model="poet")]
    done = finished(c, c.batches.create(input_file_id=upload(c, items),
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h").id)
    got = results(c, done)
    assert got["tuned"]["response"]["body"]["model"] == "poet"
    assert "poet" in got["tuned"]["response"]["body"]["choices"][0]["message"]["content"]
    assert "poet" not in got["plain"]["response"]["body"]["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("endpoint", "body", "check"), [
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3},
     lambda b: b["object"] == "text_completion"),
    ("/v1/embeddings", {"model": "vectors", "input": ["a", "b"]},
     lambda b: len(b["data"]) == 2 and b["data"][0]["embedding"]),
    ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 3},
     lambda b: b["object"] == "response" and b["status"] in ("completed", "incomplete")),
    ("/v1/rerank", {"model": "ranker", "query": "q", "documents": ["x", "y"]},
     lambda b: len(b["results"]) == 2),
    ("/v1/score", {"model": "ranker", "text_1": "q", "text_2": ["x", "y"]},
     lambda b: len(b["data"]) == 2),
], ids=["completions", "embeddings", "responses", "rerank", "score"])
def test_every_endpoint_a_batch_takes_answers_its_lines(
        router: RouterProcess, endpoint: str, body: dict[str, Any], check: Any) -> None:
    c = client(router)
    items = [{"custom_id": f"{endpoint}-{i}", "method": "POST", "url": endpoint, "body": body}
             for i in range(2)]
    done = finished(c, c.batches.create(input_file_id=upload(c, items), endpoint=endpoint,
                                        completion_window="24h").id)
    got = results(c, done)
    assert done.request_counts.completed == 2, got
    for item in got.values():
        assert item["response"]["status_code"] == 200 and check(item["response"]["body"]), item


def test_another_key_finds_nothing_an_admin_everything(router: RouterProcess) -> None:
    alice, bob, admin = client(router), client(router, BOB), client(router, ADMIN)
    file_id = upload(alice, [line("x")])
    batch = alice.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
    for call in (lambda: bob.batches.retrieve(batch.id), lambda: bob.files.retrieve(file_id),
                 lambda: bob.files.content(file_id), lambda: bob.batches.cancel(batch.id),
                 lambda: bob.files.delete(file_id),
                 lambda: bob.batches.create(input_file_id=file_id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in bob.batches.list().data]
    assert file_id not in [f.id for f in bob.files.list().data]
    assert admin.batches.retrieve(batch.id).id == batch.id
    assert file_id in [f.id for f in admin.files.list().data]
    assert finished(alice, batch.id).status == "completed"


def test_a_file_that_is_not_jsonl_or_repeats_an_id_is_refused(router: RouterProcess) -> None:
    c = client(router)
    for items, code in ((["not json at all", "nor this"], "invalid_file"),
                        ([line("a"), line("a")], "duplicate_custom_id")):
        file_id = upload(c, items)
        with pytest.raises(openai.BadRequestError) as err:
            c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")
        assert err.value.code == code, err.value
    file_id = upload(c, [line("a")])
    with pytest.raises(openai.BadRequestError) as err:
        c.batches.create(input_file_id=file_id, endpoint="/v1/moderations",
                         completion_window="24h")
    assert err.value.code == "unsupported_endpoint"


def test_cancel_mid_way_answers_the_rest_as_cancelled(router: RouterProcess) -> None:
    c = client(router)
    items = [line(f"c-{i}", model="slow", max_tokens=20) for i in range(40)]
    batch = c.batches.create(input_file_id=upload(c, items), endpoint="/v1/chat/completions",
                             completion_window="24h")
    deadline = time.monotonic() + 30
    while c.batches.retrieve(batch.id).status == "validating" and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.5)  # a few lines done (4 at once, 2 s each)
    assert c.batches.cancel(batch.id).status == "cancelling"
    done = finished(c, batch.id)
    assert done.status == "cancelled" and done.cancelled_at, done
    got = results(c, done)
    assert set(got) == {f"c-{i}" for i in range(40)}
    cancelled = [k for k, v in got.items() if v["error"]
                 and v["error"]["code"] == "batch_cancelled"]
    assert 0 < done.request_counts.completed < 40 and len(cancelled) >= 20, done


def metric(r: RouterProcess, caller: str, name: str, **labels: str) -> float:
    """One sample of ``/metrics`` as ``caller`` (a key) reads it (0 where there is none)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = r.client.get(f"{r.url}/metrics",
                        headers={"Authorization": f"Bearer {caller}"}).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels == labels)


def batch_events(r: RouterProcess, key: str, batch_id: str) -> list[dict[str, Any]]:
    reply = r.client.get(f"{r.url}/v1/events", headers={"Authorization": f"Bearer {key}"})
    return [e for e in reply.json()["data"] if e["type"] == "batch" and e["batch"] == batch_id]


def test_a_batch_tells_its_owner_its_progress_and_counts_its_lines(
        router: RouterProcess) -> None:
    """Events: ``created``, ``in_progress``, ``progress`` (12 lines of 1 s, 4 at once, run
    at least 3 s: past ``PROGRESS_EVERY``), ``ended``, to Alice and an admin, never to Bob.
    Metrics: the lines counted by state as they finish, the pending gauge while it runs."""
    c = client(router)
    items = [line(f"p-{i}", model="slow", max_tokens=10) for i in range(12)]
    items.append(line("refused", model="no-such-model"))
    batch = c.batches.create(input_file_id=upload(c, items), endpoint="/v1/chat/completions",
                             completion_window="24h")
    created = batch_events(router, ALICE, batch.id)
    assert created[0]["action"] == "created" and created[0]["total"] == 13
    alice_key = created[0]["key"]
    before = {state: metric(router, ALICE, "modelyard_key_batch_lines_total", key=alice_key,
                            state=state) for state in ("succeeded", "errored")}
    assert before["errored"] >= 1  # the refused line, counted when the batch was made
    seen_pending = 0.0
    deadline = time.monotonic() + 60
    while c.batches.retrieve(batch.id).status in ("validating", "in_progress"):
        seen_pending = max(seen_pending, metric(router, ALICE,
                                                "modelyard_key_batch_lines_pending",
                                                key=alice_key))
        assert time.monotonic() < deadline
        time.sleep(0.2)
    done = finished(c, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 12, done
    assert 0 < seen_pending <= 12
    events = batch_events(router, ALICE, batch.id)
    actions = [e["action"] for e in events]
    assert actions[:2] == ["created", "in_progress"] and actions[-1] == "ended", actions
    assert set(actions[2:-1]) == {"progress"}, actions
    progress = [e["done"] for e in events if e["action"] == "progress"]
    assert progress == sorted(progress) and 1 <= progress[0] and progress[-1] < 13
    end = events[-1]
    assert (end["status"], end["done"], end["total"], end["succeeded"], end["errored"]) == (
        "completed", 13, 13, 12, 1)
    assert all(e["key"] == alice_key for e in events)
    assert batch_events(router, BOB, batch.id) == []
    assert [e["id"] for e in batch_events(router, ADMIN, batch.id)] == [
        e["id"] for e in events]
    assert metric(router, ALICE, "modelyard_key_batch_lines_total", key=alice_key,
                  state="succeeded") == before["succeeded"] + 12
    assert metric(router, ALICE, "modelyard_batch_lines_total", state="succeeded") >= 12
    assert metric(router, BOB, "modelyard_key_batch_lines_total", key=alice_key,
                  state="succeeded") == 0  # another key's series is not shown
    deadline = time.monotonic() + 10  # its runner lets it go just after it ended
    while metric(router, ADMIN, "modelyard_batches", status="in_progress") + metric(
            router, ADMIN, "modelyard_batches", status="finalizing"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert metric(router, ADMIN, "modelyard_key_batch_lines_pending", key=alice_key) == 0


def test_a_batch_past_its_window_expires(router: RouterProcess) -> None:
    c = client(router)
    items = [line(f"e-{i}", model="slow", max_tokens=20) for i in range(30)]
    batch = c.batches.create(input_file_id=upload(c, items), endpoint="/v1/chat/completions",
                             completion_window="3s")
    done = finished(c, batch.id)
    assert done.status == "expired" and done.expired_at, done
    got = results(c, done)
    assert set(got) == {f"e-{i}" for i in range(30)}
    assert sum(1 for v in got.values() if v["error"]
               and v["error"]["code"] == "batch_expired") >= 10


def test_a_router_killed_mid_batch_resumes_it_every_line_once(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    cache, work = tmp_path_factory.mktemp("kill-cache"), tmp_path_factory.mktemp("kill")
    items = [line(f"k-{i}", model="slow", max_tokens=10) for i in range(24)]
    subst = {"cache": str(cache), "poet": adapter_folder(work / "poet")}
    with running_router(PRESET, work, "batch-kill", subst) as r:
        c = client(r)
        batch = c.batches.create(input_file_id=upload(c, items),
                                 endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 30
        while c.batches.retrieve(batch.id).request_counts.completed < 4:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert r.proc is not None
        r.proc.send_signal(signal.SIGKILL)
        r.proc.wait()
    with running_router(PRESET, work, "batch-kill", subst) as again:
        c = client(again)
        done = finished(c, batch.id, timeout=120)
        assert done.status == "completed" and done.request_counts.completed == 24, done
        got = results(c, done)
        assert set(got) == {f"k-{i}" for i in range(24)}
        assert all(v["response"]["status_code"] == 200 for v in got.values())


def test_files_list_retrieve_delete(router: RouterProcess, tmp_path: Path) -> None:
    c = client(router)
    file_id = upload(c, [line("f")])
    assert c.files.retrieve(file_id).bytes == len(jsonl([line("f")]))
    assert c.files.content(file_id).content == jsonl([line("f")])
    listed = c.files.list(purpose="batch")
    validate_batch("ListFilesResponse", listed.model_dump(exclude_unset=True))
    assert file_id in [f.id for f in listed.data]
    gone = c.files.delete(file_id)
    validate_batch("DeleteFileResponse", gone.model_dump(exclude_unset=True))
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(file_id)


SWAP_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  spare_workers: 0
  cache_dir: {cache}
  max_loaded_models: 1
  swap_wait: 1  # a model in use yields soon to a waiting load: not to a batch's
models:
  a: {model: /synthetic, engine: synthetic}
  b: {model: /synthetic, engine: synthetic}
"""


@pytest.fixture(scope="module")
def one_room(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(SWAP_PRESET, tmp_path_factory.mktemp("one-room"), "batch-one-room",
                        {"cache": str(tmp_path_factory.mktemp("one-room-cache"))}) as r:
        yield r


def loads(r: RouterProcess, model: str) -> int:
    return int(r.client.get(f"{r.url}/v1/models/{model}").json().get("loads") or 0)


def starts(r: RouterProcess, model: str) -> int:
    """Times ``model`` began to run: loads and wakes from parked."""
    m = r.client.get(f"{r.url}/v1/models/{model}").json()
    return int(m.get("loads") or 0) + int(m.get("wakes") or 0)


def made_room(r: RouterProcess, model: str) -> int:
    """Times ``model`` gave up its room: stopped (evicted) or parked."""
    m = r.client.get(f"{r.url}/v1/models/{model}").json()
    return int(m.get("evictions") or 0) + int(m.get("parks") or 0)


def test_a_batch_over_two_models_in_one_room_loads_each_once(one_room: RouterProcess) -> None:
    c = client(one_room, "-")
    items = [line(f"ab-{i}", model="ab"[i % 2]) for i in range(20)]
    batch = c.batches.create(input_file_id=upload(c, items), endpoint="/v1/chat/completions",
                             completion_window="24h")
    done = finished(c, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 20, done
    assert (loads(one_room, "a"), loads(one_room, "b")) == (1, 1)
    got = results(c, done)
    assert all(got[f"ab-{i}"]["response"]["body"]["model"] == "ab"[i % 2] for i in range(20))


def test_a_batch_never_evicts_the_model_a_person_uses(one_room: RouterProcess) -> None:
    """The room holds ``a``, which a person uses; a batch for ``b`` waits until ``a`` has
    had no person's request for ``BATCH_QUIET`` seconds, then loads ``b``."""
    from router.lifecycle.policy.room import BATCH_QUIET

    c = client(one_room, "-")
    person = one_room.client.post(f"{one_room.url}/v1/chat/completions", timeout=60, json={
        "model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert person.status_code == 200
    batch = c.batches.create(input_file_id=upload(c, [line(f"b-{i}", model="b")
                                                      for i in range(4)]),
                             endpoint="/v1/chat/completions", completion_window="24h")
    b_starts, a_made_room = starts(one_room, "b"), made_room(one_room, "a")
    until = time.monotonic() + BATCH_QUIET * 0.8
    while time.monotonic() < until:  # the person goes on using ``a``
        assert one_room.client.post(f"{one_room.url}/v1/chat/completions", timeout=60, json={
            "model": "a", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}).status_code == 200
        assert c.batches.retrieve(batch.id).request_counts.completed == 0
        # neither stopped nor parked for the batch: b neither loads nor wakes
        assert starts(one_room, "b") == b_starts
        assert made_room(one_room, "a") == a_made_room
        time.sleep(1.0)
    done = finished(c, batch.id, timeout=BATCH_QUIET * 3)
    assert done.status == "completed" and done.request_counts.completed == 4, done
    assert starts(one_room, "b") == b_starts + 1  # loaded, or woken from parked


def test_an_upload_past_files_max_mib_is_refused(router: RouterProcess) -> None:
    """Declared (a length) or not (chunked), a body past ``files_max_mib`` is a 413, and
    nothing of it is kept."""
    import httpx

    headers = {"Authorization": f"Bearer {ALICE}"}
    big = httpx.post(f"{router.url}/v1/files", headers=headers, timeout=60,
                     data={"purpose": "batch"}, files={"file": ("big.jsonl", b"x" * 300_000)})
    assert big.status_code == 413, big.text
    boundary = "modelyard-test-boundary"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
            f'batch\r\n--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="big.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n').encode()

    def chunked() -> Iterator[bytes]:
        yield head
        for _ in range(300):
            yield b"x" * 1024
        yield f"\r\n--{boundary}--\r\n".encode()

    streamed = httpx.post(f"{router.url}/v1/files", content=chunked(), timeout=60, headers={
        **headers, "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert streamed.status_code == 413, streamed.text
    assert "big.jsonl" not in [f.filename for f in client(router).files.list().data]


def test_a_keys_files_stay_within_its_quota(router: RouterProcess) -> None:
    """``files_quota_mib`` bounds one key's uploads together (Bob's here; Alice's are
    apart), and deleting one makes room."""
    bob = client(router, BOB)
    body = b"x" * 90_000
    kept = [bob.files.create(file=(f"f{i}.jsonl", body), purpose="batch").id
            for i in range(2)]
    with pytest.raises(openai.APIStatusError) as err:
        bob.files.create(file=("f2.jsonl", body), purpose="batch")
    assert err.value.status_code == 413 and err.value.code == "files_quota_exceeded"
    client(router).files.create(file=("alice.jsonl", body), purpose="batch")  # hers apart
    bob.files.delete(kept.pop())
    kept.append(bob.files.create(file=("f3.jsonl", body), purpose="batch").id)
    for file_id in kept:
        bob.files.delete(file_id)


def test_each_line_is_a_row_of_the_usage_ledger(router: RouterProcess) -> None:
    """A batch's lines are requests of its owner's key: one usage row each, under the
    line's endpoint and model."""
    import httpx

    c = client(router, BOB)
    done = finished(c, c.batches.create(input_file_id=upload(c, [line(f"u-{i}", model="other")
                                                                 for i in range(3)]),
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h").id)
    assert done.request_counts.completed == 3
    deadline = time.monotonic() + 10  # the ledger writes every second
    while True:
        rows = httpx.get(f"{router.url}/v1/usage?group_by=key,model,endpoint", timeout=30,
                         headers={"Authorization": f"Bearer {BOB}"}).json()["data"]
        mine = [r for r in rows if r.get("model") == "other"]
        if mine and mine[0]["requests"] >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(mine) == 1 and mine[0]["requests"] == 3, rows
    assert mine[0]["endpoint"] == "chat" and mine[0]["completion_tokens"] > 0
