"""Presets: the server settings and the models it may serve — their schema (``ServerConfig``,
``ModelSpec`` and the structs they hold, ``Preset``, ``WorkerBoot``) and the rules read
from it (``auto_tool_calls``, ``restart_needed``, ``sleep_mode`` ...). Reading a preset
file (YAML or INI, environment variables, templates, the checks across models) is
``shared.preset_loader``'s.

Every problem is reported once, at load, as a ``ConfigError`` naming the file, the model
and the key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec


def parse_cores(text: str) -> set[int]:
    """``"0-3,6"`` → ``{0, 1, 2, 3, 6}``."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first > last:
            raise ValueError(f"empty core range {part!r}")
        cores.update(range(first, last + 1))
    return cores


def format_cores(cores: set[int]) -> str:
    """``{0, 1, 2, 6}`` → ``"0-2,6"`` (the form ``VLLM_CPU_OMP_THREADS_BIND`` takes)."""
    runs: list[str] = []
    ordered = sorted(cores)
    start = prev = ordered[0]
    for c in ordered[1:]:
        if c != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = c
        prev = c
    runs.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(runs)


CACHE_VARIABLE = "MODELYARD_CACHE_DIR"
"""Where an unset ``server.cache_dir`` points, when set (the tests' own cache)."""


def default_cache_dir() -> Path:
    """Where ``server.cache_dir`` points when unset: the embedded model's folder (the
    worker's), the default SQLite database and the batches' files (the router's).
    ``$MODELYARD_CACHE_DIR``, else ``modelyard`` in the user's cache (``$XDG_CACHE_HOME``,
    ``~/.cache``)."""
    own = os.environ.get(CACHE_VARIABLE)
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "modelyard"


class ConfigError(ValueError):
    """A preset file is unreadable or invalid; the message names file, model and key."""


MAX_REPLICAS = 32
"""The most replicas one model may ask for (``replicas.max``): a typo such as ``400``
fails at load instead of filling the machine (and a prefix index tells 60 apart, restarts
included: ``PrefixIndex.SLOTS``)."""


