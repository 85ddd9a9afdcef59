"""``Metrics``: the router's Prometheus metrics, in a ``CollectorRegistry`` of its own.

Request metrics are counted once per request, where the relay writes its log line
(``Relay._log``), and for requests refused before the relay (a body that does not
decode) by the route wrapper in ``router.api.metrics``; ``current_request`` tells the
wrapper whether the relay already counted its request. The per-model gauges (state, in
flight, queued, load seconds, restarts, evictions) are read from the ``ModelRegistry``
at scrape time, so the supervisor keeps no gauges of its own.

Every series is labelled with a model id the preset declares, or ``-`` for a request
that named no model the router knows: a client cannot grow the label set.

Batch metrics: the lines the batch runner finished, by state, counted as each finishes
(``Metrics.batch_lines``); the batches this router runs, by status, and their lines still
pending, read at scrape time from the runner (``Metrics.watch_batches``). Per-key series
(``key`` label: the name of the key that asked or owns the batch) are only shown as
``router.api.metrics.MetricsAPI.seen_by`` allows.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from router.errors import APIError
from router.registry import ModelEntry, ModelRegistry
from router.workers.link import Usage, WorkerLink

STATES = ("unloaded", "loading", "ready", "sleeping", "parking", "parked", "waking",
          "stopping", "failed")
SWITCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                  60.0)
"""Seconds of a park (engine paused, processes stopped), a wake (to serving again) or a
wake's whole wait (``wake_wait``: its requests' wait for room included). Past 5 s: a GPU
model's level-2 wake (11 s for 8B on an H200) and first level-1 park (14 s, pinning), and
waits for the other model's work to end."""
UNKNOWN_MODEL = "-"
# Seconds; CPU workers answer in seconds to minutes, GPU workers in milliseconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                160.0, 320.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5,
               1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
               640.0, 1280.0)
QUANTILES = (0.5, 0.9, 0.99)
BATCH_LINE_STATES = ("succeeded", "errored", "canceled", "expired")
"""What a batch's line ends as (``router.batches.store.LINE_STATES``)."""
BATCH_ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
"""The statuses of a batch a runner still holds (``router.batches.store.ACTIVE``)."""

ActiveBatch = tuple[str, str, int]
"""A batch a runner holds now: its status, its owner (a key's name, ``""`` with no keys)
and its lines still pending."""


class RequestMark:
    """Whether the request being served has been counted; see ``current_request``."""

    __slots__ = ("counted",)

    def __init__(self) -> None:
        self.counted = False


current_request: ContextVar[RequestMark | None] = ContextVar("modelyard_request",
                                                             default=None)
"""Set by the route wrapper for the request its task serves; ``Metrics.request`` marks it."""


