"""The layout contract (bertology.core.model.layouts), run for every registered layout on a tiny float64 model whose biases and norm
weights are random, as transformers' ``ModelTesterMixin`` runs its rules for every model; one test per rule, ids by layout:

- the layer list (``layer_modules``, ablation's) is the model's: its calls, in order, take transformers' hidden states;
- ``W_O`` rebuilds the attention output (the output projection's own) from the per-head contexts at the ``head_output`` hook;
- the rest of the layer (``rest_of_layer``, value zeroing's) rebuilds the layer's output from the attention output and ``x``;
- ALTI's resultant equals the block's real output, and bertology's ALTI the numpy loops of
  tests/core/measures/test_contributions_decoders.py;
- the maps equal transformers' eager attention's (``attn_implementation="eager"``, ``output_attentions=True``).

Every registered layout has a tiny model here (a new one cannot skip the contract), and the new architecture, StableLM, runs
end to end from the command line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest
import torch
from conftest import TEXTS, randomise_biases_and_norms, tiny_decoder_configs, tiny_encoder_configs
from test_cli import bertology

from bertology.core.errors import ModelError
from bertology.core.measures.contributions import alti_contributions, alti_per_head
from bertology.core.model.hooks import Hooks, register_attention
from bertology.core.model.interventions import layer_modules
from bertology.core.model.kinds import DECODER, ENCODER, kind_of
from bertology.core.model.layouts import LAYOUTS, Layout
from bertology.core.model.models import attention_blocks
from core.measures.test_contributions_decoders import (
    LENGTHS,
    alti_by_hand,
    alti_per_head_by_hand,
    padded_batch,
    real_block_output,
    rms_norm_after_attention,
    saved_decoder,
    tiny_decoder,
)

ENCODERS, DECODERS = tiny_encoder_configs(), tiny_decoder_configs()
TINY = {**ENCODERS, **DECODERS}


def layout_named(name: str) -> Layout:
    return LAYOUTS[TINY[name].model_type]


#: Every tiny model, its test id the layout's class and the model's name (``LlamaLayout-mistral``).
EVERY_LAYOUT = [pytest.param(name, id=f"{type(layout_named(name)).__name__}-{name}") for name in TINY]


def tiny_model(name: str):
    """The tiny ``name`` model, float64, with random biases and norms and bertology's attention (a decoder: the causal LM)."""
    from transformers import AutoModel

    if name in DECODERS:
        return tiny_decoder(name)
    register_attention()
    torch.manual_seed(0)
    model = randomise_biases_and_norms(AutoModel.from_config(ENCODERS[name]))
    model.config._attn_implementation = "bertology"
    return model.double().eval().requires_grad_(False)


@dataclass
class Run:
    """One forward pass of a tiny model on the padded batch: per attention layer (``layers``) the pattern (padding rows
    zeroed), values and per-head contexts at bertology's hook points, the output projection's input and output
    (``attention_output``: ``W_O``-projected, ``+ b_O``), and the layer module's call (``x``, its input, and ``output``);
    ``called``, the layer modules in call order; ``hidden_states``, transformers' own."""

    model: torch.nn.Module
    ids: torch.Tensor
    mask: torch.Tensor
    layers: list[dict]
    called: list[torch.nn.Module]
    hidden_states: tuple[torch.Tensor, ...]


def first(output):
    return output[0] if isinstance(output, tuple) else output


@cache
def tiny_run(name: str) -> Run:
    model = tiny_model(name)
    ids, mask = padded_batch()
    blocks = attention_blocks(model)
    layers = [{"block": block} for block in blocks]
    projections, calls, called = [], [], []
    hooks = (Hooks().add("pattern", lambda layer, t: layers[layer].__setitem__("pattern", t.clone()))
             .add("value", lambda layer, t: layers[layer].__setitem__("value", t.clone()))
             .add("head_output", lambda layer, t: layers[layer].__setitem__("head_output", t.clone())))

    def on_layer(module, args, kwargs, output):
        called.append(module)
        calls.append({"x": (args[0] if args else kwargs["hidden_states"]).clone(), "output": first(output).clone()})

    handles = [module.register_forward_hook(on_layer, with_kwargs=True) for module in {id(m): m for m in layer_modules(model)}.values()]
    handles += [module.register_forward_hook(lambda m, args, output: projections.append({"contexts": args[0].clone(), "attention_output": output.clone()}))
                for module in {id(block.output): block.output for block in blocks}.values()]  # ALBERT's layers share one: a call per layer
    try:
        with torch.no_grad(), hooks.attach(model):
            hidden_states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    finally:
        for handle in handles:
            handle.remove()
    for maps, projection, call in zip(layers, projections, calls, strict=True):
        maps["pattern"] *= mask[:, None, :, None]
        maps.update(projection, **call)
    return Run(model, ids, mask, layers, called, hidden_states)


