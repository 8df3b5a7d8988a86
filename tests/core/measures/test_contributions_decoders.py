"""ALTI and value zeroing on decoders (bertology.core.measures.contributions; docs/methods.md#decoders), on a tiny float64 model of every
decoder layout bertology serves, against independent computations:

- value zeroing against transformers' own layer, rerun (the whole model, forward) with token t's value vectors set to zero
  in every head, or in one, and that layer's output read with a forward hook (tests/reference/rerun.py): what bertology's
  ``rest_of_layer`` must reproduce;
- ALTI against numpy loops over the definition, whose decomposition is first checked to add up to the block's real output
  (``x`` from transformers' hidden states plus the attention module's own output, times Granite's multiplier or through Gemma
  2's and OLMo 2's norm, or OPT-350m's layer norm of them).

Every bias and norm weight is random (``randomise_biases_and_norms``): a model built from its configuration has zero biases
and unit norms, under which a wrong bias or a wrong norm in bertology's code would give the same maps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import float64_model, randomise_biases_and_norms, tiny_decoder_configs
from reference.rerun import rows_summing_to_one, value_zeroing_by_rerun

from bertology.core.engine import PassNeeds
from bertology.core.measures.contributions import alti_contributions, alti_per_head, value_zeroing
from bertology.core.model.hooks import Hooks, register_attention
from bertology.core.model.models import attention_blocks

DECODERS = list(tiny_decoder_configs())
LENGTHS = (9, 6)  # a padded batch: the second sequence is 3 shorter


def tiny_decoder(kind: str):
    from transformers import AutoModelForCausalLM

    register_attention()
    torch.manual_seed(0)
    model = randomise_biases_and_norms(AutoModelForCausalLM.from_config(tiny_decoder_configs()[kind]))  # a wrong bias or norm shows
    model.config._attn_implementation = "bertology"
    return model.double().eval().requires_grad_(False)


def padded_batch():
    rng = np.random.default_rng(1)
    ids = torch.tensor(rng.integers(3, 100, size=(len(LENGTHS), max(LENGTHS))))
    mask = torch.tensor([[1] * n + [0] * (max(LENGTHS) - n) for n in LENGTHS])
    return ids, mask


def captured(model, ids: torch.Tensor, mask: torch.Tensor) -> list[dict]:
    """Per layer: the pattern (padding rows zeroed), values and head outputs at bertology's hook points; ``x``, the layer's input,
    from transformers' hidden states; ``attention_output``, what the attention module returned (``W_O``-projected, ``+ b_O``)."""
    layers: list[dict] = []
    hooks = (Hooks().add("value", lambda layer, t: layers.append({"value": t.clone()}))
             .add("pattern", lambda layer, t: layers[-1].__setitem__("pattern", t.clone()))
             .add("head_output", lambda layer, t: layers[-1].__setitem__("head_output", t.clone())))
    attention_outputs = []
    handles = [block.attention.register_forward_hook(lambda m, args, out: attention_outputs.append(out[0].clone()))
               for block in attention_blocks(model)]
    try:
        with torch.no_grad(), hooks.attach(model):
            states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    finally:
        for handle in handles:
            handle.remove()
    for layer, maps in enumerate(layers):
        maps["pattern"] *= mask[:, None, :, None]
        maps.update(x=states[layer], attention_output=attention_outputs[layer])
    return layers


def tiny_decoder_run(kind: str):
    """The tiny ``kind`` decoder, the padded batch, its blocks and what :func:`captured` takes from each layer."""
    model = tiny_decoder(kind)
    ids, mask = padded_batch()
    return model, ids, mask, attention_blocks(model), captured(model, ids, mask)


