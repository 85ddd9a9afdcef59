"""The ``modelyard`` command: ``modelyard serve --config configs/default.yaml``."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from router.app import build_app
from shared.config import ConfigError, load_preset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modelyard", description="multi-model LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the models of a preset file")
    serve.add_argument("--config", "-c", default="configs/default.yaml",
                       help="preset file (.yaml or .ini)")
    serve.add_argument("--host", help="overrides the preset's server.host")
    serve.add_argument("--port", type=int, help="overrides the preset's server.port")
    serve.add_argument("--log-level", help="overrides the preset's server.log_level")
    args = parser.parse_args(argv)

    try:
        preset = load_preset(args.config)
    except ConfigError as err:
        print(f"modelyard: {err}", file=sys.stderr)
        return 2
    server = preset.server
    if args.host:
        server.host = args.host
    if args.port is not None:
        server.port = args.port
    if args.log_level:
        server.log_level = args.log_level
    logging.basicConfig(level=server.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(preset)
    except ConfigError as err:  # what only the running machine can tell (dirs, memory)
        print(f"modelyard: {err}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=server.host, port=server.port, log_level=server.log_level,
                access_log=False, timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