class Replicas(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How many workers (replicas) one model runs and when that number moves
    (``router.lifecycle.policy.scale``). ``replicas: N`` in a preset is ``min = max = N``."""

    min: Annotated[int, msgspec.Meta(ge=0)] = 1
    """Replicas kept while the model is loaded; 0: the last one stops after ``idle`` s, and
    the next request loads the model as a cold one."""
    max: Annotated[int, msgspec.Meta(ge=1, le=MAX_REPLICAS)] = 1
    """Replicas the model may run at once; each takes its own share of ``cpu_cores`` and
    ``gpus`` (``router.workers.placement.replica_spec``)."""
    idle: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """Seconds a replica serves nothing before it is removed (while more than ``min``)."""
    up_wait: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """A replica is added when the model's oldest waiting request (batch lines aside) has
    waited this long ..."""
    up_after: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    """... and has kept doing so for this long (a burst that clears by itself adds none)."""
    cooldown: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    """Seconds after one replica was added or removed before the next change: a start
    takes seconds to relieve the queue, and counting again too soon would overshoot."""
    placement: Literal["spread", "pack"] = "spread"
    """Where a ``backend: ray`` model's replicas go among the cluster's nodes: ``spread``,
    each on a node that runs none of its siblings while one has room (losing a node then
    loses only its replicas); ``pack``, beside its lowest-numbered running sibling while
    that node has room (one node's cache and network, fewer nodes held). Ray falls back to
    any node that fits either way (``RayBackend.actor_options``). A local model's
    replicas all run on this host: the key is refused there."""


class Routing(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Which replica of a model serves a request (``router.lifecycle.policy.route``)."""

    strategy: Literal["prefix", "round_robin", "least_loaded"] = "prefix"
    """``prefix``: the replica that already holds the longest part of the prompt (or the
    conversation's), unless it is overloaded against the least loaded one; the others
    are kept to compare with and for loads without shared prefixes."""
    min_prefix_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.3
    """The share of a prompt a replica must hold for ``prefix`` to prefer it."""
    balance_abs: Annotated[int, msgspec.Meta(ge=1)] = 4
    """A replica is overloaded when it has at least this many requests more than the
    least loaded one ..."""
    balance_rel: Annotated[float, msgspec.Meta(ge=1)] = 1.5
    """... and at least this many times its load (SGLang's gateway's two thresholds)."""


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8080
    default_model: str | None = None
    ttl: float = 0.0
    """Default idle time-to-live of a model in seconds; 0 keeps models loaded."""
    max_loaded_models: int = 0
    """0 means no limit. A model that needs room evicts the least recently used idle one."""
    memory_budget_gib: dict[str, float] = {}
    """Per-device budget, keys ``cpu`` or ``cuda:N``; models' ``memory_gib`` must fit."""
    max_queue_depth: int = 64
    """Requests that may wait for one model to load or free up; more get a 429."""
    drain_timeout: float = 30.0
    """Seconds an unload (or router shutdown) waits for in-flight requests."""
    load_timeout: float = 900.0
    """Seconds a model may take to start, and a request waits for it, before a 503."""
    send_timeout: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """Seconds one write of a streamed response may wait for a client that does not read;
    then the request ends (its generation is cancelled and its model freed)."""
    send_buffer_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    """A fixed kernel send buffer per client connection (0: the kernel's autotuning, which
    lets a client that does not read park up to megabytes in the kernel per connection)."""
    runtime_dir: str | None = None
    """Where ZeroMQ sockets and worker logs live; default: a fresh 0700 temp dir."""
    cache_dir: str | None = None
    """Where the embedded model is materialised; default: ~/.cache/modelyard
    (``default_cache_dir``)."""
    database_url: str | None = None
    """Where named keys live: ``sqlite:///PATH`` or ``postgresql://...`` (several routers
    sharing keys); unset: SQLite in the cache dir (``modelyard.db``)."""
    log_level: str = "info"
    max_body_bytes: int = 32 * 1024 * 1024
    """Larger request bodies get a 413."""
    api_keys: list[str] = []
    """When any key is set (here, in ``api_key_file`` or ``MODELYARD_API_KEYS``), every
    endpoint but ``/health`` needs one (``Authorization: Bearer`` or ``x-api-key``)."""
    admin_api_keys: list[str] = []
    """When set, loading and unloading models needs one of these; they open every endpoint."""
    api_key_file: str | None = None
    """A file of keys, one per line (``#`` starts a comment)."""
    auth_failures_per_minute: Annotated[int, msgspec.Meta(ge=0)] = 20
    """Requests with a wrong key one address may send a minute (a token bucket); past it,
    every request from there gets a 429 until the bucket refills. 0: no limit."""
    keep_alive_max: Annotated[float, msgspec.Meta(ge=0)] = 3600.0
    """The longest a request's ``keep_alive`` from a non-admin key keeps its model loaded
    after the request (``-1`` asks for this much; ``0`` asks nothing). Such a key never
    stops or pins a model others use: only an admin key's ``keep_alive`` sets the model's
    idle limit."""
    rate_limit_per_minute: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Requests per minute per client (its API key when keys are set, else its address),
    as a token bucket; more get a 429 with ``Retry-After``. 0: no rate limit."""
    rate_limit_burst: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The bucket's size: requests a client may send at once; 0: ``rate_limit_per_minute``."""
    trusted_proxies: list[str] = []
    """IPs or CIDRs whose ``X-Forwarded-For`` is believed (the right-most address not in
    this set is the client); from any other peer the header is ignored."""
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 1024
    """HTTP requests served at once (``/health`` aside); more get a 503 at once."""
    keep_alive_timeout: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    """Seconds an idle keep-alive connection stays open."""
    read_timeout: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    """Seconds a request's headers, and then its body, may take to arrive; a late body gets
    a 408, and either way the connection is closed. 0: no deadline."""
    responses_store_items: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    """Responses (``/v1/responses`` with ``store``) kept for ``previous_response_id`` and
    ``GET``; the oldest go first. 0: none are kept."""
    responses_store_mib: Annotated[float, msgspec.Meta(ge=0)] = 64.0
    """The stored responses' JSON, at most; the oldest go first."""
    loading_progress: Literal["off", "comments", "reasoning"] = "off"
    """``comments``: a streamed generation request that waits for its model to load gets
    SSE comment lines about every second (``: modelyard loading smollm2 phase=engine
    62%``), which SDKs ignore; ``reasoning``: the same news as the protocol's reasoning
    (chat's ``delta.reasoning_content``, an Anthropic ``thinking`` block, a Responses
    ``reasoning`` item; legacy completions, which have none, get the comments), which chat
    UIs show. Either way its response (status 200) then begins with the first of them, so
    a failure to load arrives as the protocol's error event. A model's own
    ``loading_progress`` wins, and a request's ``X-Modelyard-Loading-Progress: comments``,
    ``reasoning`` or ``off`` header over both (``router.api.progress``)."""
    responses_store_ttl: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    """Seconds a stored response is kept after its last write."""
    swap_wait: Annotated[float, msgspec.Meta(ge=0)] = 40.0
    """Seconds a model waiting for room lets a busy model (of no higher priority) go on
    serving its clients; then the busy one takes no new requests, finishes the ones it
    has and stops. Until then requests for each model are served together, not one swap
    per request. A model idle for 2 s is evicted at once."""
    max_parked_models: Annotated[int, msgspec.Meta(ge=0)] = 4
    """Models whose workers may be parked at once: a model that makes room for another
    (``max_loaded_models``, a memory budget) keeps its memory and gives up its cores
    instead of stopping, and wakes in milliseconds (``router.lifecycle.parking``). 0:
    never park (a model that makes room stops). Models on a GPU are not parked yet."""
    park_memory_gib: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """What parked workers may hold in all (their resident sets as measured when they
    parked). Unset: a model parks while this host's available memory, less what the
    model making room is expected to take, stays above ``PARK_MARGIN`` of its total."""
    park_quantum: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Seconds a model keeps the cores, once it runs, while another waits for them; then
    it is parked between two engine steps (its streams pause, and go on at its next
    turn) and the other runs: two models with work take turns of this length, and no
    request waits much longer than one turn."""
    preload: list[str] = []
    """Models (ids or aliases) to load at start-up, as ``load_on_startup`` does."""
    spare_workers: Annotated[int, msgspec.Meta(ge=0, le=8)] = 1
    """Worker processes kept started with vLLM and torch already imported and no model:
    a load turns one into the model's worker (seconds sooner) and a new one is started
    in the background once the model is ready. 0: every load starts a fresh process."""
    fork_spares: bool = True
    """Fork spare workers from one process that imported vLLM and torch once (the zygote,
    itself a spare that never gets a model) instead of starting each afresh: a spare is
    ready ~10 ms after a load took the last one instead of ~8 s of imports later, and
    spares share the zygote's pages. False: each spare is a process started afresh."""
    backend: Literal["local", "ray"] = "local"
    """Where workers run: ``local`` subprocesses of the router, or ``ray`` actors that a
    Ray cluster places (``docs/multi-router.md``); a model's own ``backend`` overrides it."""
    ray_address: str | None = None
    """The Ray cluster to join (``ray.init(address=...)``, e.g. ``10.0.0.5:6379`` or
    ``auto``); default: a Ray instance started in the router's process for its lifetime."""
    adapter_roots: list[str] = []
    """Folders under which ``POST /v1/models/adapters`` may register a LoRA adapter by
    path (links followed), beside every base's ``adapters_dir``; relative to the preset's
    folder. With neither, every registration is refused."""
    batch_model_concurrency: Annotated[int, msgspec.Meta(ge=1)] = 16
    """Batch lines one model runs at once, over every batch and key."""
    batch_shared_concurrency: Annotated[int, msgspec.Meta(ge=1)] = 2
    """Batch lines one model starts in the gaps of people's use (no request of theirs in
    flight for ``router.batches.runner.GAP`` s, one within the last 10 s). While a
    person's request is in flight none start, and those running when it came were cut,
    to run again in a gap: every line in the engine's batch slows each step a person's
    tokens wait for. A line cut twice runs to its end (``CUTS``), and where people leave
    no gap one line runs beside them once none moved for ``STARVED_AFTER`` s, so a batch
    still ends beside people who keep a model busy."""
    batch_key_concurrency: Annotated[int, msgspec.Meta(ge=1)] = 16
    """Batch lines one key's batches run at once."""
    files_max_mib: Annotated[float, msgspec.Meta(gt=0)] = 200.0
    """An uploaded file (``/v1/files``, a message batch's requests), at most."""
    files_quota_mib: Annotated[float, msgspec.Meta(ge=0)] = 2048.0
    """One key's uploaded files together, at most (deleting one makes room)."""
    batch_max_lines: Annotated[int, msgspec.Meta(ge=1)] = 50_000
    """Requests one batch may hold."""
    batches_per_key: Annotated[int, msgspec.Meta(ge=1)] = 8
    """Batches one key may have in flight at once (not yet ended, both APIs together); a
    create past it is a 429 (``too_many_batches``) until one ends or is cancelled."""
    routing: Routing = msgspec.field(default_factory=Routing)
    """How every model picks among its replicas; a model's own ``routing`` keys win, key
    by key (filled in at load)."""


class SamplingDefaults(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True,
                       kw_only=True):
    """What a model samples with where a request leaves a parameter out: above the
    model's own ``generation_config.json``, below the request (as Ollama's Modelfile
    ``PARAMETER`` lines and ``vllm serve --override-generation-config``)."""

    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Tokens an answer may have when the request names no limit (a request's own
    ``max_tokens``, larger or smaller, wins; the context still bounds it): a small model
    that never stops otherwise writes to the end of its context, minutes on a CPU."""


class ModelSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How to run one model. ``id`` is the preset's section or key name."""

    id: str = ""
    model: str
    """A local HF folder, a hub id (only if it is already in the local cache), or
    ``builtin:smollm2`` for the embedded model."""
    aliases: list[str] = []
    engine: Literal["vllm", "synthetic"] = "vllm"
    device: Literal["cpu", "cuda"] = "cpu"
    cpu_cores: str | None = None
    """CPU placement, e.g. ``"0"`` or ``"0-3"`` (``VLLM_CPU_OMP_THREADS_BIND``)."""
    kv_cache_gib: int = 1
    """CPU KV cache size in whole GiB (``VLLM_CPU_KVCACHE_SPACE``, an integer in vLLM)."""
    gpus: list[int] = []
    tensor_parallel_size: int = 1
    pipeline_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    backend: Literal["local", "ray"] | None = None
    """``local`` or ``ray``; default: the server's ``backend`` (filled in at load)."""
    num_cpus: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """Ray: CPUs the worker's actor reserves on its node (default 1)."""
    num_gpus: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """Ray: GPUs the actor reserves (default: ``tensor_parallel_size`` on ``cuda``, else 0;
    a model spanning nodes reserves none itself: vLLM's Ray executor places its ranks)."""
    resources: dict[str, float] = {}
    """Ray: custom resources the actor needs, e.g. ``{"node:10.0.0.7": 0.01}`` or a
    label-like resource a node was started with (``ray start --resources``)."""
    label_selector: dict[str, str] = {}
    """Ray: node labels the actor's node must have (``ray start --labels``)."""
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool | None = None
    """Default: true on CPU (torch.compile there takes minutes), false on GPU."""
    pinned: bool = False
    """Never evicted for another model and never stopped for idling. An adapter model:
    loaded with its base and never out of its engine (so a base's pinned adapters must be
    fewer than its ``max_cpu_loras``); it takes a batch slot when it runs, as any."""
    priority: int = 0
    """Among models waiting for room, the higher loads first; a busy model yields its room
    (``swap_wait``) only to a model of at least its priority."""
    min_resident: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Seconds after its load before the model may be evicted for another."""
    fork_engine: bool = True
    """CPU: fork vLLM's EngineCore and executor from the worker, which has vLLM and torch
    imported, instead of spawning them (vLLM's CPU default), which imports both again in
    each; about 14 s of a start here. On GPU vLLM chooses by itself."""
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    ttl: float | None = None
    """Idle seconds before the model is stopped; default: the server's ``ttl``; 0 = never."""
    idle_action: Literal["stop", "sleep"] = "stop"
    """``sleep`` keeps a GPU model in vLLM sleep mode (level 1) when idle; CPU, or a GPU
    engine without sleep mode (``sleep_mode``): stop."""
    memory_gib: float | None = None
    """Footprint counted against ``memory_budget_gib``; default: CPU ``kv_cache_gib`` + 1,
    GPU ``gpu_memory_utilization`` × the device's memory (NVML)."""
    load_on_startup: bool = False
    max_concurrent: Annotated[int, msgspec.Meta(ge=0)] = 256
    """Requests this model serves at once (0: no cap); more wait in its queue
    (``max_queue_depth``), then get a 429."""
    task: Literal["generate", "embed", "score", "classify"] = "generate"
    """``embed`` runs the model with vLLM's pooling runner for ``/v1/embeddings`` (and
    scores pairs by the cosine of their embeddings); ``score`` (a reranker) and
    ``classify`` (vLLM's name for the same runner) run it as a sequence classifier, a
    decoder converted by vLLM (``convert: classify``) included, for ``/v1/rerank`` and
    ``/v1/score``."""
    chat_template: str | None = None
    """Jinja text, the path of a ``.jinja`` file (relative to the preset's folder), or
    ``builtin:chatml-tools`` (SmolLM2's ChatML with Hermes tools, shipped with modelyard)."""
    tool_parser: str | None = None
    """vLLM's tool parser name (``hermes``, ``llama3_json`` ...) for ``tool_choice: auto``."""
    tool_strict_level: Literal["auto", "function", "parameter"] | None = None
    """How far vLLM's structural tag constrains a call the model starts under
    ``tool_choice: auto`` (a text answer stays free): ``parameter`` (the default where
    ``tool_parser`` has a structural tag, ``STRUCTURAL_TAG_PARSERS``) names a declared tool
    and pins its arguments to the tool's schema; ``function`` names a declared tool;
    ``auto`` constrains only requests with a ``strict: true`` tool. A tool's own
    ``strict`` wins over the level. Parsers without a structural tag, and models with a
    ``reasoning_parser`` (not yet): leave it out."""
    reasoning_parser: str | None = None
    """vLLM's reasoning parser name (``deepseek_r1``, ``qwen3``, ``olmo3`` ...)."""
    max_tokens_overflow: (Literal["clamp", "reject"]
                          | dict[Literal["openai", "anthropic", "responses"],
                                 Literal["clamp", "reject"]]) = {}
    """When prompt + ``max_tokens`` exceed the context: ``clamp`` ``max_tokens`` to what
    the context leaves, or ``reject`` (a 400); one value for every protocol, or per
    protocol. Default: Anthropic's Messages clamp (its clients hard-code 32 000), OpenAI's
    chat/completions and Responses reject, as OpenAI does."""
    sampling_defaults: SamplingDefaults = msgspec.field(default_factory=SamplingDefaults)
    """Sampling parameters for what a request leaves out (``SamplingDefaults``), on every
    protocol; INI: ``sampling_defaults.temperature = 0.2``."""
    loading_progress: Literal["off", "comments", "reasoning"] | None = None
    """Progress (comment lines, or reasoning) to a stream that waits for this model's
    load (the server's ``loading_progress``); default: the server's."""
    owned_by: str = "modelyard"
    base: str | None = None
    """An adapter model: the id of the model whose engine serves it, with the LoRA
    ``adapter`` on top. It takes only ``ADAPTER_KEYS``; the rest is its base's."""
    adapter: str | None = None
    """An adapter model's LoRA folder (peft's ``save_pretrained``: ``adapter_config.json``
    and ``adapter_model.safetensors``), relative to the preset's folder."""
    adapters_dir: str | None = None
    """A base's folder of LoRA adapter folders: each is the model ``<base>/<folder>`` (and
    ``<folder>`` where no other model has that name), found when a request names it."""
    max_loras: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Adapters one engine step mixes (vLLM's ``max_loras``); a base with adapters: 4.
    Set on a base without adapters, it readies the engine for adapters registered later."""
    max_cpu_loras: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Adapters the engine keeps loaded, least recently used out; with adapters: 32."""
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] | None = None
    """The largest adapter rank the engine takes; with adapters: the smallest of vLLM's
    ranks that holds every declared adapter, at least 16. What lies in ``adapters_dir``
    never changes it (nor restarts the base at a reload): a folder of a higher rank is
    refused, naming this key."""
    replicas: Replicas = msgspec.field(default_factory=Replicas)
    """How many workers serve the model (``Replicas``): ``N`` or ``{min, max, idle,
    up_wait, up_after, cooldown}``; INI: ``replicas = 2`` or ``replicas.max = 2``."""
    routing: Routing = msgspec.field(default_factory=Routing)
    """How a request picks one of the model's replicas (``Routing``); default: the
    server's ``routing``, with the keys given here over it."""
    engine_args: dict[str, Any] = {}
    """Extra ``AsyncEngineArgs`` keyword arguments, passed through unchanged."""
    env: dict[str, str] = {}


STRUCTURAL_TAG_PARSERS = frozenset({
    "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "deepseek_v41", "glm45",
    "glm47", "hermes", "hy_v4", "kimi_k2", "kimi_k3", "ling3", "llama3_json", "llama4_json",
    "longcat", "mimo", "minimax_m2", "openai", "plamo3", "qwen3_coder", "qwen3_json",
    "qwen3_xml", "step3p5"})
"""vLLM 0.32's tool parsers that declare a structural tag (``structural_tag_model``), the
ones whose ``auto`` calls can be constrained; tests/test_tools.py keeps it equal to
vLLM's own list."""


def auto_tool_calls(spec: ModelSpec) -> str | None:
    """What a ``tool_choice: auto`` call of ``spec``'s model is held to: ``parameter``,
    ``function`` or ``auto`` (``tool_strict_level``), ``unconstrained`` (a parser without
    a structural tag, or a model with a reasoning parser), or None (no ``tool_parser``:
    the model cannot choose tools)."""
    if spec.tool_parser is None:
        return None
    if spec.tool_parser not in STRUCTURAL_TAG_PARSERS or spec.reasoning_parser is not None:
        # With a reasoning parser the tag would hold the thinking too (a call begun there
        # could never close it): vLLM's engine would need the reasoning parser as well.
        return "unconstrained"
    return spec.tool_strict_level or "parameter"


ADAPTER_KEYS = frozenset({"base", "adapter", "aliases", "pinned", "priority", "owned_by"})
"""What an adapter model's own preset entry may set."""


def serves_adapters(spec: ModelSpec) -> bool:
    """Whether ``spec``'s engine starts ready for LoRA adapters (``max_loras`` is filled
    in at load for a base with adapters)."""
    return spec.base is None and spec.max_loras is not None


ROUTER_ONLY_FIELDS = frozenset({"aliases", "ttl", "pinned", "priority", "min_resident",
                                "idle_action", "owned_by", "load_on_startup",
                                "max_tokens_overflow", "loading_progress", "replicas",
                                "routing"})
"""``ModelSpec`` fields only the router reads: a reload changes them in a running model
without restarting its worker."""


SERVED_BY: dict[str, tuple[str, ...]] = {
    "generate": ("generate",),
    "embed": ("embed",),
    "score": ("score", "classify", "embed"),
}
"""The model tasks (``ModelSpec.task``) that can serve each kind of request."""

TASK_NAMES = {"generate": "a generation model", "embed": "an embedding model",
              "score": "a scoring model (a reranker)", "classify": "a classification model"}


OVERFLOW_DEFAULTS = {"openai": "reject", "anthropic": "clamp", "responses": "reject"}


def clamps_max_tokens(spec: ModelSpec, protocol: str) -> bool:
    """Whether ``protocol``'s requests to ``spec``'s model clamp an overflowing
    ``max_tokens`` (``max_tokens_overflow``) instead of refusing it."""
    policy = spec.max_tokens_overflow
    if isinstance(policy, str):
        return policy == "clamp"
    chosen: str = policy.get(protocol, OVERFLOW_DEFAULTS[protocol])  # type: ignore[call-overload]
    return chosen == "clamp"


def restart_needed(old: ModelSpec, new: ModelSpec) -> bool:
    """Whether a worker started with ``old`` must restart to serve ``new``. A new
    ``replicas.max`` cuts the model's cores (or GPUs) anew (``placement.replica_spec``):
    a replica started on the old share would overlap one started on a new share."""
    if old.replicas.max != new.replicas.max:
        return True
    return msgspec.structs.replace(old, **{f: getattr(new, f) for f in ROUTER_ONLY_FIELDS}) != new


class WorkerBoot(msgspec.Struct, kw_only=True):
    """What a worker reads from its stdin (never its command line, which ``ps`` shows to
    every user): its model's spec and the key that lets it, and only it, reach the router."""

    spec: ModelSpec
    router_key: str
    """The CURVE public key of the router's socket for this worker (Z85)."""
    endpoint: str
    """The router's ZeroMQ address for this worker."""
    env: dict[str, str] = {}
    """Set in the worker's environment before its engine starts: its placement and the
    model's ``env`` (a spare process was started before its model was known)."""
    log_path: str = ""
    """Where a spare process sends its output once it becomes this model's worker."""


class Preset(msgspec.Struct, kw_only=True):
    server: ServerConfig
    models: dict[str, ModelSpec]
    source: str = ""
    read_files: list[str] = []
    """The other files the preset's text was read from: its models' ``chat_template``
    files (``--watch-config`` watches them with the preset file)."""


EXPANDABLE = "expandable_segments:true"
"""In ``PYTORCH_CUDA_ALLOC_CONF``: torch's expandable segments, which vLLM's sleep-mode
allocator (``CuMemAllocator``) refuses to start beside."""


def sleep_mode(spec: ModelSpec, environ: Mapping[str, str]) -> bool:
    """Whether ``spec``'s engine starts with vLLM's sleep mode, which a GPU model parks
    (and ``idle_action: sleep`` sleeps) through: every GPU model's, unless its
    ``engine_args`` turn ``enable_sleep_mode`` off, or its environment (``environ``, the
    worker's, with the model's own ``env`` over it) asks torch for expandable segments,
    where vLLM would refuse to start it. The worker starts the engine by it and the room
    policy parks by it: one rule, so a model is never parked through a sleep its engine
    cannot do."""
    # As vLLM reads it (``args.update(spec.engine_args)``): any false value turns it off.
    if spec.device != "cuda" or not spec.engine_args.get("enable_sleep_mode", True):
        return False
    conf = {**environ, **spec.env}.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return EXPANDABLE not in conf.replace(" ", "").lower()
