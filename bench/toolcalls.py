"""Tool calls under ``tool_choice: auto``, as agents send them: the embedded model on the
default preset (``configs/default.yaml`` as shipped, its ``tool_strict_level`` left at the
default ``parameter``), the same preset at ``tool_strict_level: auto`` (no structural tag:
how modelyard answered before), and ``vllm serve`` with its defaults and with
``--tool-strict-level parameter``, one after another in one run.

Each server gets ``N`` (20) chat requests that ask for a tool ("Use the tool."), with two
declared tools, at the server's default sampling, ``max_tokens`` 300, not streamed; the
modelyard presets also at temperature 1.0 (``vllm serve``'s default here), where the model
wanders and starts calls. Each answer is one of:

- ``call``: every tool call names a declared tool and its arguments parse as JSON and
  validate against that tool's schema, and ``content`` holds no tool markup;
- ``text``: no call, no markup in ``content``;
- ``broken``: anything else (an undeclared tool, unparseable or schema-invalid arguments,
  ``<tool_call>`` markup in ``content``).

Target (issue 27): 0 broken of 20 on the default preset.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema

from bench.common import PY, ROOT, Server, free_port, modelyard, report
from bench.overhead import ENV
from shared.config import ModelSpec
from worker.engine_args import auto_dtype, cpu_flags
from worker.materialize import resolve_model_path

N = int(os.environ.get("BENCH_TOOLCALLS_N", "20"))
MAX_TOKENS = 300
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a time zone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                       "required": ["timezone"], "additionalProperties": False}}},
]
QUESTIONS = ["What is the weather in Paris? Use the tool.",
             "What time is it in Tokyo? Use the tool."]
MARKUP = ("<tool_call>", "</tool_call>")
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def preset(strict: str | None) -> str:
    """``configs/default.yaml`` on a free port (``{port}``), ``tool_strict_level`` set."""
    text = (ROOT / "configs" / "default.yaml").read_text().replace("port: 8080", "port: {port}")
    if strict is not None:
        text = text.replace("    tool_parser: hermes\n",
                            f"    tool_parser: hermes\n    tool_strict_level: {strict}\n")
        assert f"tool_strict_level: {strict}" in text
    return text


def vllm_serve(*extra: str) -> Server:
    folder = resolve_model_path("builtin:smollm2", None)
    dtype = auto_dtype(ModelSpec(id="smollm2", model=folder), cpu_flags())
    port = free_port()
    template = ROOT / "shared" / "templates" / "chatml-tools.jinja"
    return Server([PY, "-m", "vllm.entrypoints.openai.api_server",
        "--model", folder, "--served-model-name", "smollm2", "--enforce-eager",
        "--max-model-len", "8192", "--dtype", dtype, "--port", str(port), "--host",
        "127.0.0.1", "--disable-uvicorn-access-log", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--chat-template", str(template), *extra],
        port, env=ENV, name="vllm")


def judge(body: dict[str, Any]) -> str:
    """``call``, ``text`` or ``broken`` (see the module's docstring)."""
    message = body["choices"][0]["message"]
    content = message.get("content") or ""
    if any(m in content for m in MARKUP):
        return "broken"
    calls = message.get("tool_calls") or []
    for call in calls:
        fn = call["function"]
        if fn["name"] not in SCHEMAS:
            return "broken"
        try:
            jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
        except (ValueError, jsonschema.ValidationError):
            return "broken"
    return "call" if calls else "text"


def measure(server: Server, wait_path: str, temperature: float | None = None
            ) -> dict[str, Any]:
    server.wait(wait_path, timeout=900)
    counts = {"call": 0, "text": 0, "broken": 0}
    tokens: list[int] = []
    seconds: list[float] = []
    examples: dict[str, Any] = {}
    with httpx.Client(base_url=server.url + "/v1", timeout=600) as client:  # one at a time
        for i in range(N):
            started = time.monotonic()
            r = client.post("/chat/completions", json={
                "model": "smollm2", "tools": TOOLS, "tool_choice": "auto",
                "max_tokens": MAX_TOKENS,
                **({"temperature": temperature} if temperature is not None else {}),
                "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]})
            seconds.append(time.monotonic() - started)
            r.raise_for_status()
            body = r.json()
            verdict = judge(body)
            counts[verdict] += 1
            tokens.append(body["usage"]["completion_tokens"])
            if verdict not in examples:  # one answer of each kind, to read in the log
                examples[verdict] = body["choices"][0]["message"]
                print(verdict, json.dumps(examples[verdict])[:600], flush=True)
    return {**counts, "requests": N, "completion_tokens_mean": round(statistics.mean(tokens), 1),
            "completion_tokens_max": max(tokens),
            "seconds_mean": round(statistics.mean(seconds), 2)}


def main() -> None:
    results: dict[str, Any] = {}
    # Each server once; at temperature 1.0 (``vllm serve``'s default for this model, which
    # has no sampling defaults of its own) modelyard's preset is measured again, so that
    # the structural tag is compared on the same sampling.
    both: list[tuple[str, float | None]] = [("", None), (", temperature 1.0", 1.0)]
    runs: list[tuple[str, Callable[[], Server], str, list[tuple[str, float | None]]]] = [
        ("modelyard, default preset (tool_strict_level parameter)",
         lambda: modelyard(preset(None)), "/health/ready", both),
        ("modelyard, tool_strict_level auto (no tag, as before)",
         lambda: modelyard(preset("auto")), "/health/ready", both),
        ("vllm serve, defaults", vllm_serve, "/v1/models", [("", None)]),
        ("vllm serve --tool-strict-level parameter",
         lambda: vllm_serve("--tool-strict-level", "parameter"), "/v1/models", [("", None)]),
    ]
    for name, start, ready, samplings in runs:
        with start() as server:
            for suffix, temperature in samplings:
                results[name + suffix] = measure(server, ready, temperature)
                print(name + suffix, results[name + suffix], flush=True)
    rows = [("server", "calls", "text", "broken", "tokens mean", "s mean")]
    rows += [(name, str(r["call"]), str(r["text"]), str(r["broken"]),
              str(r["completion_tokens_mean"]), str(r["seconds_mean"]))
             for name, r in results.items()]
    report("toolcalls", {"requests_each": N, "max_tokens": MAX_TOKENS,
                         "questions": QUESTIONS, "runs": results}, rows)


if __name__ == "__main__":
    main()

