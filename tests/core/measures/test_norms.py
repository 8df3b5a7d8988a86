"""Norm shares (Kobayashi et al. 2020), context-mixing ratios (Kobayashi et al. 2021) and their attention blocks, against
numpy computed from each architecture's own weights and transformers' own eager forward pass (METHODS.md section 7)."""

import numpy as np
import pytest
import torch
from transformers import AutoModel

from bertology.core.engine import Engine, PassNeeds, RunStats, capture, model_forward
from bertology.core.errors import BertologyError
from bertology.core.measures.norms import norm_shares, parse_weighting
from bertology.core.model.hooks import HOOK_POINTS, Hooks
from bertology.core.model.models import load_model
from bertology.core.text.corpora import Example

#: Parameter names of each layout: value projection, output projection, post-attention layer norm, as a function of the layer.
PARAMETERS = {
    "bert": lambda layer: (f"encoder.layer.{layer}.attention.self.value", f"encoder.layer.{layer}.attention.output.dense",
                           f"encoder.layer.{layer}.attention.output.LayerNorm"),
    "distilbert": lambda layer: (f"transformer.layer.{layer}.attention.v_lin", f"transformer.layer.{layer}.attention.out_lin",
                                 f"transformer.layer.{layer}.sa_layer_norm"),
    "albert": lambda layer: ("encoder.albert_layer_groups.0.albert_layers.0.attention.value", "encoder.albert_layer_groups.0.albert_layers.0.attention.dense",
                         "encoder.albert_layer_groups.0.albert_layers.0.attention.LayerNorm"),
}
PARAMETERS["roberta"] = PARAMETERS["electra"] = PARAMETERS["bert"]
LAYOUTS = ("bert", "roberta", "distilbert", "albert", "electra")


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request, tiny_encoder_dirs, tiny_roberta_dir):
    """(name, bertology's model in float64, transformers' eager model in float64, numpy parameters) for one layout."""
    folder = tiny_roberta_dir if request.param == "roberta" else tiny_encoder_dirs[request.param]
    loaded = load_model(folder, device="cpu")
    loaded.model.double()
    reference = AutoModel.from_pretrained(folder, attn_implementation="eager").double().eval()
    state = {name: tensor.numpy() for name, tensor in reference.state_dict().items()}
    return request.param, loaded, reference, state


def _batch(loaded, texts, **capture):
    engine = Engine(loaded, progress=False)
    items = list(engine.encode(enumerate(Example(*text) if isinstance(text, tuple) else Example(text) for text in texts), RunStats()))
    return items, engine.run_batch(items, needs=PassNeeds(**capture))


def _reference(name, reference, state, items):
    """transformers' own maps and layer inputs, and numpy's norms, norm shares and mixing ratios, per sequence."""
    config = reference.config
    heads = getattr(config, "num_attention_heads", None) or config.n_heads
    out = []
    for item in items:
        inputs = {"input_ids": torch.tensor([item.input_ids])}
        if name in ("bert", "albert", "electra"):  # the layouts with segment embeddings
            inputs["token_type_ids"] = torch.tensor([item.token_type_ids])
        with torch.no_grad():
            output = reference(**inputs, output_attentions=True, output_hidden_states=True)
        layers = []
        for layer, maps in enumerate(output.attentions):
            value, dense, norm = PARAMETERS[name](layer)
            a = maps[0].numpy()  # [head, n, n]
            x = output.hidden_states[layer][0].numpy()  # [n, hidden]: the layer's input and its residual
            v = (x @ state[f"{value}.weight"].T + state[f"{value}.bias"]).reshape(len(x), heads, -1)  # x W_V + b_V
            w_o = state[f"{dense}.weight"]
            d = v.shape[-1]
            f = np.stack([v[:, h, :] @ w_o[:, h * d:(h + 1) * d].T for h in range(heads)])  # [head, n, hidden]: f_h(x_j)
            norms = np.linalg.norm(f, axis=-1)  # [head, n]
            weighted = a * norms[:, None, :]
            shares = weighted / weighted.sum(-1, keepdims=True)
            z = np.einsum("hij,hjo->ijo", a, f)  # z[i <- j] = sum_h a_h[i, j] f_h(x_j)
            own = np.einsum("iio->io", z)
            mixed = z.sum(1) - own
            kept = own + x
            pre = z.sum(1) + state[f"{dense}.bias"] + x
            gamma, beta, eps = state[f"{norm}.weight"], state[f"{norm}.bias"], reference.get_submodule(norm).eps
            scale = np.sqrt(pre.var(-1, keepdims=True) + eps)
            g = lambda vectors: gamma * (vectors - vectors.mean(-1, keepdims=True)) / scale  # noqa: E731
            # The decomposition is exact: the parts through the norm, plus the bias's part and beta, are the layer norm's output.
            np.testing.assert_allclose(g(mixed) + g(kept) + g(np.broadcast_to(state[f"{dense}.bias"], x.shape)) + beta,
                                       gamma * (pre - pre.mean(-1, keepdims=True)) / scale + beta, atol=1e-10)
            ratio = lambda m, p: np.linalg.norm(m, axis=-1) / (np.linalg.norm(m, axis=-1) + np.linalg.norm(p, axis=-1))  # noqa: E731
            layers.append({"maps": a, "norms": norms, "shares": shares,
                           "mixing": np.stack([ratio(mixed, own), ratio(mixed, kept), ratio(g(mixed), g(kept))], axis=-1)})
        out.append(layers)
    return out


