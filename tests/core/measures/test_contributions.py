"""ALTI and value zeroing (bertology.core.measures.contributions) against numpy ports of the authors' code (tests/reference: ALTI's
mt-upc/transformer-contributions, value zeroing's hmohebbi/ValueZeroing) on tiny float64 BERT, RoBERTa and DistilBERT."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference.alti import alti
from reference.value_zeroing import value_zeroing as value_zeroing_port

from bertology.core.engine import PassNeeds
from bertology.core.measures.contributions import alti_contributions, rolled_out, value_zeroing
from bertology.core.model.hooks import Hooks, register_attention
from bertology.core.model.models import attention_blocks

TEXTS = ["the cat sat on the mat .", "where is the dog ?", "the big red house is under the tree"]


def tiny(kind: str):
    """A random float64 ``kind`` model with bertology's attention."""
    from transformers import BertConfig, BertModel, DistilBertConfig, DistilBertModel, RobertaConfig, RobertaModel

    register_attention()
    torch.manual_seed(0)
    if kind == "bert":
        model = BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64))
    elif kind == "roberta":
        model = RobertaModel(RobertaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                           max_position_embeddings=40, layer_norm_eps=1e-5))
    else:
        model = DistilBertModel(DistilBertConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, hidden_dim=64))
    model.config._attn_implementation = "bertology"
    return model.double().eval().requires_grad_(False)


