"""LoRA adapters for the embedded model, made with peft from random weights: what the
tests (tests/test_lora.py) and the LoRA benchmark (bench/lora.py) serve, and peft's own
greedy tokens to check the served ones against. No hub: the base is the embedded model.

Random ``lora_B`` (peft starts it at zero, which would change nothing) of standard
deviation 0.05 moves SmolLM2-135M's greedy words within 8 tokens of an open prompt
("Once upon a time, there was a": seeds 2, 4 and 5 each differently; 0.02 moved few).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def base_path() -> str:
    from worker.materialize import resolve_model_path

    return str(resolve_model_path("builtin:smollm2", None))


def make_adapters(folder: Path, specs: dict[str, tuple[int, int]],
                  targets: list[str] | None = None) -> dict[str, Path]:
    """One adapter folder per ``name: (rank, seed)`` under ``folder``; their paths."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}
    for name, (rank, seed) in specs.items():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base_path(), dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets or TARGETS,
                            init_lora_weights=False)
        peft_model = get_peft_model(model, config)
        for param_name, weight in peft_model.named_parameters():
            if "lora_B" in param_name:
                torch.nn.init.normal_(weight, std=0.05)
        made[name] = folder / name
        peft_model.save_pretrained(str(made[name]))
    return made


def peft_greedy(adapter: Path | None, prompt_ids: list[int], n: int) -> list[int]:
    """The ``n`` tokens peft's model (the base in float32, ``adapter`` on top) picks
    greedily after ``prompt_ids``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base_path(), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return [int(t) for t in out[0][len(prompt_ids):]]