@pytest.mark.parametrize("kind", DECODERS)
def test_value_zeroing_equals_transformers_own_layer_rerun_with_a_tokens_values_zeroed(kind):
    model, ids, mask, blocks, layers = tiny_decoder_run(kind)
    heads = layers[0]["value"].shape[1]
    for layer, (block, maps) in enumerate(zip(blocks, layers)):
        arguments = (maps["pattern"], maps["value"], maps["head_output"], maps["x"], block)
        whole, per_head = value_zeroing(*arguments), value_zeroing(*arguments, per_head=True)
        for b, n in enumerate(LENGTHS):
            expected, expected_heads = value_zeroing_by_rerun(model, layer, ids, mask, b, n, heads, causal=True)
            np.testing.assert_allclose(whole[b, :n, :n].numpy(), expected, atol=1e-8, rtol=0)
            np.testing.assert_allclose(per_head[b, :, :n, :n].numpy(), expected_heads, atol=1e-8, rtol=0)
            assert not whole[b, :, n:].any() and not whole[b, n:].any() and not per_head[b, :, n:].any()
            assert not torch.triu(whole[b], 1).any() and not torch.triu(per_head[b], 1).any()  # exactly 0: nobody sees the future


def rms_norm_after_attention(kind: str, block) -> tuple[np.ndarray, float] | None:
    """``(g, eps)`` of the RMS norm Gemma 2 and OLMo 2 apply to the attention output before the residual, read from
    transformers' own module (Gemma stores ``g - 1``); None for the others."""
    if kind not in ("gemma2", "olmo2"):
        return None
    norm = block.layer.post_attention_layernorm
    return (norm.weight.numpy() + 1, norm.eps) if kind == "gemma2" else (norm.weight.numpy(), norm.variance_epsilon)


def alti_by_hand(maps: dict, block, b: int, n: int, rms=None) -> tuple[np.ndarray, np.ndarray]:
    """ALTI in numpy loops (docs/methods.md#decoders): ``T_i(x_j) = sum_h a_h[i, j] v_j^h W_O^h + [i == j] x_i``, ``y_i = sum_j
    T_i(x_j) + b_O`` in a pre-norm block (Granite: the attention's part times its multiplier; Gemma 2, OLMo 2: through the RMS
    norm ``rms = (g, eps)``'s linear part with the real scale); in a post-norm one (OPT-350m) both through the layer norm's
    linear part with the real scale, ``y_i`` its output. Returns the contributions ``[n, n]`` and ``y`` ``[n, hidden]``."""
    pattern, value, x = maps["pattern"][b].numpy(), maps["value"][b].numpy(), maps["x"][b].numpy()
    heads, head_dim = value.shape[0], value.shape[-1]
    multiplier = getattr(block.layer, "residual_multiplier", 1.0)  # Granite's, as its decoder layer applies it
    w_o = block.output_weight.detach().numpy() * multiplier
    b_o = block.output_bias.detach().numpy() * multiplier if block.output_bias is not None else np.zeros(x.shape[-1])
    vectors = [value[h, :n] @ w_o[h * head_dim:(h + 1) * head_dim] for h in range(heads)]  # m v_j^h W_O^h
    contributions, resultants = np.zeros((n, n)), np.zeros((n, x.shape[-1]))
    for i in range(n):
        parts = np.stack([sum(pattern[h, i, j] * vectors[h][j] for h in range(heads)) for j in range(n)])  # the attention's, by token
        if rms is not None:
            gain, eps = rms
            scale = np.sqrt(np.mean((parts.sum(axis=0) + b_o) ** 2) + eps)
            parts, y = gain * parts / scale, x[i] + gain * (parts.sum(axis=0) + b_o) / scale
        else:
            y = x[i] + parts.sum(axis=0) + b_o
        parts[i] += x[i]
        if not block.pre_norm:
            gamma, beta = block.layer_norm.weight.numpy(), block.layer_norm.bias.numpy()
            scale = np.sqrt(np.var(y) + block.layer_norm.eps)
            parts = gamma * (parts - parts.mean(-1, keepdims=True)) / scale
            y = gamma * (y - y.mean()) / scale + beta
        row = np.maximum(0, np.abs(y).sum() - np.abs(y - parts).sum(axis=-1))
        contributions[i], resultants[i] = rows_summing_to_one(row), y
    return contributions, resultants