def captured(model, ids: torch.Tensor, mask: torch.Tensor):
    """Every layer's pattern (padding rows zeroed), values, head outputs and input x, from one forward pass."""
    layers: list[dict] = []
    values: list[torch.Tensor] = []
    hooks = (Hooks().add("value", lambda layer, t: values.append(t.clone())).add("pattern", lambda layer, t: layers.append({"pattern": t.clone()}))
             .add("head_output", lambda layer, t: layers[-1].__setitem__("head_output", t.clone())))
    inputs = []
    blocks = attention_blocks(model)
    attentions = {id(block.attention): block.attention for block in blocks}.values()  # ALBERT's layers share one: one hook, a call per layer
    handles = [attention.register_forward_pre_hook(lambda module, args, kwargs: inputs.append((args[0] if args else kwargs["hidden_states"]).clone()),
                                                   with_kwargs=True) for attention in attentions]
    try:
        with torch.no_grad(), hooks.attach(model):
            model(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    for layer, value, x in zip(layers, values, inputs):
        layer["pattern"] *= mask[:, None, :, None]
        layer.update(value=value, x=x)
    return blocks, layers


def padded(texts):
    rng = np.random.default_rng(0)
    sequences = [rng.integers(3, 50, size=len(text.split()) + 2).tolist() for text in texts]
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    return sequences, ids, mask


@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert"])
def test_alti_equals_the_authors_code_on_every_sequence_of_a_padded_batch(kind):
    model = tiny(kind)
    sequences, ids, mask = padded(TEXTS)
    blocks, layers = captured(model, ids, mask)
    rolled = None
    for layer, (block, maps) in enumerate(zip(blocks, layers)):
        ours = alti_contributions(maps["pattern"], maps["value"], maps["x"], block) * mask[:, :, None]
        small = alti_contributions(maps["pattern"], maps["value"], maps["x"], block, chunk_elements=1) * mask[:, :, None]
        torch.testing.assert_close(small, ours, rtol=0, atol=0)  # chunked (a row at a time) and whole: identical
        rolled = rolled_out(ours, rolled)
        for b, sequence in enumerate(sequences):
            n = len(sequence)
            # the port with the paper's distance (no 1e-6 per component) and the layer norm's real scale sqrt(var + eps)
            reference = alti(model, torch.tensor(sequence), ln_eps="model", distance_eps=0.0)
            np.testing.assert_allclose(ours[b, :n, :n].numpy(), reference.contributions[layer], atol=1e-8, rtol=0)
            np.testing.assert_allclose(rolled[b, :n, :n].numpy(), reference.rollout[layer], atol=1e-8, rtol=0)
            assert not ours[b, n:].any() and not ours[b, :, n:].any()


@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert"])
def test_value_zeroing_equals_the_authors_code_on_every_sequence_of_a_padded_batch(kind):
    model = tiny(kind)
    sequences, ids, mask = padded(TEXTS)
    blocks, layers = captured(model, ids, mask)
    references = [value_zeroing_port(model, torch.tensor(sequence)) for sequence in sequences]
    for layer, (block, maps) in enumerate(zip(blocks, layers)):
        arguments = (maps["pattern"], maps["value"], maps["head_output"], maps["x"], block)
        whole = value_zeroing(*arguments) * mask[:, :, None]
        heads = value_zeroing(*arguments, per_head=True) * mask[:, None, :, None]
        # one zeroed token at a time against all at once: the same up to the feed-forward's matrix blocking, which 1 - cos
        # (a difference of numbers near 1) magnifies to about 1e-10 relative
        torch.testing.assert_close(value_zeroing(*arguments, chunk_elements=1) * mask[:, :, None], whole, rtol=1e-8, atol=1e-12)
        torch.testing.assert_close(value_zeroing(*arguments, per_head=True, chunk_elements=1) * mask[:, None, :, None], heads, rtol=1e-8, atol=1e-12)
        for b, (sequence, reference) in enumerate(zip(sequences, references)):
            n = len(sequence)
            np.testing.assert_allclose(whole[b, :n, :n].numpy(), reference.layers[layer], atol=1e-8, rtol=0)
            np.testing.assert_allclose(heads[b, :, :n, :n].numpy(), reference.heads[layer], atol=1e-8, rtol=0)


@pytest.mark.parametrize("kind", ["bert", "distilbert", "albert", "electra"])
def test_value_zeroing_equals_the_models_own_layers_rerun_on_every_encoder_layout(kind, tiny_encoder_dirs):
    # every layout's rest of the layer (ALBERT's shared one included) against the model's own code, rerun with a token's values zeroed
    from conftest import float64_model
    from reference.rerun import value_zeroing_by_rerun

    model = float64_model(tiny_encoder_dirs[kind]).model.requires_grad_(False)
    sequences, ids, mask = padded(TEXTS)
    blocks, layers = captured(model, ids, mask)
    for layer, (block, maps) in enumerate(zip(blocks, layers)):
        arguments = (maps["pattern"], maps["value"], maps["head_output"], maps["x"], block)
        whole, heads = value_zeroing(*arguments), value_zeroing(*arguments, per_head=True)
        for b, sequence in enumerate(sequences):
            n = len(sequence)
            expected, expected_heads = value_zeroing_by_rerun(model, layer, ids, mask, b, n, heads.shape[1], causal=False)
            np.testing.assert_allclose(whole[b, :n, :n].numpy(), expected, atol=1e-8, rtol=0)
            np.testing.assert_allclose(heads[b, :, :n, :n].numpy(), expected_heads, atol=1e-8, rtol=0)
            assert not whole[b, :n, n:].any() and not heads[b, :, :n, n:].any()  # padding keys: exactly 0


def test_a_token_whose_values_are_zero_contributes_nothing_under_both():
    # a hand-built block: token 2's value vectors are zero in every head, so nothing of it reaches another token
    model = tiny("bert")
    sequences, ids, mask = padded(TEXTS[:1])
    blocks, layers = captured(model, ids, mask)
    maps = layers[0]
    maps["value"][:, :, 2] = 0
    heads = maps["pattern"].shape[1]
    maps["head_output"] = maps["pattern"] @ maps["value"]
    assert heads == 4
    contributions = alti_contributions(maps["pattern"], maps["value"], maps["x"], blocks[0])
    zeroing = value_zeroing(maps["pattern"], maps["value"], maps["head_output"], maps["x"], blocks[0])
    others = [i for i in range(ids.shape[1]) if i != 2]
    assert torch.all(zeroing[0, :, 2] < 1e-9)  # removing nothing changes nothing (up to the rerun's float rounding)
    assert torch.all(zeroing[0, others].sum(-1) > 0.999)
    # under ALTI token 2 keeps only its own residual: no other token gets anything from it
    assert torch.all(contributions[0, others, 2] == 0) and contributions[0, 2, 2] > 0


def alti_per_head_by_hand(x: np.ndarray, w) -> np.ndarray:
    """bertology's per-head ALTI in numpy loops: T^h_i(x_j) = L(a_h[i, j] v_j^h W_O^h) / s_i, y^h_i = sum_j T^h_i(x_j),
    c_h[i, j] = max(0, ||y^h_i||_1 - ||y^h_i - T^h_i(x_j)||_1), rows normalised."""
    from reference.alti import l_transform
    from reference.encoder import layer_forward

    forward = layer_forward(x, w)
    n, heads, dh = x.shape[0], w.num_heads, w.head_dim
    scale = np.sqrt(np.var(forward["pre_ln1"], axis=-1) + w.ln1_eps)
    result = np.zeros((heads, n, n))
    for h in range(heads):
        vectors = forward["value"][h] @ w.wo[h * dh:(h + 1) * dh]  # v_j^h W_O^h, [j, hidden]
        for i in range(n):
            parts = l_transform(forward["probs"][h, i][:, None] * vectors, w.ln1_gamma) / scale[i]
            y = parts.sum(axis=0)
            row = np.maximum(0, np.abs(y).sum() - np.abs(y - parts).sum(axis=-1))
            result[h, i] = row / row.sum()
    return result


def test_the_views_the_engine_hands_out_equal_numpy_on_every_sequence_of_a_padded_batch(tiny_bert_dir):
    from conftest import float64_model, tiny_examples
    from reference.encoder import hidden_states, layer_weights

    from bertology.core.engine import Engine, RunStats

    loaded = float64_model(tiny_bert_dir)
    engine = Engine(loaded, progress=False)
    items = list(engine.encode(enumerate(tiny_examples()[:5]), RunStats()))
    batch = engine.run_batch(items, needs=PassNeeds(views=("alti", "value-zeroing")))
    weights = layer_weights(loaded.model)
    for b, item in enumerate(items):
        n = len(item)
        states = hidden_states(loaded.model, torch.tensor(item.input_ids), weights)
        port = value_zeroing_port(loaded.model, torch.tensor(item.input_ids))
        for layer, w in enumerate(weights):
            np.testing.assert_allclose(batch.weighted("alti").attentions[layer, b, :, :n, :n].numpy(), alti_per_head_by_hand(states[layer], w),
                                       atol=1e-8, rtol=0)
            np.testing.assert_allclose(batch.weighted("value-zeroing").attentions[layer, b, :, :n, :n].numpy(), port.heads[layer], atol=1e-8, rtol=0)
        assert not batch.view_maps["alti"][:, b, :, n:].any() and not batch.view_maps["value-zeroing"][:, b, :, n:].any()


def test_an_unknown_view_is_refused_in_one_line(tiny_bert_dir):
    import bertology
    from bertology.core.errors import BertologyError

    with pytest.raises(BertologyError, match="unknown weighting zeroing"):
        bertology.analyze(tiny_bert_dir, ["the cat sat on the mat."], weighting="attention,zeroing", progress=False, device="cpu")


def test_on_the_bundled_model_and_real_sentences_both_measures_equal_the_ports(shared_data):
    """The same comparison on all-MiniLM-L6-v2 (float64) and real EWT sentences, in one padded batch, not only on tiny random models."""
    from conftest import float64_model

    from bertology.core.engine import Engine, RunStats
    from bertology.core.model.models import default_model_path
    from bertology.core.text.corpora import Example

    lines = (shared_data / "ud_english_ewt" / "en_ewt-ud-test.conllu").read_text(encoding="utf-8").splitlines()
    # two short sentences in one batch: the numpy port reruns each layer once per token, so the test stays short
    texts = sorted((line.split("=", 1)[1].strip() for line in lines if line.startswith("# text =")), key=len)[200:202]
    loaded = float64_model(default_model_path())
    engine = Engine(loaded, progress=False)
    items = list(engine.encode(enumerate(Example(text) for text in texts), RunStats()))
    batch = engine.run_batch(items, needs=PassNeeds(contributions=("alti", "value_zeroing")))
    for b, item in enumerate(items):
        n, ids = len(item), torch.tensor(item.input_ids)
        reference_alti = alti(loaded.model, ids, ln_eps="model", distance_eps=0.0)
        reference_zeroing = value_zeroing_port(loaded.model, ids, per_head=False)
        for layer in range(loaded.num_layers):
            np.testing.assert_allclose(batch.contributions["alti"][layer, b, :n, :n].numpy(), reference_alti.contributions[layer], atol=1e-8, rtol=0)
            np.testing.assert_allclose(batch.contributions["value_zeroing"][layer, b, :n, :n].numpy(), reference_zeroing.layers[layer], atol=1e-8, rtol=0)
