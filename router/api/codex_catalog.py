"""Codex's model catalog: what Codex reads about a model, served from the preset.

Codex (0.169) looks a model up in its models manager (codex-rs ``models-manager``:
``ModelsManager::get_model_info`` → ``construct_model_info_from_candidates``, the longest
catalog slug the model's name begins with); a miss is ``model_info_from_slug``'s fallback
and the warning "Model metadata for `smollm2` not found. Defaulting to fallback metadata".
It fills its catalog from ``GET {base_url}/models?client_version=0.169.0`` (codex-api
``ModelsClient``), decoded as ``{"models": [ModelInfo, ...]}``, but only for a provider
with an ``auth`` command (``ModelsEndpointClient::has_command_auth``) or a ChatGPT login;
``model_catalog_json`` in its config reads the same shape from a file. So the model list
answers with a ``models`` key beside OpenAI's ``data`` when ``client_version`` is asked.

Of ``ModelInfo``'s fields these are required (tried one by one against the 0.169 binary):
``slug``, ``display_name``, ``supported_reasoning_levels``, ``shell_type``,
``visibility``, ``supported_in_api``, ``priority``, ``model_messages`` (with a string
``instructions_template``: the base instructions Codex sends), ``support_verbosity``,
``truncation_policy``, ``experimental_supported_tools``. The rest take Codex's defaults.
"""

from __future__ import annotations

from typing import Any

from router.registry import ModelEntry

INSTRUCTIONS = """\
You are a coding agent working in the user's workspace through the tools you are given.

- Look before you change: open the files involved and run the commands that show how
  things are.
- Do what the user asked and no more, in the style of the code around it.
- Run commands with the shell tool; change a file by writing it with a command, then
  look at the result.
- Check your work: run the tests or the program when there are some.
- Ask the user only when the request can be read in ways that lead to different work.
- End with a short answer: what you changed and how you checked it, or what is left.
"""
"""Codex's base instructions for every model here. Its metadata cannot leave them out,
and its own prompt (17 kB, about 4 000 tokens, written for its GPT models) would fill
half of an 8 192-token context; ``model_instructions_file`` in Codex's config replaces
these."""

_EFFORTS = [{"effort": e, "description": f"{e} reasoning effort (the chat template's "
                                         "reasoning_effort)"} for e in ("low", "medium", "high")]


def model_info(entry: ModelEntry, slug: str, priority: int) -> dict[str, Any]:
    """Codex's ``ModelInfo`` for ``entry`` under ``slug`` (its id, listed, or an alias,
    hidden from Codex's picker)."""
    spec = entry.spec
    info: dict[str, Any] = {
        "slug": slug, "display_name": slug, "description": f"{entry.id} on modelyard",
        "visibility": "list" if slug == entry.id else "hide",
        "supported_in_api": True, "priority": priority,
        # Reasoning efforts reach the chat template as ``reasoning_effort``; the parser
        # is what splits the model's thinking from its answer.
        "supported_reasoning_levels": _EFFORTS if spec.reasoning_parser else [],
        # The answer's reasoning is raw text (``reasoning_text``), never a summary.
        "supports_reasoning_summaries": False, "support_verbosity": False,
        # As Codex's fallback: its default shell tool, no apply_patch tool (edits go
        # through the shell), tool output cut at 10 000 bytes.
        "shell_type": "default", "apply_patch_tool_type": None,
        "truncation_policy": {"mode": "bytes", "limit": 10_000},
        "supports_parallel_tool_calls": False, "experimental_supported_tools": [],
        "model_messages": {"instructions_template": INSTRUCTIONS},
    }
    context = entry.max_model_len or spec.max_model_len
    if context:  # else unknown until the model loads: Codex then keeps no window
        info["context_window"] = info["max_context_window"] = context
    return info


def catalog(entries: list[ModelEntry]) -> list[dict[str, Any]]:
    """Codex's ``models`` for the generation models among ``entries``: each by its id,
    then by each alias (Codex matches the longest slug its model's name begins with)."""
    models = [e for e in entries if e.spec.task == "generate"]
    return [model_info(e, slug, priority) for priority, e in enumerate(models)
            for slug in (e.id, *e.spec.aliases)]