def test_every_registered_layout_has_a_tiny_model_in_the_contract():
    served = {type(layout_named(name)) for name in TINY}
    missing = sorted(type(layout).__name__ for layout in LAYOUTS.values() if type(layout) not in served)
    assert not missing, f"layouts with no tiny model in tests/conftest.py (tiny_encoder_configs, tiny_decoder_configs): {missing}"


@pytest.mark.parametrize("name", EVERY_LAYOUT)
def test_the_kind_is_the_models(name):
    layout = layout_named(name)
    assert layout.kind is kind_of(TINY[name])
    assert layout.kind == (DECODER if name in DECODERS else ENCODER)


@pytest.mark.parametrize("name", EVERY_LAYOUT)
def test_the_layer_list_is_the_models_layers(name):
    run = tiny_run(name)
    modules = layer_modules(run.model)
    assert len({id(module) for module in modules}) == len(modules)  # a shared layer (ALBERT's) appears once
    assert [id(module) for module in dict.fromkeys(run.called)] == [id(module) for module in modules]  # in call order
    assert len(run.called) == len(run.layers) == run.model.config.num_hidden_layers
    assert all(maps["block"].layer is module for maps, module in zip(run.layers, run.called))
    for layer, maps in enumerate(run.layers):  # each call reads the model's hidden state l, and gives l + 1 (the last: before any final norm)
        torch.testing.assert_close(maps["x"], run.hidden_states[layer], rtol=0, atol=0)
        if layer + 1 < len(run.layers):
            torch.testing.assert_close(maps["output"], run.hidden_states[layer + 1], rtol=0, atol=0)


