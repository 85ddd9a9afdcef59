"""Real clients with their defaults (issue 23) against a router serving
``configs/default.yaml`` as it is (its port aside): the embedded model, 8 192 tokens of
context, Hermes tools. The CLIs come from npm (``tests/clients``, ``make clients``).

On 651c79a: Claude Code's every request was a 400 (it sends ``max_tokens: 32000``), and
a tool round trip with ``tool_choice`` left to ``auto`` was a 400 ("no tool_parser").
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conformance import validate
from tests.conftest import ROOT, RouterProcess, running_router

pytestmark = pytest.mark.integration

CLIENTS = ROOT / "tests" / "clients" / "node_modules" / ".bin"
WEATHER_TOOL = {"name": "get_weather", "description": "The current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}
WEATHER_TOOL_OPENAI = {"name": WEATHER_TOOL["name"], "description": WEATHER_TOOL["description"],
                       "parameters": WEATHER_TOOL["input_schema"]}


@pytest.fixture(scope="module")
def default_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    text = (ROOT / "configs" / "default.yaml").read_text()
    text = re.sub(r"(?m)^  port: 8080$", "  port: {port}", text)
    assert "{port}" in text
    with running_router(text, tmp_path_factory.mktemp("agents"), "default") as r:
        r.wait_model("smollm2", timeout=600)
        yield r


def readme_first_request() -> str:
    """README's first request, as README writes it (``reply = client.chat...(...)``)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    return block[block.index("reply = "):block.index("print(reply")]


def test_readmes_first_question_is_answered_right(default_router: RouterProcess) -> None:
    """Issue 27: sent as README writes it (no temperature), the default preset answered
    "What is the capital of France?" naming Paris 9 times in 20 (the engine's temperature
    1.0); its ``sampling_defaults`` make it 20 of 20 here."""
    from openai import OpenAI

    client = OpenAI(base_url=default_router.url + "/v1", api_key="unused", max_retries=0)
    answers = []
    for _ in range(20):
        scope: dict[str, object] = {"client": client}
        exec(readme_first_request(), scope)  # noqa: S102  # README's own words
        answers.append(scope["reply"].choices[0].message.content)  # type: ignore[attr-defined]
    named = sum("Paris" in a for a in answers)
    assert named >= 18, answers


def test_an_answer_without_a_limit_stops_at_the_presets_max_tokens(
        default_router: RouterProcess) -> None:
    """The docs' tool example, sent without ``max_tokens``, wrote text to the end of the
    8 192-token context on 4ec1f30: 8 022 tokens in 324 s here. The default preset's
    ``sampling_defaults.max_tokens`` (512) now ends such an answer; a request's own
    limit, even a larger one, wins. ``ignore_eos`` makes the model write to the limit."""
    async def ask(limit: int | None) -> Any:
        async with httpx.AsyncClient(base_url=default_router.url, timeout=300) as http:
            body: dict[str, Any] = {"model": "smollm2", "ignore_eos": True, "tools": [
                {"type": "function", "function": WEATHER_TOOL_OPENAI}], "messages": [
                {"role": "user", "content": "What is the weather in Paris?"}]}
            if limit is not None:
                body["max_tokens"] = limit
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

    async def both() -> list[Any]:
        return list(await asyncio.gather(ask(None), ask(520)))

    unbounded, asked = asyncio.run(both())
    assert unbounded["usage"]["completion_tokens"] == 512, unbounded["usage"]
    assert unbounded["choices"][0]["finish_reason"] == "length"
    assert asked["usage"]["completion_tokens"] == 520, asked["usage"]