def alti_per_head_by_hand(maps: dict, block, b: int, n: int, rms=None) -> np.ndarray:
    """bertology's per-head variant in numpy loops: ``T^h_i(x_j) = a_h[i, j] v_j^h W_O^h`` (post-norm: through the layer norm's
    linear part, scaled by the real ``s_i``; Gemma 2, OLMo 2: times the RMS norm's gain g, over the real RMS), ``y^h_i = sum_j
    T^h_i(x_j)``, no residual."""
    pattern, value, x = maps["pattern"][b].numpy(), maps["value"][b].numpy(), maps["x"][b].numpy()
    heads, head_dim = value.shape[0], value.shape[-1]
    w_o = block.output_weight.detach().numpy()
    b_o = block.output_bias.detach().numpy() if block.output_bias is not None else 0
    result = np.zeros((heads, n, n))
    for h in range(heads):
        vectors = value[h, :n] @ w_o[h * head_dim:(h + 1) * head_dim]
        for i in range(n):
            parts = pattern[h, i, :n, None] * vectors
            total = sum(pattern[g, i, :n] @ (value[g, :n] @ w_o[g * head_dim:(g + 1) * head_dim]) for g in range(heads)) + b_o
            if rms is not None:
                parts = rms[0] * parts / np.sqrt(np.mean(total ** 2) + rms[1])
            if not block.pre_norm:
                parts = block.layer_norm.weight.numpy() * (parts - parts.mean(-1, keepdims=True)) / np.sqrt(np.var(total + x[i]) + block.layer_norm.eps)
            y = parts.sum(axis=0)
            row = np.maximum(0, np.abs(y).sum() - np.abs(y - parts).sum(axis=-1))
            result[h, i] = rows_summing_to_one(row)
    return result


