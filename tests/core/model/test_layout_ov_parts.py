"""The layout contract's parts of a head's OV circuit (what the copying score reads, Elhage et al. 2021), for every registered
layout on the tiny float64 models of tests/core/model/test_layouts.py (random biases and norm weights):

- ``value_projection``: the attention's input times ``W_V`` is the values at bertology's ``value`` hook, up to one bias;
- ``final_norm``: applied to the last layer's output, it gives transformers' own last hidden state;
- ``norm_gain``: the gain ``g`` each norm multiplies by (Gemma's ``1 + weight``), read off the norm's odd part.
"""

from __future__ import annotations

import pytest
import torch

from core.model.test_layouts import EVERY_LAYOUT, layout_named, tiny_run


@pytest.mark.parametrize("name", EVERY_LAYOUT)
def test_the_value_projection_makes_the_hooked_values(name):
    layout = layout_named(name)
    for maps in tiny_run(name).layers:
        block, value = maps["block"], maps["value"]  # [batch, head, n, head_dim]: each query head's group's values
        attention_input = block.layer_norm(maps["x"]) if block.pre_norm else maps["x"]
        values = (attention_input @ layout.value_projection(block.layer)).unflatten(-1, (-1, value.shape[-1])).transpose(1, 2)
        values = values.repeat_interleave(value.shape[1] // values.shape[1], dim=1)  # [batch, kv_head, n, d] -> every query head
        bias = value - values  # b_V: the same at every position
        torch.testing.assert_close(bias, bias[:, :, :1].expand_as(bias), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", EVERY_LAYOUT)
def test_the_final_norm_makes_transformers_last_hidden_state(name):
    run = tiny_run(name)
    norm = layout_named(name).final_norm(run.model.base_model)
    last = run.layers[-1]["output"]
    torch.testing.assert_close(last if norm is None else norm(last), run.hidden_states[-1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", EVERY_LAYOUT)
def test_the_norm_gain_is_what_each_norm_multiplies_by(name):
    """``(N(z) - N(-z)) / 2`` is ``g z / rms(z)`` for an RMS norm and ``g (z - mean z) / std(z)`` for a layer norm (its bias and
    its epsilon aside: ``z`` is large; OLMo's in float32); a norm without a gain (OLMo's, OLMo 2's missing one) multiplies by 1."""
    run, layout = tiny_run(name), layout_named(name)
    norms = [maps["block"].layer_norm for maps in run.layers] + [layout.final_norm(run.model.base_model)]
    z = 100 * torch.randn(5, run.layers[0]["x"].shape[-1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for norm in filter(None, norms):
        gain = layout.norm_gain(norm)
        odd = (norm(z) - norm(-z)) / 2
        centred = z - z.mean(-1, keepdim=True)
        shapes = [z / z.square().mean(-1, keepdim=True).sqrt(), centred / centred.square().mean(-1, keepdim=True).sqrt()]
        if gain is None:
            shapes.append(z)  # no norm at all (OLMo 2's before its attention)
        gain = 1.0 if gain is None else gain.detach()
        assert any(torch.allclose(odd, gain * shape, rtol=0, atol=1e-5) for shape in shapes), (name, type(norm).__name__)