def test_the_anthropic_sdks_tool_round_trip_with_auto_on_the_default_preset(
        default_router: RouterProcess) -> None:
    from anthropic import Anthropic

    with Anthropic(base_url=default_router.url, api_key="unused", max_retries=0,
                   timeout=300) as claude:
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = claude.messages.create(  # a call it must make: the tool named
            model="smollm2", max_tokens=100, messages=ask, tools=[WEATHER_TOOL],  # type: ignore[list-item]
            tool_choice={"type": "tool", "name": "get_weather"})
        call = next(b for b in first.content if b.type == "tool_use")
        # The result goes back with the tools still offered and tool_choice left unset
        # (auto), as every agent sends it.
        second = claude.messages.create(
            model="smollm2", max_tokens=60, tools=[WEATHER_TOOL],  # type: ignore[list-item]
            messages=[*ask, {"role": "assistant", "content": first.content},  # type: ignore[list-item]
                      {"role": "user", "content": [{
                          "type": "tool_result", "tool_use_id": call.id,
                          "content": "Sunny, 24 degrees"}]}])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use"), second
    assert second.content


def claude_code(router: RouterProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """Claude Code headless, pointed at ``router`` and nothing else (no telemetry, no
    updates: the machine has no other network)."""
    home = router.workdir / "claude-home"
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home),
           "ANTHROPIC_BASE_URL": router.url, "ANTHROPIC_AUTH_TOKEN": "unused",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
           "DISABLE_TELEMETRY": "1"}
    return subprocess.run([str(CLIENTS / "claude"), *args], env=env, cwd=router.workdir,
                          capture_output=True, text=True, timeout=600, check=False)


def test_claude_code_with_its_default_max_tokens_gets_an_answer(
        default_router: RouterProcess) -> None:
    """Claude Code 2.1 headless with a short system prompt and one tool: its request asks
    ``max_tokens: 32000`` (no environment override), which the router clamps."""
    done = claude_code(default_router, "-p", "Say hello in one short sentence.", "--bare",
                       "--model", "smollm2", "--system-prompt", "You are a helpful assistant.",
                       "--tools", "Read", "--output-format", "json")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:],
                                  default_router.tail(30))
    assert '"is_error":false' in done.stdout.replace(" ", ""), done.stdout[-2000:]
    log = default_router.tail(400)
    assert re.search(r"messages model=smollm2 max_tokens clamped to \d+", log), log[-3000:]
    assert "status=200" in log


SCRIPTED = """
server: {host: 127.0.0.1, port: {port}, spare_workers: 0}
models:
  scripted:
    model: /synthetic
    engine: synthetic
    max_model_len: 200000
    engine_args:
      script:
        - tool_call: {name: exec_command, arguments: {cmd: "echo modelyard-was-here > proof.txt"}}
        - text: "I wrote proof.txt for you."
  greeter:
    model: /synthetic
    engine: synthetic
    max_model_len: 200000
    aliases: [claude-sonnet, claude-opus, claude-haiku]
    engine_args:
      script:
        - text: "Hello from modelyard."
"""


@pytest.fixture(scope="module")
def scripted_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with running_router(SCRIPTED, tmp_path_factory.mktemp("scripted"), "scripted") as r:
        yield r


CODEX_CONFIG = """
model = "{model}"
model_provider = "modelyard"

[model_providers.modelyard]
name = "modelyard"
base_url = "{url}/v1"
wire_api = "responses"

[model_providers.modelyard.auth]
command = "sh"
args = ["-c", "echo ${{MODELYARD_API_KEY:-none}}"]
"""
"""README's ``~/.codex/config.toml``. The provider's ``auth`` command is what makes Codex
ask ``/v1/models?client_version=`` for its models' metadata (``router.api.codex_catalog``)."""


