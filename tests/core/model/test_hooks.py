import pytest
import torch
import transformers as tf

from bertology.core.model.hooks import ATTN_IMPLEMENTATION, Hooks, register_attention
from bertology.core.model.models import attention_blocks

FAMILIES = {
    "bert": (tf.BertConfig, {}),
    "roberta": (tf.RobertaConfig, {}),
    "electra": (tf.ElectraConfig, {}),
    "albert": (tf.AlbertConfig, {"embedding_size": 16}),
    "distilbert": (tf.DistilBertConfig, None),
}


def tiny(family: str, implementation: str):
    config_class, extra = FAMILIES[family]
    if extra is None:
        config = config_class(vocab_size=50, dim=32, hidden_dim=64, n_layers=3, n_heads=4)
    else:
        config = config_class(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, **extra)
    torch.manual_seed(0)
    model = tf.AutoModel.from_config(config, attn_implementation="eager").eval()
    if implementation != "eager":
        register_attention()
        model.set_attn_implementation(implementation)
    return model


INPUTS = {"input_ids": torch.tensor([[2, 5, 6, 7, 3, 0], [2, 8, 9, 3, 0, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])}


@pytest.mark.parametrize("family", FAMILIES)
def test_bertology_attention_equals_eager_and_counts_layers(family):
    eager = tiny(family, "eager")
    with torch.no_grad():
        reference = eager(**INPUTS, output_attentions=True)
    ours = tiny(family, ATTN_IMPLEMENTATION)
    seen = []
    with torch.no_grad(), Hooks().add("pattern", lambda layer, p: seen.append((layer, p.clone()))).attach(ours):
        output = ours(**INPUTS)
        ours(**INPUTS)  # a second pass numbers its layers from 0 again
    torch.testing.assert_close(output.last_hidden_state, reference.last_hidden_state)
    assert [layer for layer, _ in seen] == [0, 1, 2, 0, 1, 2]  # ALBERT shares one module across layers
    for layer in range(3):
        torch.testing.assert_close(seen[layer][1], reference.attentions[layer])


def test_handlers_can_replace_the_pattern_and_the_head_output():
    model = tiny("bert", ATTN_IMPLEMENTATION)
    with torch.no_grad():
        plain = model(**INPUTS).last_hidden_state

        def uniform(layer, pattern):
            return torch.full_like(pattern, 1.0 / pattern.shape[-1]) if layer == 1 else None

        with Hooks().add("pattern", uniform).attach(model):
            changed = model(**INPUTS).last_hidden_state
        with Hooks().add("head_output", lambda layer, out: out * 1.0).attach(model):
            same = model(**INPUTS).last_hidden_state
    assert not torch.allclose(plain, changed)
    torch.testing.assert_close(plain, same)
    # Outside the block the hooks are gone.
    torch.testing.assert_close(model(**INPUTS).last_hidden_state, plain)


def test_unknown_hook_point_and_wrong_implementation_are_refused():
    with pytest.raises(ValueError, match="unknown hook point 'scores'"):
        Hooks().add("scores", lambda layer, t: None)
    with pytest.raises(ValueError, match="attn_implementation='bertology'"):
        with Hooks().attach(tiny("bert", "eager")):
            pass


@pytest.mark.parametrize("rows", [None, 2])
def test_an_unpadded_decoder_gets_no_mask_and_its_causal_maps_equal_eager(rows):
    """transformers leaves an unpadded causal layer's mask to SDPA's is_causal (the mask registered for bertology is its SDPA
    mask): no n x n mask is made, and bertology's attention masks each block of rows causally itself, as eager's mask would."""
    import bertology.core.model.hooks as hooks_module

    config = tf.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2)
    torch.manual_seed(0)
    eager = tf.AutoModel.from_config(config, attn_implementation="eager").eval()
    register_attention()
    ours = tf.AutoModel.from_config(config, attn_implementation=ATTN_IMPLEMENTATION).eval()
    ours.load_state_dict(eager.state_dict())
    ids = torch.tensor([[2, 5, 6, 7, 3, 9, 4]])
    passed, made = [], hooks_module._rows_mask

    def spy(attention_mask, causal, *arguments):
        passed.append((attention_mask, causal))
        return made(attention_mask, causal, *arguments)

    hooks, seen = Hooks(), {}
    hooks.query_rows = rows
    hooks.add("pattern", lambda layer, p: seen.setdefault(layer, []).append((p.clone(), hooks.key_mask.clone())))
    with torch.no_grad():
        reference = eager(input_ids=ids, output_attentions=True)
        with pytest.MonkeyPatch.context() as patch, hooks.attach(ours):
            patch.setattr(hooks_module, "_rows_mask", spy)
            output = ours(input_ids=ids)
    assert passed and all(mask is None and causal for mask, causal in passed)
    torch.testing.assert_close(output.last_hidden_state, reference.last_hidden_state)
    for layer in range(2):
        torch.testing.assert_close(torch.cat([p for p, _ in seen[layer]], dim=2), reference.attentions[layer])
        visible = torch.cat([mask for _, mask in seen[layer]], dim=2)[0, 0]
        assert torch.equal(visible, torch.ones(7, 7, dtype=torch.bool).tril())


@pytest.mark.parametrize("family", ["bert", "albert", "distilbert"])
def test_the_block_points_fire_once_a_layer_with_its_input_and_its_projected_attention(family):
    """``layer_input`` is each layer's input (transformers' own hidden states), ``attn_out`` the heads' outputs through the
    output projection (by hand: ``head_output`` concatenated, times ``W_O``, plus ``b_O``), once a layer, ALBERT's shared
    module included."""
    model = tiny(family, ATTN_IMPLEMENTATION)
    blocks = attention_blocks(model)
    inputs, projected, heads = [], [], []
    hooks = (Hooks().add("layer_input", lambda layer, x: inputs.append((layer, x.clone())))
             .add("attn_out", lambda layer, out: projected.append((layer, out.clone())))
             .add("head_output", lambda layer, z: heads.append(z.clone())))
    with torch.no_grad(), hooks.attach(model, blocks):
        reference = model(**INPUTS, output_hidden_states=True).hidden_states
        model(**INPUTS)  # a second pass numbers its layers from 0 again
    assert [layer for layer, _ in inputs] == [layer for layer, _ in projected] == [0, 1, 2, 0, 1, 2]
    for layer, x in inputs[:3]:
        torch.testing.assert_close(x, reference[layer])
    for (layer, out), z in zip(projected[:3], heads[:3]):
        by_hand = z.transpose(1, 2).flatten(2) @ blocks[layer].output_weight + blocks[layer].output_bias
        torch.testing.assert_close(out, by_hand)


def test_a_replaced_attn_out_is_what_the_layer_adds_and_the_block_points_need_the_blocks():
    """Replacing layer 1's ``attn_out`` by zeros gives the output of the same model whose layer 1 output projection is zero;
    a handler at a block point without the model's blocks is refused."""
    model = tiny("bert", ATTN_IMPLEMENTATION)
    with torch.no_grad():
        with Hooks().add("attn_out", lambda layer, out: torch.zeros_like(out) if layer == 1 else None).attach(model, attention_blocks(model)):
            replaced = model(**INPUTS).last_hidden_state
        projection = model.encoder.layer[1].attention.output.dense
        projection.weight.zero_()
        projection.bias.zero_()
        zeroed = model(**INPUTS).last_hidden_state
    torch.testing.assert_close(replaced, zeroed)
    with pytest.raises(ValueError, match="the hook points layer_input and attn_out need the model.s attention blocks"):
        with Hooks().add("layer_input", lambda layer, x: None).attach(model):
            pass
