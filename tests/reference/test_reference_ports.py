"""The numpy ports of ALTI and value zeroing (tests/reference/alti.py, tests/reference/value_zeroing.py) are sound on
tiny random float64 BERT, RoBERTa and DistilBERT models: their layer arithmetic reproduces what transformers computes
(hidden states, and module outputs caught with forward hooks), a token whose value vectors are zero gets no
contribution, and rows sum to 1. These are the references a bertology implementation is later held to."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel, DistilBertConfig, DistilBertModel, RobertaConfig, RobertaModel

from .alti import alti, alti_layer, l_transform, pairwise_distance
from .encoder import embeddings, hidden_states, layer_forward, layer_weights, values
from .value_zeroing import cosine_distances_diagonal, value_zeroing, value_zeroing_layer, zeroed_output

KINDS = ("bert", "roberta", "distilbert")
IDS = np.array([0, 7, 12, 5, 30, 9, 44, 2])  # no 1: RoBERTa's padding id
TIGHT = 1e-10


def tiny(kind: str, seed: int = 0, layer_norm_eps: float = 1e-12):
    """A 2-layer, 4-head, 32-wide model of ``kind`` with every parameter redrawn (so biases, layer norm weights and
    attention are far from their initial values), float64, eval mode."""
    common = dict(vocab_size=50, max_position_embeddings=70)
    if kind == "bert":
        model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     layer_norm_eps=layer_norm_eps, **common), add_pooling_layer=False)
    elif kind == "roberta":
        model = RobertaModel(RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                           layer_norm_eps=layer_norm_eps, pad_token_id=1, **common), add_pooling_layer=False)
    else:
        model = DistilBertModel(DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, **common))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name, parameter in module.named_parameters(recurse=False):
                noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                if isinstance(module, torch.nn.LayerNorm):
                    parameter.copy_(1.0 + 0.2 * noise if name == "weight" else 0.2 * noise)
                else:
                    parameter.copy_(0.2 * noise)
    return model.double().eval()


def attention_block_modules(model):
    """The module whose output is the attention block's output after its layer norm, per layer."""
    if model.config.model_type == "distilbert":
        return [layer.sa_layer_norm for layer in model.transformer.layer]
    return [layer.attention.output for layer in model.encoder.layer]


def value_modules(model):
    if model.config.model_type == "distilbert":
        return [layer.attention.v_lin for layer in model.transformer.layer]
    return [layer.attention.self.value for layer in model.encoder.layer]


def hf_run(model, ids=IDS, hooks=()):
    """transformers' own forward: hidden states ``[layer + 1, n, d]`` and the attention blocks' outputs ``[layer, n, d]``."""
    caught = {}
    handles = [module.register_forward_hook(lambda m, i, o, index=index: caught.__setitem__(index, o[0] if isinstance(o, tuple) else o))
               for index, module in enumerate(attention_block_modules(model))]
    handles += [module.register_forward_hook(hook) for module, hook in hooks]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor(ids).reshape(1, -1), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    states = np.stack([state[0].numpy() for state in out.hidden_states])
    assert sorted(caught) == list(range(len(states) - 1))
    blocks = np.stack([caught[index][0].numpy() for index in range(len(caught))])
    return states, blocks


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    return tiny(request.param)


def test_the_numpy_layers_reproduce_transformers_hidden_states(model):
    states, blocks = hf_run(model)
    assert states.dtype == np.float64
    ours = hidden_states(model, IDS)
    np.testing.assert_allclose(ours, states, rtol=0, atol=TIGHT)
    for layer, w in enumerate(layer_weights(model)):
        np.testing.assert_allclose(layer_forward(ours[layer], w)["attention"], blocks[layer], rtol=0, atol=TIGHT)


