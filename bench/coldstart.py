"""Cold start: from a request to a never-loaded model to its first token through
modelyard, against ``vllm serve``'s start-to-first-token for the same model and engine
arguments; and again after an idle reap. Target ratio <= 1.05.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import httpx

from bench.common import PROMPT, modelyard, report
from bench.overhead import vllm_serve

ROUNDS = 2
PRESET = """
server: {host: 127.0.0.1, port: {port}}
models:
""" + "".join(f"""  cold-{i}: {{model: "builtin:smollm2", cpu_cores: "0-1", max_model_len: 2048,
            kv_cache_gib: 1, ttl: 2}}
""" for i in range(ROUNDS))


def first_token(url: str, model: str) -> float:
    """Seconds from sending a streamed completion to its first token."""
    start = time.monotonic()
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - start
    raise RuntimeError("no token")


def vllm_start_to_first_token() -> float:
    with vllm_serve() as server:
        server.wait("/v1/models", timeout=900)
        first_token(server.url, "smollm2")
        return time.monotonic() - server.started


def main() -> None:
    vllm_runs, cold_runs, reap_runs, loads = [], [], [], []
    with modelyard(PRESET) as yard:
        yard.wait("/health")
        for i in range(ROUNDS):
            vllm_runs.append(vllm_start_to_first_token())
            cold_runs.append(first_token(yard.url, f"cold-{i}"))
            loads.append(httpx.get(f"{yard.url}/v1/models/cold-{i}").json()["load_seconds"])
        # After an idle reap (ttl 2 s) the next request starts the model again.
        while httpx.get(f"{yard.url}/v1/models/cold-0").json()["state"] != "unloaded":
            time.sleep(0.2)
        reap_runs.append(first_token(yard.url, "cold-0"))
    result: dict[str, Any] = {
        "vllm_start_to_first_token_s": [round(v, 2) for v in vllm_runs],
        "modelyard_cold_first_token_s": [round(v, 2) for v in cold_runs],
        "modelyard_worker_load_s": loads,
        "modelyard_after_reap_first_token_s": [round(v, 2) for v in reap_runs],
    }
    ratio = statistics.mean(cold_runs) / statistics.mean(vllm_runs)
    result["ratio_cold_vs_vllm"] = round(ratio, 3)
    result["ratio_after_reap_vs_vllm"] = round(statistics.mean(reap_runs) /
                                               statistics.mean(vllm_runs), 3)
    rows = [("what", "seconds"),
            ("vllm serve start → first token", f"{statistics.mean(vllm_runs):.1f}"),
            ("modelyard never-loaded → first token", f"{statistics.mean(cold_runs):.1f}"),
            ("modelyard after idle reap → first token", f"{statistics.mean(reap_runs):.1f}"),
            ("ratio (cold / vllm)", f"{ratio:.3f}")]
    report("coldstart", result, rows)


if __name__ == "__main__":
    main()