TEXTS = ["the cat sat on the mat.", "where is it?", ("the cat sat.", "the dog ran under the big table.")]


def test_norm_shares_and_mixing_ratios_match_numpy_from_the_weights(layout):
    name, loaded, reference, state = layout
    items, batch = _batch(loaded, TEXTS, norms=True, mixing=True)
    norm_view = batch.weighted("norm")
    expected = _reference(name, reference, state, items)
    assert batch.attentions.shape[0] == len(expected[0])
    for b, layers in enumerate(expected):
        n = len(items[b])
        for layer, numbers in enumerate(layers):
            np.testing.assert_allclose(batch.attentions[layer, b, :, :n, :n].numpy(), numbers["maps"], atol=1e-12)
            np.testing.assert_allclose(batch.key_norms[layer, b, :, :n].numpy(), numbers["norms"], rtol=1e-10)
            np.testing.assert_allclose(norm_view.attentions[layer, b, :, :n, :n].numpy(), numbers["shares"], atol=1e-12)
            np.testing.assert_allclose(batch.mixing[layer, b, :n].numpy(), numbers["mixing"], atol=1e-10)
        assert not norm_view.attentions[:, b, :, n:, :].any()  # padding queries stay zero
        assert not batch.mixing[:, b, n:].any()


def test_a_head_that_looks_at_sep_but_mixes_nothing_from_it_gets_zero_norm_share(tiny_bert, monkeypatch):
    """Hand-built: every head puts 0.9 of each row on [SEP] and spreads 0.1 over the rest, and [SEP]'s value vectors are zero."""
    engine = Engine(tiny_bert, progress=False)
    items = list(engine.encode(enumerate([Example("the cat sat on the mat.")]), RunStats()))
    sep = items[0].input_ids.index(tiny_bert.sep_token_id)
    n = len(items[0])

    def look_at_sep(layer, pattern):
        hand = torch.full_like(pattern, 0.1 / (n - 1))
        hand[..., sep] = 0.9
        return hand

    def empty_sep(layer, value):
        value = value.clone()
        value[:, :, sep] = 0
        return value

    def forward_with_the_hand_made_head(model, tensors, hooks, *args):
        hand = Hooks().add("value", empty_sep).add("pattern", look_at_sep)  # first, so the engine's handlers read what they made
        for point in HOOK_POINTS:
            for handler in hooks._handlers[point]:
                hand.add(point, handler)
        return model_forward(model, tensors, hand, *args)

    monkeypatch.setattr(capture, "model_forward", forward_with_the_hand_made_head)
    batch = engine.run_batch(items, needs=PassNeeds(norms=True))
    weights = batch.attentions[:, 0, :, :n, sep]
    shares = batch.weighted("norm").attentions[:, 0, :, :n, :n]
    assert torch.allclose(weights, torch.full_like(weights, 0.9))
    assert torch.all(shares[..., sep] == 0)
    assert torch.allclose(shares.sum(-1), torch.ones_like(shares.sum(-1)))