def codex_exec(router: RouterProcess, home: str, model: str,
               prompt: str) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    """Codex headless (``exec``) with README's config in a HOME of its own (``home``
    under the router's workdir): the run, the HOME and the project folder it ran in."""
    codex_home = router.workdir / home
    (codex_home / ".codex").mkdir(parents=True, exist_ok=True)
    (codex_home / ".codex" / "config.toml").write_text(
        CODEX_CONFIG.format(model=model, url=router.url))
    project = router.workdir / f"{home}-project"
    project.mkdir(exist_ok=True)
    done = subprocess.run(
        [str(CLIENTS / "codex"), "exec", "--skip-git-repo-check",
         "--dangerously-bypass-approvals-and-sandbox", prompt],
        env={"PATH": os.environ["PATH"], "HOME": str(codex_home)}, cwd=project,
        capture_output=True, text=True, timeout=300, check=False)
    return done, codex_home, project


def test_codex_exec_completes_two_turns_where_the_first_used_a_tool(
        scripted_router: RouterProcess) -> None:
    """Codex 0.169 ``exec`` over the Responses API (streamed), as README configures it.
    The model's words are scripted (a synthetic engine replays a tool call, then an
    answer), so the tool round trip is deterministic: turn one asks for ``exec_command``,
    Codex runs it and sends its output back in turn two with its whole history."""
    r = scripted_router
    done, _, project = codex_exec(r, "codex-home", "scripted", "Write proof.txt, please.")
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:], r.tail(30))
    assert (project / "proof.txt").read_text() == "modelyard-was-here\n"
    assert "I wrote proof.txt for you." in done.stdout + done.stderr
    turns = [line for line in r.tail(400).splitlines()
             if "responses model=scripted" in line and "status=200" in line]
    assert len(turns) == 2, r.tail(60)


def test_codex_finds_the_models_metadata_without_a_warning(
        scripted_router: RouterProcess) -> None:
    """Issue 27: Codex 0.169 warned "Model metadata for `smollm2` not found. Defaulting to
    fallback metadata" on every run. With an ``auth`` command on its provider it asks
    ``/v1/models?client_version=0.169.0`` and reads ``{"models": [...]}``, which the
    router did not serve: now it does, beside OpenAI's list, with the preset's context
    window, and Codex keeps it (its ``models_cache.json``)."""
    r = scripted_router
    done, codex_home, _ = codex_exec(r, "codex-metadata", "greeter", "Say hello.")
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:], r.tail(30))
    assert "Hello from modelyard." in done.stdout
    said = done.stdout + done.stderr
    assert "Model metadata" not in said and "fallback metadata" not in said, said[-3000:]
    cached = json.loads((codex_home / ".codex" / "models_cache.json").read_text())
    assert {m["slug"]: m.get("context_window") for m in cached["models"]}["greeter"] == 200000

    listed = r.client.get(f"{r.url}/v1/models", params={"client_version": "0.169.0"}).json()
    validate("ListModelsResponse", listed)  # still OpenAI's list
    assert [m["slug"] for m in listed["models"]] == [
        "scripted", "greeter", "claude-sonnet", "claude-opus", "claude-haiku"]
    assert "models" not in r.client.get(f"{r.url}/v1/models").json()  # asked by Codex only


def test_claude_code_with_every_default_gets_an_answer(scripted_router: RouterProcess) -> None:
    """Claude Code 2.1 as it starts with nothing set but where the server is: its whole
    default system prompt with every tool (about 29 k tokens), its own model names (the
    preset's aliases take them), ``max_tokens: 32000``. The model's words are scripted:
    the embedded model's 8 192 tokens of context cannot hold that prompt."""
    r = scripted_router
    done = claude_code(r, "-p", "Say hello.", "--output-format", "json")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], r.tail(30))
    assert '"is_error":false' in done.stdout.replace(" ", ""), done.stdout[-2000:]
    assert "Hello from modelyard." in done.stdout
    asked = [int(m.group(1)) for m in re.finditer(
        r"messages model=greeter stream=\w+ status=200 prompt=(\d+)", r.tail(400))]
    # The synthetic engine counts words, not tokens (and the tools JSON's): the default system
    # prompt alone is thousands of words, a bare run's a few dozen.
    assert asked and max(asked) > 2000, r.tail(60)
