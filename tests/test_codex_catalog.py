"""Codex's catalog of the preset's models (``router.api.codex_catalog``), pure: what each
model's ``ModelInfo`` says. Codex 0.169 itself reads it in
``tests/test_agents.py::test_codex_finds_the_models_metadata_without_a_warning``."""

from __future__ import annotations

from router.api.codex_catalog import INSTRUCTIONS, catalog
from router.registry import ModelEntry
from shared.config import ModelSpec

REQUIRED = {"slug", "display_name", "supported_reasoning_levels", "shell_type", "visibility",
            "supported_in_api", "priority", "model_messages", "support_verbosity",
            "truncation_policy", "experimental_supported_tools"}
"""The fields Codex 0.169 cannot decode a model without (each left out in turn)."""


def entry(id: str, **spec: object) -> ModelEntry:
    return ModelEntry(ModelSpec(id=id, model="/synthetic", engine="synthetic", **spec))  # type: ignore[arg-type]


def test_each_generation_model_by_id_and_alias_with_its_context_window() -> None:
    plain = entry("plain", aliases=["p"], max_model_len=8192)
    loaded = entry("loaded")
    loaded.max_model_len = 4096  # the worker's own figure, once it is up
    unknown = entry("unknown")
    embed = entry("embed", task="embed", max_model_len=512)
    models = catalog([plain, loaded, unknown, embed])
    by_slug = {m["slug"]: m for m in models}
    assert list(by_slug) == ["plain", "p", "loaded", "unknown"]  # no embedding model
    assert all(REQUIRED <= set(m) for m in models)
    assert by_slug["plain"]["visibility"] == "list" and by_slug["p"]["visibility"] == "hide"
    assert by_slug["plain"]["context_window"] == by_slug["p"]["context_window"] == 8192
    assert by_slug["loaded"]["context_window"] == by_slug["loaded"]["max_context_window"] == 4096
    assert "context_window" not in by_slug["unknown"]  # unknown until it loads
    assert [m["priority"] for m in models] == [0, 0, 1, 2]
    assert {m["model_messages"]["instructions_template"] for m in models} == {INSTRUCTIONS}


def test_reasoning_levels_only_where_the_preset_has_a_reasoning_parser() -> None:
    thinker, plain = catalog([entry("thinker", reasoning_parser="qwen3"), entry("plain")])
    assert [level["effort"] for level in thinker["supported_reasoning_levels"]] == [
        "low", "medium", "high"]
    assert plain["supported_reasoning_levels"] == []
    # the parser gives raw reasoning text, never a summary
    assert not thinker["supports_reasoning_summaries"]
