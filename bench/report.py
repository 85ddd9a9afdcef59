"""``python -m bench.report``: the performance page's tables, made from ``bench/results/*.json``.

``docs/performance.md`` holds each benchmark's tables between ``<!-- bench:NAME:start -->``
and ``<!-- bench:NAME:end -->``. Nobody copies a figure by hand: ``python -m bench`` and
``python -m bench.report --write`` rewrite those blocks, the docs hook (``docs/hooks.py``)
fills them again at every site build, and ``tests/test_docs.py`` keeps the committed page
equal to what this module makes and checks that every figure of every results file is
on it. A results file with no table of its own here gets a plain list of its figures.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"

MARKER = re.compile(r"<!-- bench:(?P<name>[\w-]+):start -->\n.*?<!-- bench:(?P=name):end -->",
                    re.DOTALL)

Result = dict[str, Any]


def shown(value: Any) -> str:
    """A figure as the page writes it: numbers exactly as the JSON records them."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, list):
        return ", ".join(shown(v) for v in value)
    return str(value)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(shown(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(name: str, result: Result, setup: str = "") -> str:
    """Which run, on which machine, a block's figures come from (what the file records)."""
    m = result.get("machine", {})
    machine = ", ".join(part for part in (
        f"{m['cpus']} CPUs ({m['cpu']})" if "cpus" in m and "cpu" in m else "",
        f"{shown(m['memory_gib'])} GiB" if "memory_gib" in m else "",
        f"Python {m['python']}" if "python" in m else "") if part)
    said = [f"`bench/results/{name}.json` (`bench/{name}.py`)",
            f"run of {result['when']}" if "when" in result else "",
            f"on commit `{result['commit']}`" if "commit" in result else "",
            f"machine: {machine}" if machine else "", setup]
    return "*" + "; ".join(s for s in said if s) + ".*"


def overhead(r: Result) -> str:
    rows = []
    for streams in (1, 16):
        point = r[f"streams_{streams}"]
        for key, server in (("vllm", "vllm serve"), ("modelyard", "modelyard"),
                            ("in_process", "in-process engine")):
            s = point[key]
            rows.append((streams, server, s["tokens_per_s"], s["ttft_p50_ms"], s["ttft_p99_ms"],
                         s["itl_p50_ms"], s["itl_p99_ms"], s["errors"]))
    a = r["after_load_1_stream"]
    rows.append((1, "modelyard right after a load", a["tokens_per_s"], a["ttft_p50_ms"],
                 a["ttft_p99_ms"], a["itl_p50_ms"], a["itl_p99_ms"], a["errors"]))
    ratios = [(n, r[f"streams_{n}"]["ratio_tokens_per_s"], r[f"streams_{n}"]["ratio_in_process"],
               r[f"streams_{n}"]["ratio_itl_p99"], r[f"streams_{n}"]["ttft_p50_added_ms"])
              for n in (1, 16)]
    setup = f"{r['tokens']} tokens a stream, {r['rounds']} rounds, cores {r['cores']}"
    return "\n\n".join([
        provenance("overhead", r, setup),
        table(["streams", "server", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
               "ITL p99 ms", "errors"], rows),
        table(["streams", "tokens/s, modelyard ÷ vllm serve", "modelyard ÷ in-process",
               "ITL p99, modelyard ÷ vllm serve", "TTFT p50 added ms"], ratios),
        (f"Right after a load, modelyard's 1-stream rate was {shown(a['ratio_to_steady'])}× "
        f"its steady rate (a spare still importing afterwards: "
        f"{shown(a['spare_still_importing_after'])}).")])


def vllmclient(r: Result) -> str:
    rows, ratios = [], []
    for streams in (1, 16):
        point = r[f"streams_{streams}"]
        for key, server in (("vllm", "vllm serve"), ("modelyard", "modelyard")):
            s = point[key]
            rows.append((streams, server, s["output_throughput"], s["median_ttft_ms"],
                         s["p99_ttft_ms"], s["median_itl_ms"], s["p99_itl_ms"], s["failed"],
                         ", ".join(f"{run['output_throughput']} / {run['p99_itl_ms']}"
                                   for run in s["runs"])))
        ratios.append((streams, point["ratio_output_throughput"], point["ratio_itl_p99"],
                       ", ".join(shown(x) for x in point["ratio_itl_p99_per_round"])))
    setup = (f"{r['client']}; random prompts of {r['input_tokens']} tokens, "
             f"{r['output_tokens']} out, {r['rounds']} rounds")
    return "\n\n".join([
        provenance("vllmclient", r, setup),
        table(["streams", "server", "output tokens/s", "TTFT p50 ms", "TTFT p99 ms",
               "ITL p50 ms", "ITL p99 ms", "failed", "each run: tokens/s / ITL p99 ms"], rows),
        table(["streams", "output tokens/s, modelyard ÷ vllm serve",
               "ITL p99, modelyard ÷ vllm serve", "ITL p99 ratio, each round"], ratios)])


def leaves(value: Any, path: str = "") -> Iterable[tuple[str, Any]]:
    """Every figure of a results file under ``value``, by its path in the JSON."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from leaves(inner, f"{path}.{key}" if path else key)
    else:
        yield path, value


def gpu_park_probe(r: Result) -> str:
    """The probe's sizes as columns, each figure a row; the rest as ``flat`` lists it."""
    def cell(value: Any) -> str:
        return ", ".join(shown(v) for v in value) if isinstance(value, list) else shown(value)

    sizes = r["sizes"]
    columns = {name: dict(leaves(size, "")) for name, size in sizes.items()}
    paths = list(dict.fromkeys(p for one in columns.values() for p in one))
    rows = [(f"`{p}`", *(cell(columns[n].get(p, "")) for n in sizes)) for p in paths]
    skip = {"benchmark", "when", "commit", "machine", "sizes"}
    rest = [(f"`{p}`", cell(v)) for p, v in leaves(
        {k: v for k, v in r.items() if k not in skip}, "")
        if not (p.startswith("index_agreement.devices"))]
    devices = [(d["index"], d["cuda_name"], d["nvml_name"], cell(d["cuda_pci"]),
                cell(d["nvml_pci"]), shown(d["agree"]))
               for d in r["index_agreement"]["devices"]]
    m = r.get("machine", {})
    setup = f"{m.get('gpu', '')}, torch {m.get('torch', '')}, {m.get('cpus', '')} CPUs"
    return "\n\n".join([
        provenance("gpu_park_probe", r, setup),
        table(["figure", *sizes], rows),
        table(["index", "CUDA's name", "NVML's name", "CUDA's PCI", "NVML's PCI", "agree"],
              devices),
        table(["figure", "value"], rest)])


def relay(r: Result) -> str:
    rows = []
    for kind, load in (("stream", "streamed chunks/s"), ("requests", "non-streaming requests/s")):
        for conns in (1, 16, 64):
            p = r[f"{kind}_{conns}"]
            rows.append((load, conns, p["router_per_s"], p["bare_per_s"], p["share_of_bare"],
                         p["shares"], p["router_errors"]))
    latency = [(n, r[f"added_latency_{n}"]) for n in (1, 16)]
    setup = (f"{r['tokens_per_stream']} tokens a stream, {r['seconds_per_point']} s a point; "
             f"router on core {r['router_cpu']}, synthetic engine and load on core "
             f"{r['load_cpu']}; with an API key: {shown(r['api_key'])}; router tree "
             f"`{r['tree']}`")
    return "\n\n".join([
        provenance("relay", r, setup),
        table(["load", "connections", "modelyard", "bare framework", "share",
               "share per round", "errors"], rows),
        table(["streams", "added p50 ms", "router p50 ms", "router p99 ms", "bare p50 ms",
               "bare p99 ms", "samples"],
              [(n, x["p50_ms"], x["router_p50_ms"], x["router_p99_ms"], x["bare_p50_ms"],
                x["bare_p99_ms"], x["samples"]) for n, x in latency]),
        (f"A 200-byte CURVE ZeroMQ round trip between the two cores: "
        f"{shown(r['zmq_round_trip_us'])} µs; with it, the most one connection could reach "
        f"with no Python work at all: {shown(r['one_connection_ceiling'])} of the bare app."),
        "Where the router's core went (py-spy, the functions with the largest share):",
        table(["function", "share"],
              [(f"`{p['function']}`", p["share"]) for p in r["router_profile"]])])


def coldstart(r: Result) -> str:
    keys = [("vllm_start_to_first_token_s", "`vllm serve` start → first token, s"),
            ("modelyard_cold_first_token_s", "modelyard, never-loaded model → first token, s"),
            ("modelyard_worker_load_s", "modelyard's worker load, s"),
            ("modelyard_after_reap_first_token_s",
             "modelyard after an idle reap → first token, s")]
    return "\n\n".join([
        provenance("coldstart", r),
        table(["", "runs"], [(label, r[key]) for key, label in keys]),
        table(["ratio to `vllm serve`", ""],
              [("cold", r["ratio_cold_vs_vllm"]),
               ("after a reap", r["ratio_after_reap_vs_vllm"])])])


def scaling(r: Result) -> str:
    points = sorted((int(k.split("_")[1]), v) for k, v in r.items() if k.startswith("streams_"))
    return "\n\n".join([
        provenance("scaling", r, f"{r['tokens_per_stream']} tokens a stream, through modelyard"),
        table(["streams", "tokens/s", "speed-up", "TTFT p50 ms", "ITL p50 ms", "errors"],
              [(n, p["tokens_per_s"], p["speedup"], p["ttft_p50_ms"], p["itl_p50_ms"],
                p["errors"]) for n, p in points])])


def faults(r: Result) -> str:
    d, h, s = r["disconnect_20_percent"], r["huge_prompt"], r["router_signals"]

    def pair(key: str) -> str:
        before, after = d[key]
        return f"{shown(before)} → {shown(after)}"

    rows: list[tuple[str, Any]] = []
    for key, worker in (("kill9_synthetic", "a synthetic"), ("kill9_real_vllm", "a vLLM")):
        k = r[key]
        killed = (f"kill -9 of {worker} worker mid-stream: clients with a terminal error "
                  "within 2 s (worst, s)")
        errors = f"{k['clients_terminal_error_within_2s']} ({shown(k['worst_seconds_to_error'])})"
        rows += [(killed, errors),
                 ("… next request succeeded (the worker restarted)", k["next_request_succeeded"])]
    disconnects = (f"{shown(d['requests'])} streamed requests, {shown(d['disconnected'])} "
                   f"clients disconnecting mid-stream, {shown(d['completed'])} completed: "
                   "in flight afterwards")
    in_flight = (f"engine {shown(d['engine_in_flight_after'])}, "
                 f"router {shown(d['router_in_flight_after'])}")
    huge = (f"a 30 MiB prompt beside a vLLM stream, {shown(h['rounds'])} times: refused by "
            "the router (never sent to the worker)")
    gaps = (f"… the neighbour stream's longest gap meanwhile, s (target < "
            f"{shown(h['target_longest_gap_s'])}; its median gap {shown(h['median_gap_s'])} s)")
    rows += [
        (disconnects, in_flight),
        ("… router file descriptors / asyncio tasks, before → after",
         f"{pair('router_fds_before_after')} / {pair('router_tasks_before_after')}"),
        ("router SIGTERM: worker and EngineCore processes", s["SIGTERM"]),
        ("router SIGKILL: worker and EngineCore processes", s["SIGKILL"]),
        (huge, h["refused_by_router"]),
        (gaps, h["longest_gap_during_refusal_s"]),
    ]
    return "\n\n".join([provenance("faults", r), table(["fault", "outcome"], rows)])


def per_model(run: Result) -> str:
    """A closed-loop run's requests by model: ``swap-a 86, swap-b 94``."""
    return ", ".join(f"{m} {shown(n)}" for m, n in run["per_model"].items())


def swap(r: Result) -> str:
    phases = ["spare", "imports", "model_files", "engine", "weights", "kv_cache_and_warmup"]
    alone, two = r["one_client_alone_60s"], r["two_clients_two_models_150s"]
    mem = r["memory_ceiling"]
    return "\n\n".join([
        provenance("swap", r),
        table(["", "seconds"], [
            ("`vllm serve` start → first token", r["vllm_start_to_first_token_s"]),
            ("modelyard, never-loaded model → first token (a spare ready)",
             r["modelyard_cold_first_token_s"]),
            ("ratio", r["ratio_cold_vs_vllm"])]),
        ("The cold start's load phases (`load_phases`, seconds; weights and KV cache + "
        "warm-up are inside engine):"),
        table(phases, [tuple(r["cold_load_phases_s"].get(k, "") for k in phases)]),
        ("Two models on the same two cores, `max_loaded_models: 1`, parking on: closed-loop "
        "clients (16-token completions) and single requests:"),
        table(["", "value", "target"], [
            ("one client alone, 60 s: requests/s", alone["requests_per_s"], ""),
            ("… requests, longest wait s, median s",
             (f"{alone['requests']} ({per_model(alone)}), {alone['longest_wait_s']}, "
             f"{alone['median_s']}"), ""),
            ("two clients, one per model, 150 s: requests/s", two["requests_per_s"], ""),
            ("… requests, median s", f"{two['requests']}, {two['median_s']}", ""),
            ("… ratio to one client alone", two["ratio_vs_alone"], ">= 0.8"),
            ("… loads after the first two (whole run)", r["loads_after_the_first_two"], "0"),
            ("… longest wait, s", two["longest_wait_s"], "<= 5"),
            ("… per model", per_model(two), ""),
            ("single requests on one model: median s", r["singles_one_model_median_s"], ""),
            ("single requests alternating between the two: median s (difference)",
             f"{r['singles_alternating_median_s']} ({r['alternating_minus_one_model_s']:+})",
             "<= one model's + 0.1"),
            ("parks / wakes by model",
             ", ".join(f"{m} {o['parks']} / {o['wakes']}" for m, o in r["parks_wakes"].items()),
             ""),
            (f"wake of a parked model ({r['wakes']} wakes): p50 / p99 / max s",
             f"{r['wake_p50_s']} / {r['wake_p99_s']} / {r['wake_max_s']}", "p99 <= 0.1"),
            # a run before the wake events had ``waited`` has no such row
            *([("… its requests' whole wait, room included: p50 / p99 / max s",
                f"{r['wake_wait_p50_s']} / {r['wake_wait_p99_s']} / {r['wake_wait_max_s']}",
                "")] if "wake_wait_p50_s" in r else [])]),
        (f"Three models in a memory ceiling that holds two (`park_memory_gib` "
        f"{mem['park_memory_gib']}: 1.5x one worker's {shown(r['resident_mib_per_worker'])} "
        "MiB):"),
        table(["", "value", "target"], [
            ("states after the third model's first request",
             ", ".join(f"{m} {s}" for m, s in mem["states_after_third"].items()),
             "one stopped"),
            ("a start with a spare ready, s", mem["start_with_ready_spare_s"], ""),
            ("the stopped one's start right after that load, s",
             mem["start_right_after_a_load_s"], ""),
            ("… ratio", mem["ratio_right_after_vs_ready_spare"], "<= 1.5")])])


def ledger(r: Result) -> str:
    u, q, k = r["per_request_us"], r["query"], r["kill_9"]
    return "\n\n".join([
        provenance("ledger", r),
        table(["per request", "µs"], [
            ("admission with a key (`KeyGuard`, `RateLimit`, the access table)",
             u["admission_with_key"]),
            ("queueing a ledger row", u["ledger_record"]), ("both", u["total"]),
            ("a key with a budget: its hold, row and settle",
             u["with_a_budget_reserve_record_settle"])]),
        table(["usage query (SQLite)", ""], [
            ("rows", q["rows"]), ("inserting them, s", q["insert_seconds"]),
            ("one key's month summed per model and day, ms", q["one_key_month_by_model_day_ms"]),
            ("groups in the answer", q["groups"])]),
        table(["kill -9 of the router under load", ""], [
            ("requests answered", k["answered"]), ("rows written", k["rows"]),
            ("rows lost", k["lost"]), ("requests/s", k["requests_per_s"]),
            ("seconds of rows lost", k["lost_seconds"])])])


def toolcalls(r: Result) -> str:
    rows = [(server, v["call"], v["text"], v["broken"], v["requests"],
             v["completion_tokens_mean"], v["completion_tokens_max"], v["seconds_mean"])
            for server, v in r["runs"].items()]
    setup = (f"{r['requests_each']} requests each, max_tokens {r['max_tokens']}, "
             f"asking in turn: {' / '.join(repr(q) for q in r['questions'])}")
    return "\n\n".join([
        provenance("toolcalls", r, setup),
        table(["server", "valid calls", "text answers", "broken", "requests",
               "completion tokens, mean", "max", "seconds, mean"], rows)])


def lora(r: Result) -> str:
    runs = [("base, engine without LoRA", "base_no_lora_16", "base_no_lora_1"),
            ("base, on the LoRA engine", "base_on_lora_engine_16", "base_on_lora_engine_1"),
            ("8 rank-8 adapters (1 stream: one of them)", "adapters_16_over_8", "adapter_1")]
    first, alt = r["first_use"], r["alternating"]
    return "\n\n".join([
        provenance("lora", r, "streamed completions of 64 tokens (`ignore_eos`), two per "
                   "stream, after a warm-up round; the adapters made by peft from random "
                   "weights"),
        table(["served", "16 streams, tokens/s", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms",
               "1 stream, tokens/s", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms"],
              [(name, *(r[run][k] for run in (many, one) for k in
                        ("tokens_per_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms")))
               for name, many, one in runs]),
        table(["ratio", ""], [
            ("16 streams over 8 adapters / base without LoRA (target >= 0.7)",
             r["ratio_adapters_vs_base_16"]),
            ("16 streams of the base on the LoRA engine / without",
             r["ratio_base_on_lora_engine_vs_base_16"]),
            ("1 stream of an adapter / base without LoRA", r["ratio_adapter_vs_base_1"])]),
        table(["first use of a rank-8 adapter", ""], [
            ("load (check + into the engine), s", first["load_s"]),
            ("median, s (target <= 1)", first["load_s_median"]),
            ("first request's time to first token, ms", first["first_ttft_ms"]),
            ("the next request's, ms", first["next_ttft_ms"]),
            ("added by the load (median), ms", first["added_ttft_ms_median"])]),
        table(["alternating under max_loaded_models: 1", "requests", "completed", "loads",
               "p50 s", "total s"],
              [(name, v["requests"], v["completed"], v["loads"], v["p50_s"], v["total_s"])
               for name, v in (("two adapters of one base", alt["two_adapters"]),
                               ("two full models", alt["two_full_models"]))])])


def batch(r: Result) -> str:
    if "reps" not in r:
        return batch_one_run(r)
    reps = r["reps"]
    people = [(f"{n}: {name}", v[key]) for n, v in enumerate(reps, 1)
              for name, key in (("alone", "person_alone"),
                                ("beside the batch", "person_beside_batch"))]
    runs = [(f"{n}: the batch, beside the person", v["batch_beside_person"])
            for n, v in enumerate(reps, 1)]
    runs += [("the batch alone", r["batch_alone"]),
             ("the same lines from a client, 16 at once", r["client_16"])]

    def spread(ratio: dict[str, Any]) -> str:
        return f"{shown(ratio['median'])} ({shown(ratio['min'])} to {shown(ratio['max'])})"

    return "\n\n".join([
        provenance("batch", r, f"{r['lines']} chat lines of {r['tokens_per_line']} tokens "
                   f"(`ignore_eos`) on the loaded model; the person: one streamed chat of "
                   f"{r['chat_tokens']} tokens a second, {r['chats_per_phase']} alone and "
                   f"{r['chats_per_phase']} beside the batch, {r['repetitions']} times"),
        table(["repetition: a person's chats", "chats", "errors", "TTFT p50 ms",
               "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"],
              [(name, v["chats"], v["errors"], v["ttft_p50_ms"], v["ttft_p99_ms"],
                v["itl_p50_ms"], v["itl_p99_ms"]) for name, v in people]),
        table(["repetition", "TTFT p99 beside / alone", "ITL p99 beside / alone"],
              [(n, v["ratio_ttft_p99"], v["ratio_itl_p99"]) for n, v in enumerate(reps, 1)]),
        table(["lines", "status", "done", "failed", "seconds", "lines/s"],
              [(name, v.get("status", "-"), v["lines"], v["failed"], v["seconds"],
                v["lines_per_s"]) for name, v in runs]),
        table(["ratio", "median (min to max)"], [
            ("person's TTFT p99 beside the batch / alone (target <= 1.5)",
             spread(r["ratio_ttft_p99"])),
            ("person's inter-token p99 beside the batch / alone (target <= 1.5)",
             spread(r["ratio_itl_p99"])),
            ("the batch alone / a client at concurrency 16 (target >= 0.8)",
             r["ratio_batch_vs_client_16"])])])


def batch_one_run(r: Result) -> str:
    """A results file of ``bench/batch.py`` before it repeated (one person alone, one
    beside the batch)."""
    people = [("alone", r["person_alone"]), ("beside the batch", r["person_beside_batch"])]
    runs = [("the batch, beside the person", r["batch_beside_person"]),
            ("the batch alone", r["batch_alone"]),
            ("the same lines from a client, 16 at once", r["client_16"])]
    return "\n\n".join([
        provenance("batch", r, f"{r['lines']} chat lines of {r['tokens_per_line']} tokens "
                   f"(`ignore_eos`) on the loaded model; the person: one streamed chat of "
                   f"{r['chat_tokens']} tokens a second"),
        table(["a person's chats", "chats", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
               "ITL p99 ms"],
              [(name, v["chats"], v["ttft_p50_ms"], v["ttft_p99_ms"], v["itl_p50_ms"],
                v["itl_p99_ms"]) for name, v in people]),
        table(["lines", "status", "done", "failed", "seconds", "lines/s"],
              [(name, v.get("status", "-"), v["lines"], v["failed"], v["seconds"],
                v["lines_per_s"])
               for name, v in runs]),
        table(["ratio", ""], [
            ("person's TTFT p99 beside the batch / alone (target <= 1.5)",
             r["ratio_ttft_p99"]),
            ("person's inter-token p99 beside the batch / alone (target <= 1.5)",
             r["ratio_itl_p99"]),
            ("the batch alone / a client at concurrency 16 (target >= 0.8)",
             r["ratio_batch_vs_client_16"])])])


def replicas(r: Result) -> str:
    """``bench/replicas.py``: each router's repetitions, their medians, the targets' ratios,
    the 16-stream throughput and the routing decision's cost."""
    def spread(s: Result) -> str:
        return f"{shown(s['median'])} ({shown(s['min'])} to {shown(s['max'])})"

    h, configs, t, d = r["host"], r["configs"], r["throughput"], r["route_decision"]
    cpu = (f"AVX-512 {'with' if h['avx512_bf16'] else 'without'} BF16" if h["avx512"]
           else "no AVX-512")
    setup = (f"{r['sessions']} chat sessions at once x {r['turns']} turns, a shared system "
             f"prompt of about {r['system_chars']} characters, user turns of {r['user_chars']}, "
             f"answers of {r['answer_tokens']} tokens (`ignore_eos`), `x-session-id` sent: "
             f"{shown(r['session_header'])}; {r['repetitions']} repetitions, each router "
             f"started afresh; model `{r['model']}` ({r['engine']}, dtype {h['dtype']}) on "
             f"cores {r['cores']}; {cpu} (`avx512`: {shown(h['avx512'])}, `avx512_bf16`: "
             f"{shown(h['avx512_bf16'])})")
    reps = [(n, c["label"], v["order"], v["start_s"],
             f"{shown(v['replicas_ready'])} / {shown(v['distinct_pids'])}", v["requests"],
             v["errors"], v["prompt_tokens"], v["cached_tokens"], v["cache_share"],
             v["ttft_p50_ms"], v["ttft_p90_ms"], v["in_flight_max"], v["in_flight_share"])
            for c in configs.values() for n, v in enumerate(c["reps"], 1)]
    summary = [(c["label"], c["replicas"], c["routing"], spread(c["cache_share"]),
                spread(c["ttft_p50_ms"]), spread(c["ttft_p90_ms"]), c["errors"])
               for c in configs.values()]
    named = {"cache_share_prefix_vs_one_worker": "cache share, (b) / (a)",
             "ttft_p50_prefix_vs_round_robin": "TTFT p50, (b) / (c)"}
    ratios = [(named.get(k, k), v["per_rep"], spread(v), v["target"], v["met"])
              for k, v in r["ratios"].items()]
    served = {"one_replica_two_cores": "one replica on two cores",
              "two_replicas_one_core_each": "two replicas on one core each"}
    rounds = [(served.get(k, k), n, x["tokens_per_s"], x["ttft_p50_ms"], x["itl_p50_ms"],
               x["itl_p99_ms"], x["errors"], x["in_flight_max"], x["in_flight_share"])
              for k in served if k in t for n, x in enumerate(t[k]["rounds"], 1)]
    streams = [(served.get(k, k), spread(t[k]["tokens_per_s"]), spread(t[k]["itl_p99_ms"]))
               for k in served if k in t]
    streams += [(("two replicas / one replica, each round: "
                 f"tokens/s {shown(t['ratio_tokens_per_s']['per_rep'])}, "
                 f"ITL p99 {shown(t['ratio_itl_p99']['per_rep'])}"),
                 spread(t["ratio_tokens_per_s"]), spread(t["ratio_itl_p99"]))]
    decision = [(f"`{k}`", v) for k, v in d.items()]
    return "\n\n".join([
        provenance("replicas", r, setup),
        table(["configuration", "replicas", "routing", "cache share, median (min to max)",
               "TTFT p50 ms", "TTFT p90 ms", "errors"], summary),
        table(["ratio", "each repetition", "median (min to max)", "target", "met"], ratios),
        table(["repetition", "configuration", "started", "start s", "replicas ready / pids",
               "requests", "errors", "prompt tokens", "cached tokens", "cache share",
               "TTFT p50 ms", "TTFT p90 ms", "most in flight, per replica",
               "share of in flight, per replica"], reps),
        (f"{shown(t['streams'])} streamed completions at once, {shown(t['tokens'])} tokens "
         "each (`ignore_eos`), each its own prompt, on routers (a) and (b) after their "
         "workload, one round a repetition:"),
        table(["served", "round", "tokens/s", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms",
               "errors", "most in flight, per replica", "share of in flight, per replica"],
              rounds),
        table(["served", "tokens/s, median (min to max)", "ITL p99 ms, median (min to max)"],
              streams),
        ("The routing decision (`bench/route_cost.py`'s measure, in-process, before any "
        "router started):"),
        table(["figure", "value"], decision)])


def flat(name: str, r: Result) -> str:
    """A results file with no table of its own: every figure, by its path in the JSON."""
    skip = {"benchmark", "when", "commit", "machine"}
    rows = [(f"`{p}`", v) for p, v in leaves({k: v for k, v in r.items() if k not in skip}, "")]
    return "\n\n".join([provenance(name, r), table(["figure", "value"], rows)])


TABLES: dict[str, Callable[[Result], str]] = {
    "overhead": overhead, "vllmclient": vllmclient, "gpu_park_probe": gpu_park_probe, "relay": relay, "coldstart": coldstart, "scaling": scaling,
    "faults": faults, "swap": swap, "ledger": ledger, "toolcalls": toolcalls, "lora": lora,
    "batch": batch, "replicas": replicas}


def block(name: str, results: Path = RESULTS) -> str:
    """The Markdown that stands between ``name``'s markers."""
    path = results / f"{name}.json"
    if not path.exists():
        return f"*No `bench/results/{name}.json` yet: `make bench BENCH={name}` writes it.*"
    result: Result = json.loads(path.read_text())
    made = TABLES.get(name)
    return made(result) if made else flat(name, result)


def fill(page: str, results: Path = RESULTS) -> str:
    """``page`` with every ``<!-- bench:NAME:... -->`` block made anew from ``results``."""
    def made(match: re.Match[str]) -> str:
        name = match["name"]
        return (f"<!-- bench:{name}:start -->\n{block(name, results)}\n"
                f"<!-- bench:{name}:end -->")

    return MARKER.sub(made, page)


def names_on(page: str) -> list[str]:
    return [m["name"] for m in MARKER.finditer(page)]


def write(page: Path = PAGE, results: Path = RESULTS) -> bool:
    """Rewrite the page's blocks in place; whether anything changed."""
    before = page.read_text()
    after = fill(before, results)
    if after != before:
        page.write_text(after)
    return after != before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*",
                        help="benchmarks to print (default: every results file)")
    parser.add_argument("--write", action="store_true", help=f"rewrite {PAGE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if args.write:
        changed = write()
        print(f"{PAGE.relative_to(ROOT)}: {'rewritten' if changed else 'already up to date'}")
        return 0
    for name in args.names or sorted(p.stem for p in RESULTS.glob("*.json")):
        print(f"## {name}\n\n{block(name)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
