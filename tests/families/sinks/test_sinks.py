"""Attention sinks (docs/methods.md#decoders) against numpy from transformers' own eager maps and the models' own weights,
and a planted sink head found as the one sink."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TEXTS, eager_reference

from bertology.core.engine import Engine
from bertology.core.text.corpora import Example
from bertology.families.sinks.analyzer import AttentionSinks, first_token_norm_share, sink_rates

EXAMPLES = [Example(text) for text in TEXTS] + [Example("the cat sat.", "the dog ran.")]


def run_sinks(loaded, examples=EXAMPLES, batch_size=3) -> AttentionSinks:
    analyzer = AttentionSinks(loaded.kind)
    Engine(loaded, batch_size=batch_size, progress=False).run(examples, [analyzer])
    return analyzer


def received_by_hand(a: np.ndarray) -> np.ndarray:
    """alpha_k = mean over queries i > k of a[i, k], by loops; NaN for the last position."""
    n = a.shape[-1]
    return np.array([np.mean([a[i, k] for i in range(k + 1, n)]) if k < n - 1 else np.nan for k in range(n)])


def layer_norm(x, module):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + module.eps) * module.weight.detach().numpy() + module.bias.detach().numpy()


def gpt2_vectors(loaded, hidden: np.ndarray, layer: int):
    """Keys, values and ||f_h(x_j)|| of GPT-2's layer from its input hidden state, in numpy from the weights."""
    block = loaded.model.h[layer]
    heads, size = loaded.num_heads, loaded.model.config.n_embd
    x = layer_norm(hidden, block.ln_1)
    qkv = x @ block.attn.c_attn.weight.detach().numpy() + block.attn.c_attn.bias.detach().numpy()
    keys = qkv[:, size: 2 * size].reshape(len(x), heads, -1).transpose(1, 0, 2)
    values = qkv[:, 2 * size:].reshape(len(x), heads, -1).transpose(1, 0, 2)
    w_out = block.attn.c_proj.weight.detach().numpy().reshape(heads, size // heads, size)
    transformed = np.linalg.norm(np.einsum("hkd,hde->hke", values, w_out), axis=-1)
    return np.linalg.norm(keys, axis=-1), np.linalg.norm(values, axis=-1), transformed


def test_every_quantity_equals_numpy_on_gpt2(gpt2_64):
    analyzer = run_sinks(gpt2_64)
    table = analyzer.result().set_index(["layer", "head", "quantity"])
    references = eager_reference(gpt2_64, EXAMPLES)
    layers, heads = gpt2_64.num_layers, gpt2_64.num_heads
    expected = {name: np.zeros((len(EXAMPLES), layers, heads)) for name in ("attention", "norm_share", "key_norm_ratio", "value_norm_ratio")}
    for s, reference in enumerate(references):
        for layer in range(layers):
            keys, values, transformed = gpt2_vectors(gpt2_64, reference["hidden"][layer], layer)
            for head in range(heads):
                a = reference["attentions"][layer, head]
                expected["attention"][s, layer, head] = received_by_hand(a)[0]
                weighted = a * transformed[head][None, :]
                shares = weighted / weighted.sum(-1, keepdims=True)
                expected["norm_share"][s, layer, head] = shares[1:, 0].mean()
                expected["key_norm_ratio"][s, layer, head] = keys[head, 0] / keys[head, 1:].mean()
                expected["value_norm_ratio"][s, layer, head] = values[head, 0] / values[head, 1:].mean()
    for name, values in expected.items():
        got = np.array([[table.loc[(layer, head, name), "value"] for head in range(heads)] for layer in range(layers)])
        np.testing.assert_allclose(got, values.mean(0), rtol=1e-10, err_msg=name)
        spread = np.array([[table.loc[(layer, head, name), "ci_high"] for head in range(heads)] for layer in range(layers)]) - got
        from scipy import stats

        half = stats.t.ppf(0.975, len(EXAMPLES) - 1) * values.std(0, ddof=1) / np.sqrt(len(EXAMPLES))
        np.testing.assert_allclose(spread, half, rtol=1e-8, err_msg=f"{name} interval")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_massive_activations_and_secondary_sinks_equal_numpy(kind, gpt2_64, llama64):
    loaded = {"gpt2": gpt2_64, "llama": llama64}[kind]
    analyzer = run_sinks(loaded)
    references = eager_reference(loaded, EXAMPLES)
    activations = analyzer.activations().set_index(["layer", "quantity"])
    rtol = 1e-9 if kind == "gpt2" else 1e-6  # transformers' eager Llama takes its softmax in float32
    first = np.array([np.abs(r["hidden"][:, 0]).max(-1) for r in references])  # [sequence, layer + 1]
    rest = np.array([np.abs(r["hidden"][:, 1:]).max(axis=(-1, -2)) for r in references])
    for layer in range(loaded.num_layers + 1):
        np.testing.assert_allclose(activations.loc[(layer, "first_max"), "value"], first[:, layer].mean(), rtol=rtol)
        np.testing.assert_allclose(activations.loc[(layer, "rest_max"), "value"], rest[:, layer].mean(), rtol=rtol)
        np.testing.assert_allclose(activations.loc[(layer, "ratio"), "value"], (first[:, layer] / rest[:, layer]).mean(), rtol=rtol)
    # secondary sinks: every piece's mean alpha_k over its occurrences at 0 < k < n - 1, by hand, and the uniform head's
    # (query i gives 1 / (i + 1) to every key it sees) over the same occurrences
    sums, counts, uniform = {}, {}, {}
    for reference in references:
        n = len(reference["ids"])
        for k in range(1, n - 1):
            alpha = np.array([[received_by_hand(reference["attentions"][layer, head])[k] for head in range(loaded.num_heads)]
                              for layer in range(loaded.num_layers)])
            piece = reference["ids"][k]
            sums[piece] = sums.get(piece, 0) + alpha
            counts[piece] = counts.get(piece, 0) + 1
            uniform[piece] = uniform.get(piece, 0) + np.mean([1.0 / (i + 1) for i in range(k + 1, n)])
    means = np.concatenate([(total / counts[piece]).ravel() for piece, total in sums.items() if counts[piece] >= 2])
    # a random model has no real secondary sink: a threshold that some cells pass, in the widest gap of the top fifth (no cell near it)
    top = np.sort(means)[int(0.8 * len(means)):]
    widest = int(np.argmax(np.diff(top)))
    eps = float(top[widest: widest + 2].mean())
    expected = sorted((loaded.tokenizer.convert_ids_to_tokens(piece), layer, head, round(float(total[layer, head] / counts[piece]), 6), counts[piece])
                      for piece, total in sums.items() if counts[piece] >= 2
                      for layer, head in zip(*np.nonzero((total > eps * counts[piece]) & (total > uniform[piece] * (1 + 1e-5)))))
    got = analyzer.secondary(loaded.tokenizer, eps=eps, min_occurrences=2)
    assert len(got) == len(expected) > 0
    got = sorted(got.itertuples(index=False), key=lambda row: (row.piece, row.layer, row.head))
    for row, (piece, layer, head, attention, occurrences) in zip(got, expected):
        assert (row.piece, row.layer, row.head, row.occurrences) == (piece, layer, head, occurrences)
        assert abs(row.attention - attention) < 1e-6  # rounded to 6 places above


def plant_sink_head(loaded, head: int):
    """Make GPT-2's layer-0 head ``head`` put (almost) all its weight on position 0: a constant query (bias only) and keys
    that read one coordinate, which the first position's embedding makes huge."""
    attention, size = loaded.model.h[0].attn, loaded.model.config.n_embd
    width = size // loaded.num_heads
    query, key = slice(head * width, (head + 1) * width), slice(size + head * width, size + (head + 1) * width)
    with torch.no_grad():
        loaded.model.wpe.weight[0, 0] = 100.0
        attention.c_attn.weight[:, query] = 0
        attention.c_attn.bias[query] = 1.0
        attention.c_attn.weight[:, key] = 0
        attention.c_attn.weight[0, key] = 10.0
        attention.c_attn.bias[key] = 0


def test_a_planted_sink_head_is_the_one_sink(tiny_gpt2_dir):
    from bertology.core.model.models import load_model

    loaded = load_model(tiny_gpt2_dir, device="cpu")
    loaded.model.double()
    before = sink_rates(run_sinks(loaded).result(), eps=0.3, min_sample=5)
    assert before.sink_heads.sum() == 0  # the random model has no sink head on these sequences
    plant_sink_head(loaded, head=2)
    analyzer = run_sinks(loaded)
    table = analyzer.result()
    attention = table[table.quantity == "attention"].set_index(["layer", "head"]).value
    assert attention[(0, 2)] > 0.999
    assert list(attention[attention > 0.3].index) == [(0, 2)]  # found as a sink, and no other head is
    rates = sink_rates(table, eps=0.3, min_sample=5).set_index("layer")
    assert rates.loc["0", "sink_heads"] == 1 and rates.loc["0", "rate"] == 1 / loaded.num_heads
    assert rates.loc["1", "sink_heads"] == 0 and rates.loc["all", "rate"] == 1 / (loaded.num_heads * loaded.num_layers)
    # its weight goes to position 0; no later piece takes its attention (no secondary sink for it)
    secondary = analyzer.secondary(loaded.tokenizer, eps=0.3)
    assert not ((secondary.layer == 0) & (secondary.head == 2)).any()


def test_sinks_say_in_one_line_that_they_are_a_decoders(tiny_bert):
    from bertology.core.errors import BertologyError

    with pytest.raises(ValueError, match="measured on decoders"):
        run_sinks(tiny_bert)
    import bertology

    with pytest.raises(BertologyError, match="sinks does not run on .* \\(an encoder\\)"):
        bertology.analyze(tiny_bert, ["the cat sat."], analyses=["sinks"], progress=False)


@pytest.mark.parametrize("shared", [True, False], ids=["one-map-for-every-head", "a-map-per-head"])
def test_the_first_tokens_norm_share_equals_numpy_whole_and_by_blocks_of_rows(shared):
    # one map for every head is the uniform head's, computed as one product with every head's norms
    rng = np.random.default_rng(0)
    n, heads = 7, 3
    causal = np.tril(rng.uniform(0.1, 1, size=(1 if shared else heads, n, n)))
    maps = causal / causal.sum(-1, keepdims=True)
    transformed = rng.uniform(0.5, 2, size=(heads, n))  # ||f_h(x_j)||
    expected = []
    for head in range(heads):
        weighted = maps[0 if shared else head] * transformed[head][None, :]
        expected.append((weighted / weighted.sum(-1, keepdims=True))[1:, 0].mean())
    attention, norms, mask = torch.tensor(maps)[None], torch.tensor(transformed)[None], torch.ones(1, n, dtype=torch.bool)
    np.testing.assert_allclose(first_token_norm_share(attention, norms, mask)[0].numpy(), expected, rtol=1e-12)
    blocks = sum(first_token_norm_share(attention[:, :, rows], norms, mask, rows) for rows in (slice(0, 3), slice(3, n)))
    np.testing.assert_allclose(blocks[0].numpy(), expected, rtol=1e-12)