@pytest.mark.parametrize("ln_eps", ["authors", "model"])
def test_alti_decomposition_sums_to_the_attention_block_output(model, ln_eps):
    """sum_j T_i(x_j) + L(b_O) s_i + beta is the attention block's output after its layer norm, as transformers has it."""
    states, blocks = hf_run(model)
    for layer, w in enumerate(layer_weights(model)):
        result = alti_layer(states[layer], w, ln_eps=ln_eps)
        np.testing.assert_allclose(result.transformed.sum(axis=1) + result.bias_term, result.resultant, rtol=0, atol=1e-12)
        np.testing.assert_allclose(result.resultant, blocks[layer], rtol=0, atol=TIGHT)
        assert np.abs(result.resultant - blocks[layer]).max() < TIGHT


def test_the_authors_layer_norm_scale_ignores_eps():
    """``(pre_ln + eps).std()`` is ``std(pre_ln)``: with RoBERTa-base's eps 1e-5 the authors' y_i misses ln1's output by far
    more than 1e-8, and the real scale ``1 / sqrt(var + eps)`` (``ln_eps='model'``) hits it."""
    model = tiny("roberta", seed=1, layer_norm_eps=1e-5)
    states, blocks = hf_run(model)
    w = layer_weights(model)[0]
    exact = alti_layer(states[0], w, ln_eps="model")
    authors = alti_layer(states[0], w, ln_eps="authors")
    assert np.abs(exact.resultant - blocks[0]).max() < TIGHT
    assert np.abs(authors.resultant - blocks[0]).max() > 1e-8
    pre_ln = layer_forward(states[0], w)["pre_ln1"]
    scale = np.std(pre_ln, axis=-1) * np.sqrt(np.var(pre_ln, axis=-1) + w.ln1_eps) ** -1
    np.testing.assert_allclose((authors.resultant - w.ln1_beta) * scale[:, None], exact.resultant - w.ln1_beta, rtol=0, atol=1e-12)


def test_value_zeroing_with_nothing_zeroed_is_the_layer_output(model):
    states, _ = hf_run(model)
    for layer, w in enumerate(layer_weights(model)):
        x = states[layer]
        np.testing.assert_allclose(layer_forward(x, w, value=values(x, w))["output"], states[layer + 1], rtol=0, atol=TIGHT)


def test_value_zeroing_matches_transformers_with_the_values_zeroed_by_a_hook(model):
    """The zeroed layer output equals transformers' own forward with the value projection's output for token t zeroed
    in layer l (all heads, or one head's slice), the layers before untouched."""
    weights = layer_weights(model)
    states, _ = hf_run(model)
    dh = weights[0].head_dim
    for layer, module in enumerate(value_modules(model)):
        for token in (0, 3, len(IDS) - 1):
            for head in (None, 2):
                columns = slice(None) if head is None else slice(head * dh, (head + 1) * dh)

                def zero(module, inputs, output, token=token, columns=columns):
                    output = output.clone()
                    output[:, token, columns] = 0.0
                    return output

                zeroed, _ = hf_run(model, hooks=[(module, zero)])
                np.testing.assert_allclose(zeroed[:layer + 1], states[:layer + 1], rtol=0, atol=0)
                assert np.abs(zeroed[layer + 1] - states[layer + 1]).max() > 1e-3
                ours = zeroed_output(states[layer], weights[layer], token, head)
                np.testing.assert_allclose(ours, zeroed[layer + 1], rtol=0, atol=TIGHT)


