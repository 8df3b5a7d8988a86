"""Value zeroing by rerunning the model itself (Mohebbi et al. 2023's definition, docs/methods.md#norms-and-mixing), for any
layout: the whole model is run forward again with token t's value vectors set to zero at bertology's ``value`` hook point
(in every head, or in one; after grouped-query heads are repeated), and layer l's output is read with a forward hook on
the layer module. The rest of the layer is the model's own code, so this is independent of bertology's ``finish`` and of
its batched reruns; the attention weights stay as they are, since only the values change.
"""

from __future__ import annotations

import numpy as np
import torch

from bertology.core.model.hooks import Hooks
from bertology.core.model.models import attention_blocks

from .value_zeroing import cosine_distances_diagonal


def layer_output(model, layer: int, ids: torch.Tensor, mask: torch.Tensor, zero_value=None) -> np.ndarray:
    """Layer ``layer``'s output ``[batch, n, hidden]``, with ``zero_value(value)`` applied to that layer's value vectors
    ``[batch, head, n, head_dim]`` where given. ALBERT runs one shared layer module as several layers: its call for ``layer``."""
    blocks = attention_blocks(model)
    module = blocks[layer].layer
    call = sum(block.layer is module for block in blocks[:layer])
    outputs = []
    handle = module.register_forward_hook(lambda m, args, out: outputs.append((out[0] if isinstance(out, tuple) else out).clone()))
    hooks = Hooks()
    if zero_value is not None:
        hooks.add("value", lambda at, value: zero_value(value.clone()) if at == layer else None)
    try:
        with torch.no_grad(), hooks.attach(model):
            model(input_ids=ids, attention_mask=mask)
    finally:
        handle.remove()
    return outputs[call].numpy()


def rows_summing_to_one(scores: np.ndarray) -> np.ndarray:
    """Each row over its sum; a row whose sum is 0 stays 0, as bertology keeps it."""
    total = scores.sum(axis=-1, keepdims=True)
    return np.divide(scores, total, out=np.zeros_like(scores), where=total > 0)


def value_zeroing_by_rerun(model, layer: int, ids: torch.Tensor, mask: torch.Tensor, b: int, n: int, heads: int,
                           causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """Sequence ``b``'s (``n`` real tokens) value-zeroing scores of layer ``layer``, rows normalised: ``[n, n]`` (t's values
    zeroed in every head) and ``[heads, n, n]`` (in head h only). On a decoder (``causal``) a later token, which no query
    sees, scores 0 (its zeroing changes nothing; bertology says exactly 0 rather than the rerun's rounding)."""
    original = layer_output(model, layer, ids, mask)[b, :n]
    whole, per_head = np.zeros((n, n)), np.zeros((heads, n, n))
    for t in range(n):
        def zero_all(value, t=t):
            value[b, :, t] = 0
            return value

        whole[:, t] = cosine_distances_diagonal(layer_output(model, layer, ids, mask, zero_all)[b, :n], original)
        for h in range(heads):
            def zero_one(value, t=t, h=h):
                value[b, h, t] = 0
                return value

            per_head[h, :, t] = cosine_distances_diagonal(layer_output(model, layer, ids, mask, zero_one)[b, :n], original)
    if causal:
        later = np.triu_indices(n, 1)
        whole[later], per_head[:, later[0], later[1]] = 0, 0
    return rows_summing_to_one(whole), rows_summing_to_one(per_head)