def test_norm_shares_on_a_hand_made_row():
    a = torch.tensor([[[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)  # third row: a padding query
    norms = torch.tensor([[2.0, 4.0, 0.0]], dtype=torch.float64)
    shares = norm_shares(a, norms)
    # row 0: 0.5*2 = 1 and 0.25*4 = 1 and 0.25*0 = 0 -> 0.5, 0.5, 0; row 1: all of it on key 1
    assert torch.allclose(shares, torch.tensor([[[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]], dtype=torch.float64))


def test_weighting_names_are_checked():
    assert parse_weighting("attention") == ["attention"]
    assert parse_weighting("norm, attention,norm") == ["norm", "attention"]
    assert parse_weighting(["attention", "norm"]) == ["attention", "norm"]
    for bad in ("weights", "attention,norms", ""):
        with pytest.raises(BertologyError, match="weighting"):
            parse_weighting(bad)


def test_a_layout_bertology_does_not_know_is_refused_in_one_line(tiny_bert):
    from bertology.core.model.models import attention_blocks

    class Unknown:
        config = type("Config", (), {"model_type": "mystery"})()

    with pytest.raises(BertologyError, match="mystery"):
        attention_blocks(Unknown())


def test_on_the_bundled_model_and_real_sentences_norms_and_mixing_match_numpy(shared_data):
    """The same independent computation on all-MiniLM-L6-v2 (float64) and real EWT sentences, not only on tiny random models."""
    from bertology.core.model.models import default_model_path

    lines = (shared_data / "ud_english_ewt" / "en_ewt-ud-test.conllu").read_text(encoding="utf-8").splitlines()
    texts = [line.split("=", 1)[1].strip() for line in lines if line.startswith("# text =")][:4]
    loaded = load_model(None, device="cpu")
    loaded.model.double()
    reference = AutoModel.from_pretrained(default_model_path(), attn_implementation="eager").double().eval()
    state = {name: tensor.numpy() for name, tensor in reference.state_dict().items()}
    items, batch = _batch(loaded, texts, norms=True, mixing=True)
    norm_view = batch.weighted("norm")
    for b, layers in enumerate(_reference("bert", reference, state, items)):
        n = len(items[b])
        for layer, numbers in enumerate(layers):
            np.testing.assert_allclose(norm_view.attentions[layer, b, :, :n, :n].numpy(), numbers["shares"], atol=1e-10)
            np.testing.assert_allclose(batch.mixing[layer, b, :n].numpy(), numbers["mixing"], atol=1e-10)


def test_the_mixing_ratios_take_the_models_own_output_projection_and_equal_those_that_project_again(layout, monkeypatch):
    """The pass hands a layer over after its output projection and the ratios read that projection (a sixth of a layer's
    work not done twice); they equal the ratios that project ``head_output`` themselves, and a pass that stops after
    layer 0 runs no later layer's attention."""
    import bertology.core.engine.capture as engine_module
    from bertology.core.measures.norms import mixing_ratios

    name, loaded, reference, state = layout
    calls = []

    def spy(pattern, value, head_output, layer_input, block, projected=None):
        calls.append(projected)
        with_projection = mixing_ratios(pattern, value, head_output, layer_input, block, projected)
        torch.testing.assert_close(with_projection, mixing_ratios(pattern, value, head_output, layer_input, block), rtol=0, atol=1e-12)
        return with_projection

    monkeypatch.setattr(engine_module, "mixing_ratios", spy)
    engine = Engine(loaded, progress=False)
    items = list(engine.encode(enumerate(Example(text) for text in ["the cat sat on the mat.", "where is it?"]), RunStats()))
    layers = []
    engine.run_batch(items, needs=PassNeeds(mixing=True), on_layer=lambda batch, layer, maps: layers.append(layer))
    assert layers == list(range(len(calls))) and len(calls) >= 2
    assert all(projected is not None and projected.dtype == torch.float64 for projected in calls)
    calls.clear()
    stopped = []
    engine.run_batch(items, needs=PassNeeds(mixing=True), on_layer=lambda batch, layer, maps: stopped.append(layer), last_layer=0)
    assert stopped == [0] and len(calls) == 1


def test_a_layer_whose_output_projection_never_runs_is_refused_not_lost(tiny_bert, monkeypatch):
    from bertology.core.engine import BatchCapture

    monkeypatch.setattr(BatchCapture, "end_of_projection", lambda self, layer, projected: None)  # as if W_O never ran
    engine = Engine(tiny_bert, progress=False)
    items = list(engine.encode(enumerate([Example("the cat sat on the mat.")]), RunStats()))
    with pytest.raises(BertologyError, match="layer 0's output projection did not run"):
        engine.run_batch(items, needs=PassNeeds(mixing=True), on_layer=lambda batch, layer, maps: None)