@pytest.mark.parametrize("name", EVERY_LAYOUT)
def test_w_o_rebuilds_the_attention_output_from_the_per_head_contexts(name):
    for maps in tiny_run(name).layers:
        block, contexts = maps["block"], maps["head_output"]  # [batch, head, n, head_dim]
        concatenated = contexts.transpose(1, 2).flatten(2)  # the heads side by side, in order
        torch.testing.assert_close(concatenated, maps["contexts"], rtol=0, atol=0)
        rebuilt = concatenated @ block.output_weight + (block.output_bias if block.output_bias is not None else 0)
        torch.testing.assert_close(rebuilt, maps["attention_output"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", EVERY_LAYOUT)
def test_the_rest_of_the_layer_rebuilds_the_layers_output(name):
    for maps in tiny_run(name).layers:
        torch.testing.assert_close(maps["block"].rest_of_layer(maps["attention_output"], maps["x"]), maps["output"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", EVERY_LAYOUT)
def test_altis_resultant_is_the_blocks_real_output(name):
    for maps in tiny_run(name).layers:
        block = maps["block"]
        block_output, tolerance = real_block_output(name, block, maps["x"], maps["attention_output"])
        rms = rms_norm_after_attention(name, block)
        arguments = (maps["pattern"], maps["value"], maps["x"], block)
        contributions, heads = alti_contributions(*arguments), alti_per_head(*arguments)
        for b, n in enumerate(LENGTHS):
            expected, resultant = alti_by_hand(maps, block, b, n, rms)
            np.testing.assert_allclose(resultant, block_output[b, :n].numpy(), atol=tolerance, rtol=0)
            np.testing.assert_allclose(contributions[b, :n, :n].numpy(), expected, atol=1e-10, rtol=0)
            np.testing.assert_allclose(heads[b, :, :n, :n].numpy(), alti_per_head_by_hand(maps, block, b, n, rms), atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", EVERY_LAYOUT)
def test_the_maps_are_transformers_eager_maps(name, monkeypatch):
    # transformers' eager attention takes the softmax in float32 for most decoders; here in the model's float64, so that the
    # maps agree to 1e-10 and any other difference (a mask, a scale, a soft cap) shows
    run = tiny_run(name)
    softmax = torch.nn.functional.softmax
    monkeypatch.setattr(torch.nn.functional, "softmax", lambda scores, dim=None, _stacklevel=3, dtype=None: softmax(scores, dim=dim))
    run.model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            reference = run.model(input_ids=run.ids, attention_mask=run.mask, output_attentions=True).attentions
    finally:
        run.model.config._attn_implementation = "bertology"
    assert len(reference) == len(run.layers)
    for expected, maps in zip(reference, run.layers):
        for b, n in enumerate(LENGTHS):
            np.testing.assert_allclose(maps["pattern"][b, :, :n, :n].numpy(), expected[b, :, :n, :n].numpy(), atol=1e-10, rtol=0)


def test_a_model_type_no_layout_serves_is_refused_in_one_line():
    class Unknown(torch.nn.Module):
        config = type("Config", (), {"model_type": "mystery"})()

    with pytest.raises(ModelError, match=r"^Unknown: bertology does not know where this model keeps its layers$"):
        layer_modules(Unknown())
    with pytest.raises(ModelError, match=r"know the attention blocks of albert, bert, .*, not of 'mystery' models$"):
        attention_blocks(Unknown())


def test_two_layouts_cannot_serve_one_model_type():
    before = dict(LAYOUTS)
    with pytest.raises(TypeError, match="both serve 'bert' models"):
        type("Again", (Layout,), {"model_types": frozenset({"a-new-type", "bert"})})
    assert LAYOUTS == before


@pytest.mark.parametrize("name", ["stablelm", "stablelm_parallel"])
def test_the_new_layout_runs_end_to_end_from_the_command_line(name, tiny_decoder_dirs, tmp_path):
    # StableLM, added as one file (core/model/layouts/stablelm.py) and its tiny configurations: analyze with ALTI and value zeroing
    folder = saved_decoder(name, tmp_path / name, tiny_decoder_dirs)
    corpus, out = tmp_path / "corpus.txt", tmp_path / "run"
    corpus.write_text("\n".join(TEXTS) + "\n")
    result = bertology("analyze", "--model", folder, "--corpus", corpus, "--device", "cpu", "-q", "--out", out,
                       "--contributions", "alti,value-zeroing")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["model"]["model_type"] == "stablelm" and manifest["model"]["kind"] == "decoder"
    assert (out / "report.html").is_file() and (out / "heads.csv").is_file()


@pytest.mark.parametrize("name", [pytest.param(name, id=f"{type(layout_named(name)).__name__}-{name}") for name in DECODERS])
def test_the_engines_hidden_states_are_transformers_own(name, tiny_decoder_dirs, tmp_path):
    # each layer's input x copied as the pass goes, then the model's last hidden state: transformers' output_hidden_states,
    # on a padded batch (the engine asks transformers for none)
    from bertology.core.engine import Engine, PassNeeds, RunStats
    from bertology.core.model.models import load_model
    from bertology.core.text.corpora import Example

    loaded = load_model(saved_decoder(name, tmp_path / name, tiny_decoder_dirs), device="cpu")
    engine = Engine(loaded, batch_size=2, progress=False)
    items = list(engine.encode(enumerate([Example(text) for text in TEXTS[:2]]), RunStats()))
    assert len({len(item) for item in items}) == 2  # padded
    batch = engine.run_batch(items, PassNeeds(hidden_states=True), on_layer=lambda *args: None)
    with torch.inference_mode():
        expected = loaded.model(**engine.model_inputs(engine.collate(items)), output_hidden_states=True, use_cache=False).hidden_states
    assert batch.hidden_states.shape[0] == len(expected) == loaded.num_layers + 1
    for layer, theirs in enumerate(expected):
        torch.testing.assert_close(batch.hidden_states[layer], theirs, rtol=0, atol=0, msg=f"hidden state {layer}")
