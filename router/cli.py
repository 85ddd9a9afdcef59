"""The ``modelyard`` command: ``modelyard serve --config configs/default.yaml``;
``modelyard keys ...`` (named keys, in the preset's database); ``modelyard batches ...``
(a running router's batches, over HTTP)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import socket
import sys
import time
from typing import Any

import httpx
import msgspec
import uvicorn

from router.access.database import Database, default_url
from router.access.key_store import SCHEMA as KEY_TABLES
from router.access.key_store import KeyExists, KeySpec, KeyStore, LastAdmin
from router.api.http_protocol import http_protocol, uvicorn_backstop
from router.app import build_app
from shared.config import ConfigError, ServerConfig
from shared.preset_loader import load_preset

GC_THRESHOLD = 50_000
"""Container allocations (less frees) between the router's youngest collections."""
DEFAULT_URL = "http://127.0.0.1:8080"
"""The router ``modelyard batches`` asks unless ``--url`` or ``MODELYARD_URL`` says."""


def build_parser() -> argparse.ArgumentParser:
    """The command line; deploy/'s units and manifests are checked against it."""
    parser = argparse.ArgumentParser(prog="modelyard", description="multi-model LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the models of a preset file")
    serve.add_argument("--config", "-c", default="configs/default.yaml",
                       help="preset file (.yaml or .ini)")
    serve.add_argument("--host", help="overrides the preset's server.host")
    serve.add_argument("--port", type=int, help="overrides the preset's server.port")
    serve.add_argument("--log-level", help="overrides the preset's server.log_level")
    serve.add_argument("--watch-config", action="store_true",
                       help="reload the preset when its file changes (looked at every "
                            "second); SIGHUP and POST /v1/config/reload always reload it")
    serve.add_argument("--runtime-dir",
                       help="overrides the preset's server.runtime_dir (worker sockets, logs)")
    serve.add_argument("--cache-dir", help="overrides the preset's server.cache_dir")
    serve.add_argument("--database-url", help="overrides the preset's server.database_url")
    keys = sub.add_parser("keys", help="named API keys, in the preset's database")
    keys.add_argument("--config", "-c", default="configs/default.yaml",
                      help="the preset whose database holds the keys")
    keys.add_argument("--database-url", help="this database instead of the preset's")
    action = keys.add_subparsers(dest="action", required=True)
    create = action.add_parser("create", help="make a key; its secret is printed once")
    create.add_argument("name")
    create.add_argument("--role", choices=["admin", "user", "viewer"], default="user")
    create.add_argument("--models", nargs="+", default=[], metavar="GLOB",
                        help="model ids or aliases it may use (globs); default: all")
    create.add_argument("--rpm", type=int, default=0, help="requests per minute")
    create.add_argument("--tpm", type=int, default=0, help="tokens per minute")
    create.add_argument("--max-concurrent", type=int, default=0,
                        help="requests in flight at once")
    action.add_parser("list", help="every key (never a secret)")
    revoke = action.add_parser("revoke", help="revoke a key (its name stays taken)")
    revoke.add_argument("name")
    batches = sub.add_parser("batches", help="a running router's batches (/v1/batches)")
    batches.add_argument("--url", default=os.environ.get("MODELYARD_URL", DEFAULT_URL),
                         help=f"the router (default: $MODELYARD_URL or {DEFAULT_URL})")
    batches.add_argument("--key", default=os.environ.get("MODELYARD_API_KEY", ""),
                         help="the API key (default: $MODELYARD_API_KEY); a user key sees "
                              "its own batches, an admin key all")
    what = batches.add_subparsers(dest="action", required=True)
    listed = what.add_parser("list", help="the newest batches, one line each")
    listed.add_argument("--limit", type=int, default=20, help="how many (1 to 100)")
    show = what.add_parser("show", help="one batch, as the API's JSON")
    show.add_argument("id")
    cancel = what.add_parser("cancel", help="cancel a batch; its lines not run yet end "
                                            "cancelled")
    cancel.add_argument("id")
    return parser


async def keys_command(args: argparse.Namespace, database: Database) -> int:
    """``modelyard keys create|list|revoke`` (never the last named admin key: the preset
    given here need not be the one the routers on that database run, so its admin keys
    do not count)."""
    store = KeyStore(database)
    if args.action == "create":
        if args.name.startswith("key-"):
            print("modelyard: a key's name may not start with 'key-'", file=sys.stderr)
            return 2
        try:
            made, secret = await store.create(args.name, args.role, KeySpec(
                models=args.models, rpm=args.rpm, tpm=args.tpm,
                max_concurrent=args.max_concurrent))
        except (ValueError, KeyExists) as err:
            print(f"modelyard: {'a key of that name exists' if isinstance(err, KeyExists) else err}",
                  file=sys.stderr)
            return 2
        print(f"{made.name} ({made.role}): {secret}\nThe secret is shown only now.")
    elif args.action == "list":
        for key in await store.listed():
            state = "revoked" if key.revoked else "active"
            limits = msgspec.json.encode(key.spec).decode()
            print(f"{key.name}\t{key.role}\t{state}\t{limits}")
    else:
        try:
            revoked = await store.revoke(args.name)
        except LastAdmin:
            print(f"modelyard: {args.name!r} is the last admin key: make another admin key "
                  "first", file=sys.stderr)
            return 1
        if not revoked:
            print(f"modelyard: no active key named {args.name!r}", file=sys.stderr)
            return 1
    return 0


