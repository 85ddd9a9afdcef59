"""The HTTP layer: one module or package per public protocol (``openai``, ``anthropic``,
``responses``, ``scoring``; ``admin``, ``adapters``, ``keys``, ``usage``, ``events``, ``metrics``,
``status``, ``openapi``), the protocol-neutral ``relay``, SSE framing (``sse``), body
decoding and error answers (``wire``), the direct path for chat and completions
(``hotpath``), loading progress for a waiting stream (``progress``), Codex's model
catalog (``codex_catalog``) and, below the middleware, the uvicorn protocol
(``http_protocol``); the batch APIs (``batches``). Only this package and the entry points (``router.app``,
``router.cli``) import it. The worker is another process, whose only common code with
the router is in ``shared/``.

Must not import: ``worker``.
"""
