"""vLLM 0.32's CPU LoRA kernels (``vllm/lora/ops/torch_ops/lora_ops.py``), corrected.

vLLM marks a token of a request without an adapter with the index -1, and its torch ops
gather ``weights[indices]``: -1 picks the last adapter slot, so a base-model request that
shares a batch with any adapter's request runs with that adapter (upstream PRs #48421 and
#49656, not in 0.32). Here such rows give zeros, and a batch with no adapter at all skips
the product. ``worker.engine.fix_cpu_lora_ops`` puts these in vLLM's place; torch only.
"""

from __future__ import annotations

import torch


def _product(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor | None:
    """Each row of ``inputs`` times its adapter's matrix (rows of no adapter: zeros), or
    None when no row has an adapter."""
    valid = indices >= 0
    if not bool(valid.any()):
        return None
    selected = weights[indices.clamp(min=0)].to(dtype=dtype)
    if selected.dim() == 4:
        selected = selected.squeeze(dim=1)
    out = torch.einsum("bi, boi -> bo", inputs.to(dtype=dtype), selected)
    if not bool(valid.all()):
        out.masked_fill_(~valid.unsqueeze(1), 0)
    return out


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                output_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                scaling: float = 1.0) -> None:
    out = _product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if out is None:
        output_tensor.zero_()
        return
    output_tensor[:, : out.shape[1]] = scaling * out


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                output_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                add_inputs: bool = True) -> None:
    out = _product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if out is None:
        if not add_inputs:
            output_tensor.zero_()
        return
    limit = output_tensor.shape[0]
    if out.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    # the adapter and the model may pad their outputs differently
    common = min(out.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += out[:limit, :common]
    else:
        output_tensor[:, :common] = out[:limit, :common]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                      output_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                      slice_offset: int, slice_size: int, add_inputs: bool = True) -> None:
    out = _product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    window = output_tensor[:, slice_offset: slice_offset + slice_size]
    if out is None:
        if not add_inputs:
            window.zero_()
        return
    if add_inputs:
        window += out
    else:
        window.copy_(out)


def sgmv_shrink(inputs: torch.Tensor, lora_a_weights: torch.Tensor,
                output_tensor: torch.Tensor, b_seq_start_loc: torch.Tensor,
                seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                batches: int, max_seq_length: int, token_nums: int, scaling: float) -> None:
    tokens = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_shrink(inputs, lora_a_weights, output_tensor, tokens, scaling)


def sgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                output_tensor: torch.Tensor, b_seq_start_loc: torch.Tensor,
                seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                batches: int, max_seq_length: int, token_nums: int,
                add_inputs: bool = False) -> None:
    tokens = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_expand(inputs, lora_b_weights, output_tensor, tokens, add_inputs)


def sgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                      output_tensor: torch.Tensor, b_seq_start_loc: torch.Tensor,
                      seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                      batches: int, max_seq_length: int, token_nums: int, slice_offset: int,
                      slice_size: int, add_inputs: bool = False) -> None:
    tokens = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, tokens, slice_offset,
                      slice_size, add_inputs)


OPS = {f.__name__: f for f in (bgmv_shrink, bgmv_expand, bgmv_expand_slice, sgmv_shrink,
                              sgmv_expand, sgmv_expand_slice)}
"""What ``fix_cpu_lora_ops`` puts in vLLM's place, by name."""
