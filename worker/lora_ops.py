"""vLLM 0.32's CPU LoRA kernels (``vllm/lora/ops/torch_ops/lora_ops.py``), corrected.

vLLM marks a token of a request without an adapter with the index -1, and its torch ops
gather ``weights[indices]``: -1 picks the last adapter slot, so a base-model request that
shares a batch with any adapter's request runs with that adapter (upstream PRs #48421 and
#49656, not in 0.32). Here such rows give zeros.

They were also slow (0.07x the base's tokens/s over 8 adapters here): a gathered copy of
the matrix for every token, for every slice of every layer. Here a step's row plan and
the float32 weights are kept until vLLM changes them (``forget_plans``,
``forget_weights``), the rows of several adapters take one batched product over the
slots, a merged layer's slices (q, k, v; gate, up) two products in all
(``add_lora_linear``), the zero rows vLLM pads a low rank with none, and a layer none of
the batch's adapters trained none.
``worker.engine.fix_cpu_lora_ops`` puts these in vLLM's place; torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SMALL = 128
"""Up to this many rows (decoding), a batched product however unevenly the adapters share
them: its padding costs less than a product per adapter."""


class _Plan:
    """How one batch's rows meet the adapter slots: the same for every LoRA layer of an
    engine step, so it is worked out once per step (``_plan``), not per call.

    Rows of several adapters are grouped by slot, each group padded to the largest
    (``width`` rows), for one batched product over the slots (``torch.bmm``): as many
    multiply-adds as the rows need when the adapters share the batch evenly; past
    ``SMALL`` rows at most twice that, else one product per adapter."""

    __slots__ = ("gather", "invalid", "place", "rows", "single", "slots", "used", "valid",
                 "width")

    def __init__(self, indices: torch.Tensor, count: int) -> None:
        valid = indices >= 0
        self.rows = int(indices.shape[0])
        self.valid: torch.Tensor | None = None if bool(valid.all()) else valid
        self.invalid = ~valid.unsqueeze(1)
        used = torch.unique(indices[valid]).tolist()
        self.used = frozenset(used)
        self.slots: list[tuple[int, torch.Tensor]] = [
            (slot, (indices == slot).nonzero().squeeze(1)) for slot in used]
        self.single = used[0] if len(used) == 1 and self.valid is None else None
        self.width = max((len(rows) for _, rows in self.slots), default=0)
        self.gather: torch.Tensor | None = None
        self.place = torch.zeros(self.rows, dtype=torch.long)
        if len(used) > 1 and (self.rows <= SMALL or count * self.width <= 2 * self.rows):
            # gather[s, j]: the j-th row of slot s (row 0 as padding); place[r]: where
            # row r's result lands in the (slots x width) output
            self.gather = torch.zeros(count, self.width, dtype=torch.long)
            for slot, rows in self.slots:
                self.gather[slot, : len(rows)] = rows
                self.place[rows] = slot * self.width + torch.arange(len(rows))


_plans: dict[tuple[int, int, int], _Plan] = {}
_weights: dict[tuple[int | str, ...], torch.Tensor] = {}
_exploded: dict[tuple[int, ...], torch.Tensor] = {}
_live: dict[tuple[int, ...], frozenset[int]] = {}
"""Per weight: the slots holding an adapter with weights for its layer. vLLM runs every
LoRA layer for every adapter; one trained on q and v only (peft's default for Llama)
leaves zeros in the others, whose products are skipped."""


def _key(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's data is: vLLM keeps its index buffers and adapter weights at
    addresses that stay, and fills them in place (``forget_plans``, ``forget_weights``
    say when: inference tensors keep no version counter)."""
    return t.data_ptr(), t.numel()


def forget_plans() -> None:
    """A new mapping of rows to adapters (vLLM's ``update_metadata``)."""
    _plans.clear()
    _exploded.clear()


def forget_weights() -> None:
    """An adapter was put into a slot (vLLM's ``activate_adapter``)."""
    _weights.clear()
    _merged.clear()
    _live.clear()


def _plan(indices: torch.Tensor, count: int) -> _Plan:
    key = (*_key(indices), count)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) > 16:
            _plans.clear()
        plan = _plans[key] = _Plan(indices, count)
    return plan


