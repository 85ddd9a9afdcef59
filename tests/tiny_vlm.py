"""A tiny multimodal model for tests: Idefics3 (SmolVLM's architecture) with random weights
and SmolLM2's tokenizer, built in seconds from nothing but installed packages.

It exists to show that image parts reach a multimodal engine (vLLM expands the image into
its tokens); what it writes is noise. Sizes are the smallest vLLM's CPU attention takes
(head size 64).
"""

from __future__ import annotations

from pathlib import Path

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IMAGE_TOKENS = 4
"""A 56-pixel image in 14-pixel patches, merged 2×2: 4 ``<image>`` tokens, plus the
three marker tokens around them."""


def build_tiny_vlm(out: Path, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        LlamaConfig,
    )
    from transformers.models.idefics3 import Idefics3Processor
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,  # the torchvision-free one: this machine has none
    )

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": [
        "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]})
    text = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, image_size=56, patch_size=14)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                            scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(out)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 56},
                                       max_image_size={"longest_edge": 56})
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=IMAGE_TOKENS,
                      chat_template=TEMPLATE).save_pretrained(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return out


def png_data_url(size: int = 40) -> str:
    """A small red square as a ``data:`` URL (nothing is fetched from anywhere)."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