class ReplicaFigures(Protocol):
    """What the metrics read of a running replica (``router.lifecycle.replica.Replica``)."""

    @property
    def number(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def link(self) -> WorkerLink: ...


class _ModelCollector:
    """The per-model gauges, read from the registry's entries at each scrape."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models
        self.switches: dict[tuple[str, str], _Histogram] = {}
        """Per model and kind (``park``, ``wake``, ``wake_wait``): how long each took."""
        self.replicas: Callable[[ModelEntry], Iterable[ReplicaFigures]] | None = None
        """A model's running replicas (the supervisor's ``replicas_of``): per-replica
        series for the models that may run several."""

    def collect(self) -> Iterator[Metric]:
        switches = HistogramMetricFamily(
            "modelyard_model_switch_seconds", "How long a park (its engine paused between "
            "steps, its processes stopped) or a wake (to serving again) of the model took; "
            "wake_wait: from a wake's first waiting request to serving, its wait for room "
            "included",
            labels=["model", "kind"])
        for (model, kind), histogram in self.switches.items():
            switches.add_metric([model, kind], histogram.cumulative(), histogram.sum)
        parked = GaugeMetricFamily("modelyard_model_parked_seconds", "How long the model "
                                   "has been parked (holding memory and no core)",
                                   labels=["model"])
        now = time.monotonic()
        for entry in self.models:
            if entry.state == "parked":
                parked.add_metric([entry.id], round(now - entry.parked_at, 3))
        yield from (switches, parked)
        state = GaugeMetricFamily("modelyard_model_state",
                                  "1 for the state the model is in, 0 for the others",
                                  labels=["model", "state"])
        in_flight = GaugeMetricFamily("modelyard_model_in_flight", "Requests holding the "
                                      "model (waiting for it or being served)", labels=["model"])
        queued = GaugeMetricFamily("modelyard_model_queued",
                                   "Requests waiting for the model to load, wake or find room",
                                   labels=["model"])
        load = GaugeMetricFamily("modelyard_model_load_seconds",
                                 "How long the model's last successful start took",
                                 labels=["model"])
        restarts = CounterMetricFamily("modelyard_model_restarts",
                                       "Starts after a crash or a failed start", labels=["model"])
        evictions = CounterMetricFamily("modelyard_model_evictions",
                                        "Stops to make room for another model", labels=["model"])
        engine = GaugeMetricFamily("modelyard_model_engine_in_flight", "Requests the engine "
                                   "itself still holds (vLLM's own count, read at the scrape)",
                                   labels=["model"])
        for entry in self.models:
            for name in STATES:
                state.add_metric([entry.id, name], 1.0 if entry.state == name else 0.0)
            in_flight.add_metric([entry.id], entry.leases)
            queued.add_metric([entry.id], entry.queued)
            if entry.load_seconds is not None:
                load.add_metric([entry.id], entry.load_seconds)
            restarts.add_metric([entry.id], entry.restarts)
            evictions.add_metric([entry.id], entry.evictions)
            if entry.engine_in_flight is not None and entry.state == "ready":
                engine.add_metric([entry.id], entry.engine_in_flight)
        yield from (state, in_flight, queued, load, restarts, evictions, engine)
        yield from self._replica_series()

    def _replica_series(self) -> Iterator[Metric]:
        several = [e for e in self.models if e.spec.replicas.max > 1]
        if self.replicas is None or not several:
            return
        labels = ["model", "replica"]
        count = GaugeMetricFamily("modelyard_model_replicas", "Replicas the model runs, by "
                                  "state", labels=["model", "state"])
        failures = CounterMetricFamily("modelyard_model_replica_failures", "Replicas that "
                                       "failed to start or crashed while another served",
                                       labels=["model"])
        in_flight = GaugeMetricFamily("modelyard_replica_in_flight", "Requests in flight "
                                      "on the replica", labels=labels)
        prompt = CounterMetricFamily("modelyard_replica_prompt_tokens", "Prompt tokens of "
                                     "the requests the replica finished", labels=labels)
        cached = CounterMetricFamily("modelyard_replica_cached_tokens", "Of those, the ones "
                                     "its engine's prefix cache served", labels=labels)
        for entry in several:
            states: dict[str, int] = {"starting": 0, "ready": 0, "draining": 0}
            for r in self.replicas(entry):
                states[r.state] = states.get(r.state, 0) + 1
                number = [entry.id, str(r.number)]
                in_flight.add_metric(number, r.link.in_flight)
                prompt.add_metric(number, r.link.prompt_tokens)
                cached.add_metric(number, r.link.cached_tokens)
            for name, n in states.items():
                count.add_metric([entry.id, name], n)
            failures.add_metric([entry.id], entry.replica_failures)
        yield from (count, failures, in_flight, prompt, cached)


class _BatchCollector:
    """The batch runner's figures: lines finished (counted as they finish) and the
    batches it holds now (``view``, read at each scrape)."""

    def __init__(self) -> None:
        self.lines = dict.fromkeys(BATCH_LINE_STATES, 0)
        self.key_lines: dict[tuple[str, str], int] = {}
        self.view: Callable[[], Iterable[ActiveBatch]] = tuple

    def collect(self) -> Iterator[Metric]:
        lines = CounterMetricFamily("modelyard_batch_lines", "Batch lines finished, by "
                                    "state (a line refused when its batch was made counts "
                                    "as errored then)", labels=["state"])
        for state, n in self.lines.items():
            lines.add_metric([state], n)
        key_lines = CounterMetricFamily("modelyard_key_batch_lines", "Batch lines "
                                        "finished, by the name of the key that owns the "
                                        "batch and state", labels=["key", "state"])
        for (key, state), n in self.key_lines.items():
            key_lines.add_metric([key, state], n)
        batches = GaugeMetricFamily("modelyard_batches", "Batches this router runs now, by "
                                    "status", labels=["status"])
        pending = GaugeMetricFamily("modelyard_batch_lines_pending", "Lines not yet run "
                                    "of the batches this router runs")
        key_pending = GaugeMetricFamily("modelyard_key_batch_lines_pending", "Lines not yet "
                                        "run of the batches this router runs, by the name "
                                        "of the key that owns them", labels=["key"])
        by_status = dict.fromkeys(BATCH_ACTIVE, 0)
        by_key: dict[str, int] = {}
        total = 0
        for status, owner, left in self.view():
            by_status[status] = by_status.get(status, 0) + 1
            total += left
            if owner:
                by_key[owner] = by_key.get(owner, 0) + left
        for status, n in by_status.items():
            batches.add_metric([status], n)
        pending.add_metric([], total)
        for key, left in by_key.items():
            key_pending.add_metric([key], left)
        yield from (lines, key_lines, batches, pending, key_pending)


class _Histogram:
    """A histogram's counts and sum, kept as plain numbers (see ``_RequestCollector``)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: a bound is inclusive
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            total += count
            out.append((floatToGoString(bound), float(total)))  # type: ignore[no-untyped-call]
        return out