@pytest.mark.parametrize("kind", KINDS)
def test_a_token_whose_values_are_zero_contributes_nothing(kind):
    """Layer 0's W_V projected off token j's input vector and b_V = 0: v_j = 0 in every head. ALTI gives j nothing in
    any other token's row (its own row keeps the residual); value zeroing gives it 0 in every row and head."""
    model = tiny(kind, seed=2)
    j = 4
    x = embeddings(model, IDS)
    unit = torch.as_tensor(x[j] / np.linalg.norm(x[j]))
    projection = torch.eye(unit.shape[0], dtype=torch.float64) - torch.outer(unit, unit)
    value = value_modules(model)[0]
    with torch.no_grad():
        value.weight.copy_(value.weight @ projection)
        value.bias.zero_()
    w = layer_weights(model)[0]
    assert np.abs(values(x, w)[:, j]).max() < 1e-13

    others = [i for i in range(len(IDS)) if i != j]
    exact = alti_layer(x, w, ln_eps="model", distance_eps=0.0)
    assert np.abs(exact.transformed[others, j]).max() < 1e-13
    assert np.abs(exact.contributions[others, j]).max() < 1e-12
    assert exact.contributions[j, j] > 0.1
    # the authors' eps=1e-6 inside pairwise_distance leaves at most d * 1e-6 before normalisation
    authors = alti(model, IDS)
    layer0 = authors.layers[0]
    d = x.shape[1]
    unnormalised = np.clip(layer0.importance + np.abs(layer0.resultant).sum(axis=-1)[:, None], 0, None)
    assert unnormalised[others, j].max() <= d * 1e-6
    np.testing.assert_allclose(unnormalised / unnormalised.sum(axis=-1, keepdims=True), layer0.contributions, rtol=0, atol=1e-15)

    result = value_zeroing(model, IDS)
    assert np.abs(result.layers_raw[0][:, j]).max() < 1e-13
    assert np.abs(result.layers[0][:, j]).max() < 1e-12
    assert np.abs(result.heads[0][:, :, j]).max() < 1e-12
    assert result.layers[1][:, j].min() > 0  # only layer 0's values were zeroed


def test_rows_sum_to_one(model):
    contributions = alti(model, IDS)
    exact = alti(model, IDS, ln_eps="model", distance_eps=0.0)
    zeroing = value_zeroing(model, IDS)
    for maps in (contributions.contributions, contributions.rollout, exact.contributions, exact.rollout,
                 zeroing.layers, zeroing.rollout, zeroing.heads):
        assert np.all(maps >= 0)
        np.testing.assert_allclose(maps.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
    assert contributions.contributions.shape == contributions.rollout.shape == (2, len(IDS), len(IDS))
    assert zeroing.heads.shape == (2, 4, len(IDS), len(IDS))
    np.testing.assert_allclose(contributions.rollout[1], contributions.contributions[1] @ contributions.contributions[0], rtol=0, atol=1e-15)
    np.testing.assert_allclose(zeroing.rollout[1], zeroing.layers[1] @ zeroing.layers[0], rtol=0, atol=1e-15)


def test_value_zeroing_layer_recomputes_the_original_when_not_given(model):
    weights = layer_weights(model)
    states = hidden_states(model, IDS, weights)
    np.testing.assert_allclose(value_zeroing_layer(states[1], weights[1]), value_zeroing_layer(states[1], weights[1], states[2]), rtol=0, atol=0)


def test_the_primitives_are_torch_s_and_sklearn_s():
    rng = np.random.default_rng(0)
    a, b, gamma = rng.normal(size=(5, 6, 7)), rng.normal(size=(5, 1, 7)), rng.normal(size=7)
    for p in (1.0, 2.0):
        expected = torch.nn.functional.pairwise_distance(torch.as_tensor(a), torch.as_tensor(b), p=p).numpy()
        np.testing.assert_allclose(pairwise_distance(a, b, p=p), expected, rtol=1e-14, atol=0)
    np.testing.assert_allclose(l_transform(a, gamma), (a - a.mean(-1, keepdims=True)) * gamma, rtol=0, atol=1e-14)
    sklearn = pytest.importorskip("sklearn.metrics.pairwise")
    x, y = rng.normal(size=(6, 9)), rng.normal(size=(6, 9))
    np.testing.assert_allclose(cosine_distances_diagonal(x, y), sklearn.cosine_distances(x, y).diagonal(), rtol=0, atol=1e-15)
