"""Fixtures: a real router process with real vLLM workers on the embedded model.

One router is shared by the whole session (a CPU worker takes about a minute to start).
Nothing here talks to any address but 127.0.0.1.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A modelyard cache of the session's own (``MODELYARD_CACHE_DIR``): a router or app
    that a test makes without a ``cache_dir`` or a database writes its database, batch
    files and runner lock there, never into the user's ``~/.cache/modelyard`` (whose
    status page would show them). The embedded model's folder is the user's cache's,
    linked in where it was converted already (else converted here, once a session)."""
    from shared.config import CACHE_VARIABLE, default_cache_dir
    from worker.materialize import link_builtins

    before = os.environ.get(CACHE_VARIABLE)
    cache = tmp_path_factory.mktemp("modelyard-cache")
    if default_cache_dir().resolve() != cache.resolve():
        link_builtins("builtin:smollm2", cache, convert=False)
    os.environ[CACHE_VARIABLE] = str(cache)
    yield cache
    if before is None:
        os.environ.pop(CACHE_VARIABLE, None)
    else:
        os.environ[CACHE_VARIABLE] = before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RouterProcess:
    """``modelyard serve`` on a free port, with its log kept for failure reports."""

    def __init__(self, preset_text: str, workdir: Path, name: str,
                 subst: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.preset = workdir / f"{name}.yaml"
        for key, value in {"port": str(self.port), "root": str(ROOT), **(subst or {})}.items():
            preset_text = preset_text.replace("{" + key + "}", value)
        self.preset.write_text(preset_text)
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        # For frequent polls: a fresh ``httpx.get`` builds an SSL context each time,
        # ~60 ms here and several times that on a CPU busy with vLLM.
        self.client = httpx.Client(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.log = open(self.log_path, "wb")  # noqa: SIM115  # the router's stdout until stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--config", str(self.preset),
             # its own named keys: none unless a test makes some
             "--database-url", f"sqlite:///{self.workdir / 'modelyard.db'}"],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.tail()
            try:
                if self.client.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.2)
        raise TimeoutError(f"router did not answer /health\n{self.tail()}")

    def wait_model(self, model: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.client.get(f"{self.url}/v1/models/{model}").json().get("state")
            if state == "ready":
                return
            assert state != "failed", self.tail()
            time.sleep(0.5)
        raise TimeoutError(f"model {model} not ready\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.client.close()


async def connected_peer(ctx: Any, link: Any, endpoint: str) -> Any:
    """A worker's end of ``link`` (a ``WorkerLink``): it knows the CURVE key, as a worker
    learns it over stdin, and has said ``Ready``, so the handshake is done."""
    import asyncio

    import zmq

    from shared.protocol import Codec, Ready, ToRouter

    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.curve_serverkey = link.key.encode()
    peer.curve_publickey, peer.curve_secretkey = zmq.curve_keypair()
    peer.connect(endpoint)
    peer.send(Codec(ToRouter).encode(Ready(model=link.model, max_model_len=1, pid=1)))
    await asyncio.wait_for(link.wait_ready(), 10)
    return peer


def from_router(peer: Any) -> object:
    """The next message a worker's end (``peer``) has from the router, as a worker reads
    it: the empty frame that ends each of the router's turns is skipped. ``zmq.Again``
    when there is none."""
    import zmq

    from shared.protocol import worker_codec

    while not (frame := peer.recv(zmq.NOBLOCK)):
        pass
    return worker_codec().decode(frame)


@contextlib.contextmanager
def running_router(preset: str, workdir: Path, name: str,
                   subst: dict[str, str] | None = None,
                   kind: type[RouterProcess] = RouterProcess) -> Iterator[RouterProcess]:
    """A started, healthy router (a ``kind``) that is stopped when the block ends;
    ``{key}`` in the preset is replaced by ``subst[key]`` (and ``{port}``, ``{root}``)."""
    r = kind(preset, workdir, name, subst)
    r.start()
    try:
        r.wait_healthy()
        yield r
    finally:
        r.stop()


@contextlib.contextmanager
def router_with_runtime(preset: str, workdir: Path, name: str) -> Iterator[RouterProcess]:
    """``running_router`` whose preset's ``{runtime}`` is a short directory of its own
    (worker socket paths live there and must fit 107 bytes), removed afterwards."""
    runtime = tempfile.mkdtemp(prefix=f"my-{name}-")
    try:
        with running_router(preset, workdir, name, {"runtime": runtime}) as r:
            yield r
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


LONG_STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


def kill_mid_stream(r: RouterProcess, model: str, victim: psutil.Process) -> None:
    """SIGKILL ``victim`` (``model``'s worker, or what it does not outlive) while a stream
    and a plain request of ``model`` are in flight: both end with an error within 2 s, the
    stream in-band, the other a 502 ``worker_lost``."""
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="x", max_retries=0, timeout=600)
    stream = client.chat.completions.create(
        model=model, messages=LONG_STORY, max_tokens=400, stream=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True})
    next(iter(stream))
    body = {"model": model, "messages": LONG_STORY, "max_tokens": 400, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        blocking = pool.submit(httpx.post, f"{r.url}/v1/chat/completions", json=body,
                               timeout=600)
        # Kill once the plain request is in flight too (its lease is taken in the turn it
        # is sent to the worker): a fixed sleep lost that race on a loaded machine, and the
        # request then waited, rightly, for the restart.
        deadline = time.monotonic() + 60
        while r.client.get(f"{r.url}/v1/models/{model}").json()["in_flight"] < 2:
            assert time.monotonic() < deadline, "the plain request never reached the model"
            time.sleep(0.02)
        killed_at = time.monotonic()
        victim.kill()
        with pytest.raises(openai.APIError) as info:
            for _ in stream:
                pass
        stream_ended = time.monotonic() - killed_at
        reply = blocking.result()
        other_ended = time.monotonic() - killed_at
    assert stream_ended < 2.0 and other_ended < 2.0, (stream_ended, other_ended)
    assert "exited unexpectedly" in str(info.value)
    assert reply.status_code == 502 and reply.json()["error"]["code"] == "worker_lost"


MAIN_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  default_model: smollm2
  load_timeout: 600
models:
  smollm2:
    model: "builtin:smollm2"
    aliases: [smol, Tiny-Chat, claude-sonnet]
    cpu_cores: "0"
    max_model_len: 2048
    # Tests read this model's greedy words ("Paris"); ``auto`` is bfloat16 on a CPU with
    # AVX-512 BF16 or AMX and float32 elsewhere, and the two decode different words.
    dtype: float32
    load_on_startup: true
    chat_template: builtin:chatml-tools
    tool_parser: hermes
  smollm2-b:
    model: "builtin:smollm2"
    aliases: [second-worker]
    cpu_cores: "1"
    max_model_len: 1024
    reasoning_parser: olmo3
    env: {HF_TOKEN: "hf_secret_for_tests_only"}
  smollm2-embed:
    model: "builtin:smollm2"
    task: embed
    cpu_cores: "1"
    max_model_len: 512
  tiny-vlm:
    model: "{tiny_vlm}"
    cpu_cores: "1"
    max_model_len: 512
"""


@pytest.fixture(scope="session")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """The shared router: ``smollm2`` (tools: hermes) loads at start-up; ``smollm2-b``
    (reasoning: olmo3), ``smollm2-embed`` (embeddings) and ``tiny-vlm`` (a random-weight
    multimodal model, ``tests/tiny_vlm.py``) on first use."""
    from tests.tiny_vlm import build_tiny_vlm
    from worker.materialize import resolve_model_path

    # The tiny model borrows SmolLM2's tokenizer (materialised once; the worker reuses it).
    tokenizer = Path(resolve_model_path("builtin:smollm2", None))
    vlm = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-idefics3", tokenizer)
    with running_router(MAIN_PRESET, tmp_path_factory.mktemp("router"), "main",
                        {"tiny_vlm": str(vlm)}) as r:
        r.wait_model("smollm2", timeout=600)
        yield r


@pytest.fixture(scope="session")
def base_url(router: RouterProcess) -> str:
    return router.url + "/v1"


@pytest.fixture
def client(base_url: str):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    with OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def aclient(base_url: str):  # type: ignore[no-untyped-def]
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