def real_block_output(kind: str, block, x: torch.Tensor, attention_output: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The block's output as transformers has it, from the layer input ``x`` and the attention's own output (``W_O``-projected,
    ``+ b_O``): the residual stream after the attention branch (Granite: times its multiplier; Gemma 2, OLMo 2: through the
    RMS norm, which transformers runs in float32, hence a tolerance of 1e-6 rather than 1e-10), then, in a post-norm block,
    the layer norm's output."""
    attention_output, tolerance = getattr(block.layer, "residual_multiplier", 1.0) * attention_output, 1e-10
    if rms_norm_after_attention(kind, block) is not None:
        attention_output, tolerance = block.layer.post_attention_layernorm(attention_output), 1e-6
    output = x + attention_output
    return (output if block.pre_norm else block.layer_norm(output)), tolerance


@pytest.mark.parametrize("kind", DECODERS)
def test_alti_adds_up_to_the_blocks_real_output_and_equals_numpy(kind):
    _, _, _, blocks, layers = tiny_decoder_run(kind)
    for block, maps in zip(blocks, layers):
        arguments = (maps["pattern"], maps["value"], maps["x"], block)
        contributions, heads = alti_contributions(*arguments), alti_per_head(*arguments)
        torch.testing.assert_close(alti_contributions(*arguments, chunk_elements=1), contributions, rtol=0, atol=0)  # a row at a time
        block_output, tolerance = real_block_output(kind, block, maps["x"], maps["attention_output"])
        rms = rms_norm_after_attention(kind, block)
        for b, n in enumerate(LENGTHS):
            expected, resultant = alti_by_hand(maps, block, b, n, rms)
            np.testing.assert_allclose(resultant, block_output[b, :n].numpy(), atol=tolerance, rtol=0)  # the decomposition is exact
            np.testing.assert_allclose(contributions[b, :n, :n].numpy(), expected, atol=1e-10, rtol=0)
            np.testing.assert_allclose(heads[b, :, :n, :n].numpy(), alti_per_head_by_hand(maps, block, b, n, rms), atol=1e-10, rtol=0)
            assert not torch.triu(contributions[b], 1).any() and not torch.triu(heads[b], 1).any()


def test_a_token_whose_values_are_zero_contributes_nothing_on_a_decoder_under_both():
    _, _, _, blocks, layers = tiny_decoder_run("llama")
    block, maps = blocks[0], layers[0]
    maps["value"][:, :, 2] = 0
    maps["head_output"] = maps["pattern"] @ maps["value"]
    contributions = alti_contributions(maps["pattern"], maps["value"], maps["x"], block)
    zeroing = value_zeroing(maps["pattern"], maps["value"], maps["head_output"], maps["x"], block)
    later = list(range(3, LENGTHS[0]))  # the tokens that see token 2, but itself
    assert torch.all(zeroing[0, :, 2] < 1e-9) and torch.all(zeroing[0, later].sum(-1) > 0.999)
    assert torch.all(contributions[0, later, 2] == 0) and contributions[0, 2, 2] > 0  # token 2 keeps its own residual only


def saved_decoder(kind: str, folder, tiny_decoder_dirs):
    """A model folder: the tiny ``kind`` decoder (random biases and norms) with the byte-level tokenizer of the tiny GPT-2, or
    of the tiny Llama (BOS first) for ``llama``."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_decoder_dirs["llama" if kind == "llama" else "gpt2"]
    shutil.copytree(source, folder)
    config = tiny_decoder_configs()[kind]
    config.vocab_size = len(AutoTokenizer.from_pretrained(source))
    torch.manual_seed(0)
    randomise_biases_and_norms(AutoModelForCausalLM.from_config(config)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gpt_neox", "phi", "opt_post_norm", "granite"])
def test_the_engine_hands_out_on_a_padded_decoder_batch_what_each_sequence_gives_alone(kind, tiny_decoder_dirs, tmp_path):
    # the residual x the engine captures (the layer's input where pre-norm, the attention's where post-norm, as a keyword in
    # OPT's) and its padded batch: each sequence's maps equal those of the measures on that sequence alone, x from transformers
    from conftest import tiny_examples

    from bertology.core.engine import Engine, RunStats

    loaded = float64_model(saved_decoder(kind, tmp_path / kind, tiny_decoder_dirs))
    loaded.model.requires_grad_(False)
    engine = Engine(loaded, progress=False)
    items = list(engine.encode(enumerate(tiny_examples()[:4]), RunStats()))
    assert len({len(item) for item in items}) > 1
    together = engine.run_batch(items, needs=PassNeeds(contributions=("alti", "value_zeroing"), views=("alti", "value-zeroing")))
    blocks = attention_blocks(loaded.model)
    for b, item in enumerate(items):
        n, ids = len(item), torch.tensor([item.input_ids])
        alone = captured(loaded.model, ids, torch.ones_like(ids))
        for layer, (block, maps) in enumerate(zip(blocks, alone)):
            expected = {"alti": alti_contributions(maps["pattern"], maps["value"], maps["x"], block),
                        "value_zeroing": value_zeroing(maps["pattern"], maps["value"], maps["head_output"], maps["x"], block)}
            views = {"alti": alti_per_head(maps["pattern"], maps["value"], maps["x"], block),
                     "value-zeroing": value_zeroing(maps["pattern"], maps["value"], maps["head_output"], maps["x"], block, per_head=True)}
            for measure, maps_alone in expected.items():
                torch.testing.assert_close(together.contributions[measure][layer, b, :n, :n], maps_alone[0], atol=1e-9, rtol=0)
                assert not together.contributions[measure][layer, b, n:].any()
            for view, maps_alone in views.items():
                torch.testing.assert_close(together.weighted(view).attentions[layer, b, :, :n, :n], maps_alone[0], atol=1e-9, rtol=0)
                assert not together.view_maps[view][layer, b, :, n:].any()