class _ModelSeries:
    """One model's token counts and per-model latencies."""

    __slots__ = ("cached", "completion", "inter_token", "prompt", "ttft")

    def __init__(self) -> None:
        self.prompt = self.cached = self.completion = 0
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.inter_token = _Histogram(ITL_BUCKETS)


class _RequestCollector:
    """The request metrics, counted as plain numbers and drawn as Prometheus families at
    each scrape: ``prometheus_client``'s own counters and histograms take a lock and a
    Python loop over the buckets per observation, half of counting a request (3.3 µs),
    on the path every request takes. Series are bounded: models are the preset's (or
    ``-``), endpoints and statuses the router's own."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = {}
        self.models: dict[str, _ModelSeries] = {}
        self.e2e: dict[tuple[str, str], _Histogram] = {}
        self.keys: dict[str, list[int]] = {}
        """Per key name (keys only): requests, prompt, cached and completion tokens."""

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("modelyard_requests", "Requests answered, by final "
                                       "status (499: the client left)",
                                       labels=["model", "endpoint", "status"])
        for (model, endpoint, status), n in self.requests.items():
            requests.add_metric([model, endpoint, str(status)], n)
        tokens = {kind: CounterMetricFamily(f"modelyard_{kind}_tokens", doc, labels=["model"])
                  for kind, doc in (("prompt", "Prompt tokens"),
                                    ("cached", "Prompt tokens served from the prefix cache"),
                                    ("completion", "Generated tokens"))}
        ttft = HistogramMetricFamily(
            "modelyard_time_to_first_token_seconds", "From the request's arrival at the "
            "relay to its first output", labels=["model"])
        inter_token = HistogramMetricFamily(
            "modelyard_inter_token_seconds", "Mean time per output token after the first, "
            "per choice; one observation per successful request", labels=["model"])
        for model, series in self.models.items():
            tokens["prompt"].add_metric([model], series.prompt)
            tokens["cached"].add_metric([model], series.cached)
            tokens["completion"].add_metric([model], series.completion)
            for family, histogram in ((ttft, series.ttft), (inter_token, series.inter_token)):
                family.add_metric([model], histogram.cumulative(), histogram.sum)
        e2e = HistogramMetricFamily(
            "modelyard_request_seconds", "From the request's arrival at the relay to its "
            "last byte, successful requests", labels=["model", "endpoint"])
        for (model, endpoint), histogram in self.e2e.items():
            e2e.add_metric([model, endpoint], histogram.cumulative(), histogram.sum)
        by_key = CounterMetricFamily("modelyard_key_requests", "Requests answered, by the "
                                     "name of the key that asked", labels=["key"])
        key_tokens = CounterMetricFamily("modelyard_key_tokens", "Tokens, by the name of the "
                                         "key that asked and kind (prompt, cached, "
                                         "completion)", labels=["key", "kind"])
        for key, (n, prompt, cached, completion) in self.keys.items():
            by_key.add_metric([key], n)
            for kind, count in (("prompt", prompt), ("cached", cached),
                                ("completion", completion)):
                key_tokens.add_metric([key, kind], count)
        yield from (requests, *tokens.values(), ttft, inter_token, e2e, by_key, key_tokens)


class Metrics:
    """Request counters and latency histograms plus the per-model gauges, in ``registry``."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models
        self.registry = CollectorRegistry()
        self._counts = _RequestCollector()
        self.registry.register(self._counts)
        self._models = _ModelCollector(models)
        self.registry.register(self._models)
        self._batches = _BatchCollector()
        self.registry.register(self._batches)

    def batch_lines(self, owner: str, state: str, count: int = 1) -> None:
        """Count ``count`` lines of ``owner``'s batch finished as ``state``."""
        batches = self._batches
        batches.lines[state] = batches.lines.get(state, 0) + count
        if owner:  # no keys: one user, no per-key series (as requests)
            batches.key_lines[owner, state] = batches.key_lines.get((owner, state), 0) + count

    def watch_replicas(self, replicas: Callable[[ModelEntry], Iterable[ReplicaFigures]]
                       ) -> None:
        """Read a model's running replicas from ``replicas`` at each scrape."""
        self._models.replicas = replicas

    def switch(self, model: str, kind: str, seconds: float) -> None:
        """Count a ``park``, ``wake`` or ``wake_wait`` of ``model`` that took ``seconds``."""
        histogram = self._models.switches.get((model, kind))
        if histogram is None:
            histogram = self._models.switches[model, kind] = _Histogram(SWITCH_BUCKETS)
        histogram.observe(seconds)

    def watch_batches(self, view: Callable[[], Iterable[ActiveBatch]]) -> None:
        """Read the batches a runner holds from ``view`` at each scrape."""
        self._batches.view = view

    def label(self, model: str) -> str:
        """The model id for ``model`` as a request named it, or ``-`` if none fits."""
        if model in self.models.entries or model in self.models.adapters:
            return model  # the relay passes the id for every request that got a lease
        if model == UNKNOWN_MODEL:
            return model
        try:
            return self.models.resolve(model).id
        except APIError:  # unknown or ambiguous: one label for all, whatever was asked
            return UNKNOWN_MODEL

    def request(self, endpoint: str, model: str, status: int, usage: Usage | None = None,
                now: float = 0.0) -> None:
        """Count one finished request; ``now`` (``perf_counter``) is when it ended."""
        mark = current_request.get()
        if mark is not None:
            mark.counted = True
        model = self.label(model)
        counts = self._counts
        key = (model, endpoint, status)
        counts.requests[key] = counts.requests.get(key, 0) + 1
        if usage is not None and usage.key:
            per_key = counts.keys.get(usage.key)
            if per_key is None:
                per_key = counts.keys[usage.key] = [0, 0, 0, 0]
            per_key[0] += 1
            if usage.completion or usage.prompt:
                per_key[1] += usage.prompt_tokens
                per_key[2] += usage.cached_tokens
                per_key[3] += usage.completion
        if usage is None or not (status == 200 or usage.first_at):
            return  # nothing was generated: no tokens, no latencies
        series = counts.models.get(model)
        if series is None:
            series = counts.models[model] = _ModelSeries()
        if usage.completion or usage.prompt:
            series.prompt += usage.prompt_tokens
            series.cached += usage.cached_tokens
            series.completion += usage.completion
        if usage.first_at:
            series.ttft.observe(usage.first_at - usage.started)
        if status != 200:
            return
        now = now or time.perf_counter()
        e2e = counts.e2e.get((model, endpoint))
        if e2e is None:
            e2e = counts.e2e[model, endpoint] = _Histogram(E2E_BUCKETS)
        e2e.observe(now - usage.started)
        per_choice = usage.completion / max(1, len(usage.finish))
        if usage.first_at and per_choice > 1:
            series.inter_token.observe((now - usage.first_at) / (per_choice - 1))

    def snapshot(self) -> dict[str, Any]:
        """The same figures as JSON, per model: ``GET /v1/metrics``."""
        return snapshot(self.registry.collect())


