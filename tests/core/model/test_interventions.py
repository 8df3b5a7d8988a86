import numpy as np
import pytest
import torch
import transformers as tf

from bertology.core.errors import ModelError
from bertology.core.model.hooks import ATTN_IMPLEMENTATION, Hooks, register_attention
from bertology.core.model.interventions import Intervention, LayerReplay, attach_variants, layer_modules, prune_heads, reads_first_token_only

FAMILIES = {
    "bert": lambda: tf.BertConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4),
    "roberta": lambda: tf.RobertaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4),
    "electra": lambda: tf.ElectraConfig(vocab_size=50, embedding_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4),
    "albert": lambda: tf.AlbertConfig(vocab_size=50, embedding_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4),
    "distilbert": lambda: tf.DistilBertConfig(vocab_size=50, dim=32, hidden_dim=64, n_layers=3, n_heads=4),
}
INPUTS = {"input_ids": torch.tensor([[2, 5, 6, 7, 3, 0], [2, 8, 9, 3, 0, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])}
HEADS = 4


def classifier(family: str) -> torch.nn.Module:
    register_attention()
    torch.manual_seed(0)
    return tf.AutoModelForSequenceClassification.from_config(FAMILIES[family](), attn_implementation=ATTN_IMPLEMENTATION).eval().double()


def logits(model, intervention: Intervention | None = None, inputs=INPUTS) -> torch.Tensor:
    hooks = intervention.attach_to(Hooks(), HEADS) if intervention is not None else Hooks()
    with torch.no_grad(), hooks.attach(model):
        return model(**inputs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_masking_every_head_of_a_layer_equals_disabling_the_layer(family):
    model = classifier(family)
    every_head = Intervention(masked=frozenset((1, h) for h in range(HEADS)))
    disabled = logits(model, Intervention.disable(1))
    torch.testing.assert_close(logits(model, every_head), disabled, rtol=0, atol=1e-12)
    assert not torch.allclose(disabled, logits(model)), "disabling a layer must change the output"
    # masking one head changes it, and less than the whole layer does
    one = logits(model, Intervention.of("mask", 1, 2))
    assert not torch.allclose(one, logits(model))


def test_uniform_attention_rows_are_exactly_one_over_n_real_tokens_and_average_the_values():
    model = classifier("bert")
    seen, values = [], []
    hooks = Intervention.of("uniform", 0, 1).attach_to(Hooks(), HEADS)
    hooks.add("pattern", lambda layer, p: seen.append(p.clone()) if layer == 0 else None)
    hooks.add("head_output", lambda layer, o: values.append(o.clone()) if layer == 0 else None)
    value_projection = model.bert.encoder.layer[0].attention.self.value
    captured = []
    handle = value_projection.register_forward_hook(lambda module, args, output: captured.append(output))
    with torch.no_grad(), hooks.attach(model):
        model(**INPUTS)
    handle.remove()
    pattern = seen[0]
    for row, real in enumerate(INPUTS["attention_mask"].sum(1).tolist()):
        expected = np.zeros(INPUTS["input_ids"].shape[1])
        expected[:real] = 1.0 / real
        np.testing.assert_array_equal(pattern[row, 1].numpy(), np.tile(expected, (len(expected), 1)))
        # the other heads keep their softmax attention
        assert not np.allclose(pattern[row, 0].numpy(), np.tile(expected, (len(expected), 1)))
        # head 1's output at every query is the mean of the real tokens' value vectors
        v = captured[0][row].view(-1, HEADS, 8)[:, 1]  # [keys, head_dim]
        np.testing.assert_allclose(values[0][row, 1].numpy(), np.tile(v[:real].mean(0).numpy(), (len(expected), 1)), atol=1e-12)


@pytest.mark.parametrize("family", ["bert", "distilbert", "albert"])
def test_stacked_variants_equal_one_run_per_variant(family):
    model = classifier(family)
    variants = [Intervention.of("mask", 0, 1), Intervention.of("uniform", 2, 3), Intervention.disable(1), Intervention(),
                Intervention.of("mask", 1, 0) | Intervention.of("uniform", 1, 0)]
    stacked = {k: v.repeat(len(variants), 1) for k, v in INPUTS.items()}
    with torch.no_grad(), attach_variants(Hooks(), variants, HEADS).attach(model):
        together = model(**stacked).logits.view(len(variants), 2, -1)
    for index, variant in enumerate(variants):
        torch.testing.assert_close(together[index], logits(model, variant), rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_replay_starts_at_a_layer_with_true_layer_numbers(family):
    model = classifier(family)
    replay = LayerReplay(model)
    with torch.no_grad(), replay.record() as hidden:
        full = model(**INPUTS).logits
    assert len(hidden) == 3
    for start in range(3):
        seen = []
        hooks = Hooks().add("pattern", lambda layer, p: seen.append(layer))
        with torch.no_grad(), replay.start_at(start, hidden[start - 1] if start else None), hooks.attach(model):
            again = model(**INPUTS).logits
        torch.testing.assert_close(again, full, rtol=0, atol=1e-12)
        assert seen == list(range(start, 3))
    # the forward methods are restored afterwards
    assert all("forward" not in vars(module) for module in layer_modules(model))


@pytest.mark.parametrize("family", ["bert", "roberta", "electra", "distilbert"])
def test_first_token_only_last_layer_gives_the_same_logits(family):
    model = classifier(family)
    assert reads_first_token_only(model)
    with torch.no_grad(), LayerReplay(model).start_at(0, None, first_token_only=True):
        quick = model(**INPUTS).logits
    torch.testing.assert_close(quick, logits(model), rtol=0, atol=1e-12)


def test_albert_is_not_taken_for_a_first_token_classifier():
    assert not reads_first_token_only(classifier("albert"))


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_physically_pruned_model_equals_the_masked_one(family):
    model = classifier(family)
    remove = {0: [1, 3], 2: [0]}
    masked = logits(model, Intervention(masked=frozenset((layer, h) for layer, heads in remove.items() for h in heads)))
    before = sum(p.numel() for p in model.parameters())
    prune_heads(model, remove)
    torch.testing.assert_close(logits(model), masked, rtol=0, atol=1e-10)
    assert sum(p.numel() for p in model.parameters()) == before - 3 * (3 * 8 * 32 + 3 * 8 + 8 * 32)  # q, k, v rows + biases, output columns
    # indices refer to the current model; the record keeps the original ones
    prune_heads(model, {0: [0]})  # current head 0 of layer 0 is original head 0
    assert model.config.bertology_pruned_heads == {"0": [0, 1, 3], "2": [0]}


def test_pruning_every_head_of_a_layer_is_refused_and_albert_cannot_be_pruned():
    with pytest.raises(ModelError, match="at least one"):
        prune_heads(classifier("bert"), {1: [0, 1, 2, 3]})
    with pytest.raises(ModelError, match="share weights"):
        prune_heads(classifier("albert"), {0: [0]})


def test_every_first_token_classifier_a_layout_names_is_a_transformers_class_of_its_model_types():
    """The layouts' names of first-token classifiers are no typos: each is a transformers class whose config's model type that
    layout serves, and the layout computes the first token's last layer (checked against the logits above)."""
    from bertology.core.model.layouts import LAYOUTS

    named = {name: type(layout) for layout in LAYOUTS.values() for name in layout.first_token_classifiers}
    assert {"BertForSequenceClassification", "RobertaForSequenceClassification", "DistilBertForSequenceClassification"} <= set(named)
    for name, layout in named.items():
        assert getattr(tf, name).config_class.model_type in layout.model_types, name


def test_a_layer_whose_heads_bertology_cannot_remove_is_refused_in_one_line():
    register_attention()
    model = tf.GPT2ForSequenceClassification(tf.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, pad_token_id=0))
    assert not reads_first_token_only(model)  # a decoder's classifier reads the last token
    with pytest.raises(ModelError, match="GPT2Block: bertology cannot prune heads of this layer type"):
        prune_heads(model, {0: [1]})