def _prepared(key: tuple[int, ...], kind: str,
              build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The weights ``build`` gives (slots, out, in) in float32 (the fastest products here,
    bfloat16 weights or not), as they are (``slots``) or as (slots, in, out)
    (``batched``); made again after an adapter is put into a slot."""
    hit = _weights.get((*key, kind))
    if hit is not None:
        return hit
    made = build().float()
    made = (made.transpose(1, 2) if kind == "batched" else made).contiguous()
    _weights[(*key, kind)] = made
    return made


def _stacked(weights: torch.Tensor) -> torch.Tensor:
    return weights.squeeze(dim=1) if weights.dim() == 4 else weights


def _product(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor | None:
    """Each row of ``inputs`` times its adapter's matrix (rows of no adapter: zeros), or
    None when no row has an adapter.

    vLLM gathers a copy of the matrix for every token: 16 decode tokens of 8 adapters
    against 1536 x 16 matrices took 2.4 ms a call that way here. Here a step's rows are
    planned once, the weights kept in float32, and a call is one or a few matrix
    products."""
    return _planned(inputs, _key(weights), lambda: _stacked(weights), weights.shape[0],
                    indices, dtype)


def _planned(inputs: torch.Tensor, key: tuple[int, ...], build: Callable[[], torch.Tensor],
             count: int, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    plan = _plan(indices, count)
    if not plan.slots:
        return None
    slots = _prepared(key, "slots", build)
    live = _live.get(key)
    if live is None:  # the slots whose adapter has weights here
        live = _live[key] = frozenset(slots.flatten(1).any(dim=1).nonzero().flatten().tolist())
    if not any(slot in live for slot, _ in plan.slots):
        return None  # the batch's adapters leave this layer alone (an adapter of q and v)
    x = inputs.float()
    if plan.single is not None:  # one adapter for the whole batch
        return (x @ slots[plan.single].T).to(dtype=dtype)
    if plan.gather is not None:  # one batched product over the slots
        grouped = torch.bmm(x[plan.gather], _prepared(key, "batched", build))
        out = grouped.view(-1, grouped.shape[-1])[plan.place]
    else:
        out = x.new_zeros((plan.rows, slots.shape[1]))
        for slot, mine in plan.slots:
            out[mine] = x[mine] @ slots[slot].T
    if plan.valid is not None:
        out.masked_fill_(plan.invalid, 0)
    return out.to(dtype=dtype)


class _Merged:
    """One LoRA layer's weights over the slots as ``add_lora_linear`` multiplies them, in
    float32 (the fastest small products here, bfloat16 weights or not), made again after
    an adapter is put into a slot (``forget_weights``).

    The slices' A matrices are one (slots, in, k) matrix and their B matrices one
    block-diagonal (slots, k, out) matrix. ``k`` counts only the rank rows some slot's
    adapter fills: vLLM pads every adapter to ``max_lora_rank`` with zeros (a rank-8
    adapter in a rank-16 engine is half zeros), whose products add nothing but cost
    reading the weights, which is what bounds these products (8 slots, 60 layer calls a
    step: 11 ms at rank 16, 6.7 ms trimmed to rank 8)."""

    __slots__ = ("a", "b", "count", "live", "width")

    def __init__(self, a_stacked: tuple[torch.Tensor, ...],
                 b_stacked: tuple[torch.Tensor, ...], sizes: tuple[int, ...]) -> None:
        self.count = a_stacked[0].shape[0]
        self.width = sum(sizes)
        rank = a_stacked[0].shape[-2]
        a = torch.cat([_stacked(t) for t in a_stacked], dim=1)  # (slots, slices x r, in)
        b = torch.zeros(self.count, self.width, rank * len(b_stacked), dtype=a.dtype)
        offset = 0
        for i, (stack, size) in enumerate(zip(b_stacked, sizes, strict=True)):
            b[:, offset: offset + size, i * rank: (i + 1) * rank] = _stacked(stack)[:, :size]
            offset += size
        kept = a.any(dim=2).any(dim=0).nonzero().flatten()
        self.a = a[:, kept].float().transpose(1, 2).contiguous()
        self.b = b[:, :, kept].float().transpose(1, 2).contiguous()
        self.live = frozenset(self.a.flatten(1).any(dim=1).nonzero().flatten().tolist())


_merged: dict[tuple[int, ...], _Merged] = {}


def add_lora_linear(wrapper: Any, y: torch.Tensor, x: torch.Tensor,
                    lora_a_stacked: tuple[torch.Tensor, ...],
                    lora_b_stacked: tuple[torch.Tensor, ...], scale: float,
                    output_slices: tuple[int, ...], *,
                    buffer: tuple[torch.Tensor, ...] | None = None, **kwargs: Any) -> None:
    """``PunicaWrapperCPU.add_lora_linear`` in two products, whatever the slices: vLLM
    shrinks and expands each slice of a merged layer (q, k, v; gate, up) apart, 14 op
    calls a decoder layer, each paying its own dispatch. Here a layer's weights are one
    shrink and one expand (``_Merged``), and a batch of several adapters' rows goes
    through both as one group per slot (the expand takes the shrink's groups as they
    are): a layer is a handful of calls.

    ``y[:, :sum(output_slices)] += (x @ A_i) * scale @ B_i`` for each slice i, row by row
    with the row's adapter (none: nothing added)."""
    key = (id(lora_a_stacked), id(lora_b_stacked), lora_a_stacked[0].data_ptr())
    layer = _merged.get(key)
    if layer is None:
        layer = _merged[key] = _Merged(lora_a_stacked, lora_b_stacked, output_slices)
    if not layer.live:
        return  # no adapter trained this layer (an adapter of q, k, v, o in the MLP)
    plan = _plan(wrapper.token_lora_indices, layer.count)
    if layer.live.isdisjoint(plan.used):
        return
    rows = x.view(-1, x.shape[-1]).float()
    if plan.single is not None:  # one adapter for the whole batch
        added = rows @ layer.a[plan.single] @ layer.b[plan.single]
    elif plan.gather is not None:  # one batched product over the slots, each way
        grouped = torch.bmm(torch.bmm(rows[plan.gather], layer.a), layer.b)
        added = grouped.view(-1, layer.width)[plan.place]
    else:
        added = rows.new_zeros((plan.rows, layer.width))
        for slot, mine in plan.slots:
            added[mine] = rows[mine] @ layer.a[slot] @ layer.b[slot]
    if scale != 1.0:
        added *= scale
    if plan.valid is not None:
        added.masked_fill_(plan.invalid, 0)
    y.view(-1, y.shape[-1])[:, : layer.width] += added


def _tokens(lora_indices: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
    """Each sequence's adapter index repeated for its tokens, once per step."""
    key = (*_key(lora_indices), *_key(seq_len))
    hit = _exploded.get(key)
    if hit is None:
        if len(_exploded) > 16:
            _exploded.clear()
        hit = _exploded[key] = torch.repeat_interleave(lora_indices, seq_len)
    return hit


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
    tokens = _tokens(lora_indices_tensor, seq_len_tensor)
    bgmv_shrink(inputs, lora_a_weights, output_tensor, tokens, scaling)


def sgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                output_tensor: torch.Tensor, b_seq_start_loc: torch.Tensor,
                seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                batches: int, max_seq_length: int, token_nums: int,
                add_inputs: bool = False) -> None:
    tokens = _tokens(lora_indices_tensor, seq_len_tensor)
    bgmv_expand(inputs, lora_b_weights, output_tensor, tokens, add_inputs)


def sgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                      output_tensor: torch.Tensor, b_seq_start_loc: torch.Tensor,
                      seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                      batches: int, max_seq_length: int, token_nums: int, slice_offset: int,
                      slice_size: int, add_inputs: bool = False) -> None:
    tokens = _tokens(lora_indices_tensor, seq_len_tensor)
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, tokens, slice_offset,
                      slice_size, add_inputs)


OPS = {f.__name__: f for f in (bgmv_shrink, bgmv_expand, bgmv_expand_slice, sgmv_shrink,
                              sgmv_expand, sgmv_expand_slice)}
"""What ``fix_cpu_lora_ops`` puts in vLLM's place, by name."""