def snapshot(families: Iterable[Metric]) -> dict[str, Any]:
    """Per-model JSON from collected (or parsed) metric families of a ``Metrics``."""
    models: dict[str, dict[str, Any]] = {}

    def model(name: str) -> dict[str, Any]:
        return models.setdefault(name, {"requests": {}, "tokens": {"prompt": 0, "cached": 0,
                                                                     "completion": 0}})

    histograms: dict[tuple[str, ...], _Buckets] = {}
    for family in families:
        key = family.name.removeprefix("modelyard_")
        for s in family.samples:
            name = s.labels.get("model")
            if name is None or s.name.endswith("_created"):
                continue
            entry = model(name)
            if key == "requests":
                by_status = entry["requests"].setdefault(s.labels["endpoint"], {})
                by_status[s.labels["status"]] = int(s.value)
            elif key.endswith("_tokens"):
                entry["tokens"][key.removesuffix("_tokens")] = int(s.value)
            elif key == "model_state":
                if s.value:
                    entry["state"] = s.labels["state"]
            elif key.startswith("model_"):
                field = key.removeprefix("model_")
                entry[field] = int(s.value) if field != "load_seconds" else s.value
            elif family.type == "histogram":
                where = (key, name, s.labels.get("endpoint", ""))
                histograms.setdefault(where, _Buckets()).add(s.name, s.labels, s.value)
    for (key, name, endpoint), buckets in sorted(histograms.items()):
        figures = model(name)
        if endpoint:
            figures = figures.setdefault(key, {})
            key = endpoint
        figures[key] = buckets.summary()
    return {"object": "metrics", "models": models}


class _Buckets:
    """One histogram series gathered from its samples: count, sum and quantiles."""

    def __init__(self) -> None:
        self.count = 0.0
        self.sum = 0.0
        self.bounds: list[tuple[float, float]] = []  # (upper bound, cumulative count)

    def add(self, sample: str, labels: dict[str, str], value: float) -> None:
        if sample.endswith("_bucket"):
            self.bounds.append((float(labels["le"]), value))
        elif sample.endswith("_count"):
            self.count = value
        elif sample.endswith("_sum"):
            self.sum = value

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"count": int(self.count), "sum": round(self.sum, 6),
                               "avg": round(self.sum / self.count, 6) if self.count else None}
        for q in QUANTILES:
            value = quantile(q, sorted(self.bounds))
            out[f"p{round(q * 100)}"] = None if value is None else round(value, 6)
        return out


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile``: interpolated within the bucket holding the
    rank; the highest finite bound when the rank falls in ``+Inf``."""
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower
            if cumulative == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower
