"""A head's output z_h read through the layouts equals a recomputation from transformers' own eager attention maps and
values (GPT-2, GPT-NeoX, grouped-query Llama, BERT), and replacing it changes what the output projection reads."""

from __future__ import annotations

import pytest
import torch

from bertology.core.model.head_outputs import HeadOutputs
from bertology.core.model.models import load_model

TEXT = "the cat sat on the mat."


def _values(kind: str, model, layer: int, hidden: torch.Tensor, heads: int) -> torch.Tensor:
    """Layer ``layer``'s values ``[positions, heads, d_head]`` from its input ``hidden``, written from each model's own modules."""
    if kind == "gpt2":
        block = model.transformer.h[layer]
        width = hidden.shape[-1]
        return block.attn.c_attn(block.ln_1(hidden))[..., 2 * width:].reshape(hidden.shape[0], heads, -1)
    if kind == "gpt_neox":
        block = model.gpt_neox.layers[layer]
        qkv = block.attention.query_key_value(block.input_layernorm(hidden)).reshape(hidden.shape[0], heads, -1)
        return qkv.chunk(3, dim=-1)[2]
    if kind == "llama":
        block = model.model.layers[layer]
        kv_heads = model.config.num_key_value_heads
        values = block.self_attn.v_proj(block.input_layernorm(hidden)).reshape(hidden.shape[0], kv_heads, -1)
        return values.repeat_interleave(heads // kv_heads, dim=1)  # transformers' repeat_kv: kv head j serves query heads j*g..
    return model.encoder.layer[layer].attention.self.value(hidden).reshape(hidden.shape[0], heads, -1)


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neox", "llama", "bert"])
def test_z_read_through_the_layout_equals_the_eager_recomputation(kind, tiny_decoder_dirs, tiny_bert_dir):
    folder = tiny_bert_dir if kind == "bert" else tiny_decoder_dirs[kind]
    loaded = load_model(folder, device="cpu", head=None if kind == "bert" else "causal-lm")
    model = loaded.model.double()
    ids = torch.tensor([loaded.tokenizer(TEXT)["input_ids"]])
    heads = HeadOutputs(model)
    with torch.no_grad(), heads.recorded() as seen:
        model(input_ids=ids)
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True, output_hidden_states=True)
            for layer in range(heads.num_layers):
                values = _values(kind, model, layer, out.hidden_states[layer][0], heads.num_heads)
                expected = torch.einsum("hqk,khd->qhd", out.attentions[layer][0], values)
                assert seen[layer].shape == (1, ids.shape[1], heads.num_heads, heads.head_dim)
                torch.testing.assert_close(seen[layer][0], expected, rtol=0, atol=1e-7)  # rotary tables are kept in float32
    finally:
        model.config._attn_implementation = "bertology"
    assert heads.num_heads == model.config.num_attention_heads  # Llama: 4 query heads over 2 key-value heads


def test_replacing_one_heads_slice_reaches_the_projection_and_nothing_else(tiny_gpt2_dir):
    loaded = load_model(tiny_gpt2_dir, device="cpu", head="causal-lm")
    model = loaded.model.double()
    ids = torch.tensor([loaded.tokenizer(TEXT)["input_ids"]])
    heads = HeadOutputs(model)
    seen_inputs = []
    handle = model.transformer.h[1].attn.c_proj.register_forward_hook(lambda module, args, out: seen_inputs.append(args[0].clone()))

    def zero_head_2(layer, z):
        z = z.clone()
        z[..., 2, :] = 0
        return z

    try:
        with torch.no_grad():
            model(input_ids=ids)
            with heads.replaced(zero_head_2, layers=range(1, 2)):
                model(input_ids=ids)
    finally:
        handle.remove()
    plain, replaced = seen_inputs
    d = heads.head_dim
    assert torch.all(replaced[..., 2 * d:3 * d] == 0) and not torch.all(plain[..., 2 * d:3 * d] == 0)
    torch.testing.assert_close(replaced[..., :2 * d], plain[..., :2 * d], rtol=0, atol=0)