BATCH_COLUMNS = ("id", "status", "done", "failed", "endpoint", "created")


def batch_line(batch: dict[str, Any]) -> tuple[str, ...]:
    """A batch's row in ``modelyard batches list``."""
    counts = batch.get("request_counts") or {}
    done = counts.get("completed", 0) + counts.get("failed", 0)
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(batch["created_at"]))
    return (batch["id"], batch["status"], f"{done}/{counts.get('total', 0)}",
            str(counts.get("failed", 0)), batch["endpoint"], created)


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


def batches_command(args: argparse.Namespace) -> int:
    """``modelyard batches list|show ID|cancel ID`` against the router at ``--url``; an
    error the router answers is printed as its message, and the exit status is 1."""
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    base = args.url.rstrip("/") + "/v1/batches"
    try:
        with httpx.Client(headers=headers, timeout=30) as client:
            if args.action == "list":
                reply = client.get(base, params={"limit": args.limit})
            elif args.action == "show":
                reply = client.get(f"{base}/{args.id}")
            else:
                reply = client.post(f"{base}/{args.id}/cancel")
    except httpx.HTTPError as err:
        print(f"modelyard: {args.url}: {err}", file=sys.stderr)
        return 1
    try:
        body = reply.json()
    except ValueError:
        body = None
    if reply.status_code != 200 or not isinstance(body, dict):
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else reply.text[:200]
        print(f"modelyard: HTTP {reply.status_code}: {message}", file=sys.stderr)
        return 1
    if args.action == "list":
        rows = [batch_line(b) for b in body["data"]]
        print(table([BATCH_COLUMNS, *rows]) if rows else "no batches")
    else:
        print(json.dumps(body, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "batches":  # a running router's: no preset read here
        return batches_command(args)

    try:
        preset = load_preset(args.config)
    except ConfigError as err:
        print(f"modelyard: {err}", file=sys.stderr)
        return 2
    server = preset.server
    if args.command == "keys":
        database = Database(args.database_url or server.database_url
                            or default_url(server.cache_dir), KEY_TABLES)
        try:
            return asyncio.run(keys_command(args, database))
        finally:
            database.close()
    overrides = {key: value for key, value in (
        ("host", args.host), ("port", args.port), ("log_level", args.log_level),
        ("runtime_dir", args.runtime_dir), ("cache_dir", args.cache_dir),
        ("database_url", args.database_url))
                 if value is not None and value != ""}
    for key, value in overrides.items():
        setattr(server, key, value)
    logging.basicConfig(level=server.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(preset, watch_config=args.watch_config, overrides=overrides)
    except ConfigError as err:  # what only the running machine can tell (dirs, memory)
        print(f"modelyard: {err}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, host=server.host, port=server.port,
                            log_level=server.log_level, access_log=False,
                            timeout_graceful_shutdown=30,
                            # typed int, but it only reaches loop.call_later
                            timeout_keep_alive=server.keep_alive_timeout,  # type: ignore[arg-type]
                            limit_concurrency=uvicorn_backstop(server.max_connections),
                            proxy_headers=False,  # X-Forwarded-For: see router/access/limits.py (ProxyHeaders)
                            http=http_protocol(server.read_timeout, server))
    # Everything built so far lives as long as the server: keep the collector from
    # walking it in every full collection (vLLM's API server does the same).
    gc.collect()
    gc.freeze()
    # Each request allocates a few hundred containers (scope, task, frames, futures) that
    # its own references free; at the default threshold (700) the collector ran every few
    # requests and scanned every live request's objects each time: 6-8 % of the router's
    # core at 64 connections. Reference cycles wait longer now, a few MB at most.
    gc.set_threshold(GC_THRESHOLD, 20, 20)
    if server.send_buffer_bytes:
        uvicorn.Server(config).run(sockets=[listening_socket(server)])
    else:
        uvicorn.Server(config).run()
    return 0


def listening_socket(server: ServerConfig) -> socket.socket:
    """The server socket, with ``send_buffer_bytes`` set on it: accepted connections inherit
    that fixed kernel send buffer instead of growing theirs up to megabytes for a client
    that does not read."""
    family = socket.AF_INET6 if ":" in server.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, server.send_buffer_bytes)
    sock.bind((server.host, server.port))
    return sock


if __name__ == "__main__":
    sys.exit(main())
