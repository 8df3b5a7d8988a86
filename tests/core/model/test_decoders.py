"""Decoders (causal LMs) through bertology's hook point: loading, the maps against transformers' own eager attention and
numpy, the visible-key mask, grouped-query attention, the norm view on pre-norm blocks (docs/methods.md#decoders)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DECODER_KINDS, float64_model, tiny_decoder_configs

from bertology.core.engine import Engine, PassNeeds, RunStats
from bertology.core.errors import ModelError
from bertology.core.model.hooks import Hooks
from bertology.core.model.kinds import DECODER, kind_of
from bertology.core.model.models import attention_blocks, load_model
from bertology.core.text.corpora import Example

SENTENCES = ["the cat sat on the mat.", "where is the dog?", "the big red house is under the tree, and the cat ran fast."]


def test_causal_configurations_are_told_from_encoders():
    from transformers import BertConfig, GPT2Config, LlamaConfig

    small = dict(vocab_size=50, num_hidden_layers=1, num_attention_heads=2)
    assert kind_of(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=50)) is DECODER
    assert kind_of(LlamaConfig(hidden_size=8, intermediate_size=16, **small)) is DECODER
    assert kind_of(BertConfig(hidden_size=8, intermediate_size=16, is_decoder=True, **small)) is DECODER
    assert kind_of(BertConfig(hidden_size=8, intermediate_size=16, **small)) is not DECODER


@pytest.mark.parametrize("kind", DECODER_KINDS)
def test_a_decoder_loads_as_one_with_its_first_token_from_the_tokenizer(tiny_decoder_dirs, kind):
    loaded = load_model(tiny_decoder_dirs[kind], device="cpu")
    info = loaded.info()
    assert loaded.kind is DECODER and info["kind"] == "decoder"
    assert info["cls_token"] is None and info["sep_token"] is None
    # Llama's tokenizer puts BOS first, the others do not: that comes from the tokenizer, not the model's name
    assert loaded.adds_bos == (kind == "llama")
    assert info["first_token"] == ("BOS" if kind == "llama" else "the first piece")
    assert (loaded.tokenizer("the cat")["input_ids"][0] == loaded.tokenizer.bos_token_id) == loaded.adds_bos


def test_a_decoder_has_no_masked_lm_head_and_an_encoder_no_causal_one(tiny_gpt2_dir, tiny_bert_dir):
    with pytest.raises(ModelError, match="has no masked-LM head"):
        load_model(tiny_gpt2_dir, device="cpu", head="masked-lm")
    with pytest.raises(ModelError, match="is an encoder, not a causal language model"):
        load_model(tiny_bert_dir, device="cpu", head="causal-lm")
    assert type(load_model(tiny_gpt2_dir, device="cpu", head="causal-lm").model).__name__ == "GPT2LMHeadModel"


@pytest.mark.parametrize("kind", DECODER_KINDS)
def test_maps_equal_transformers_eager_attention(tiny_decoder_dirs, kind):
    loaded = float64_model(tiny_decoder_dirs[kind])
    model = loaded.model
    engine = Engine(loaded, batch_size=3, progress=False)
    items = list(engine.encode(enumerate([Example(text) for text in SENTENCES]), RunStats()))
    batch = engine.run_batch(items)  # one padded batch: right padding, as the engine collates every model
    maps = batch.attentions.numpy()  # [layer, batch, head, n, n]
    for b, item in enumerate(items):
        n = len(item)
        model.config._attn_implementation = "eager"
        try:
            with torch.no_grad():
                reference = model(input_ids=torch.tensor([item.input_ids]), output_attentions=True).attentions
        finally:
            model.config._attn_implementation = "bertology"
        for layer, expected in enumerate(reference):
            # transformers' eager attention takes the softmax in float32 for Llama, Qwen2 and GPT-NeoX: equal to its precision
            np.testing.assert_allclose(maps[layer, b, :, :n, :n], expected[0].numpy(), atol=2e-7 if kind != "gpt2" else 1e-12, rtol=0)
        # causal: nothing above the diagonal; each row sums to 1 over the keys it sees; padding is neither query nor key
        assert np.all(np.triu(maps[:, b, :, :n, :n], k=1) == 0)
        np.testing.assert_allclose(maps[:, b, :, :n, :n].sum(-1), 1, atol=1e-12)
        assert np.all(maps[:, b, :, n:, :] == 0) and np.all(maps[:, b, :, :, n:] == 0)
    # the batch knows it is a decoder's: the first token in [CLS]'s place, no [SEP], row 0 out of the queries' means
    assert batch.kind is DECODER and set(batch.anchors) == {"first"}
    assert batch.anchors["first"][:, 0].all() and batch.anchors["first"].sum() == len(items)
    assert not batch.query_mask[:, 0].any() and batch.query_mask.sum() == batch.mask.sum() - len(items)
    np.testing.assert_array_equal(batch.visible_counts[0].numpy(), np.minimum(np.arange(1, maps.shape[-1] + 1), len(items[0])) * batch.mask[0].numpy())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_grouped_query_heads_share_their_key_value_head(tiny_decoder_dirs, kind):
    loaded = float64_model(tiny_decoder_dirs[kind])
    values, keys = [], []
    hooks = Hooks().add("value", lambda layer, value: values.append(value.clone())).add("key", lambda layer, key: keys.append(key.clone()))
    with torch.inference_mode(), hooks.attach(loaded.model):
        loaded.model(input_ids=torch.tensor([loaded.tokenizer("the cat sat on the mat.")["input_ids"]]))
    groups = loaded.model.config.num_attention_heads // loaded.model.config.num_key_value_heads
    assert groups == 2
    for tensor in values + keys:
        for head in range(loaded.num_heads):
            torch.testing.assert_close(tensor[:, head], tensor[:, head - head % groups], rtol=0, atol=0)
        assert not torch.equal(tensor[:, 0], tensor[:, groups])


@pytest.mark.parametrize("kind", DECODER_KINDS)
def test_norm_view_on_a_pre_norm_block_equals_numpy(tiny_decoder_dirs, kind):
    # Kobayashi et al. 2020 on a pre-norm block: f_h(x) = LN(x) W_V^h W_O^h with the real normalised input LN(x)
    # (docs/methods.md#decoders); numpy from the architecture's own weights and the layer input
    loaded = float64_model(tiny_decoder_dirs[kind])
    model = loaded.model
    ids = torch.tensor([loaded.tokenizer("the big red house is under the tree.")["input_ids"]])
    blocks = attention_blocks(model)
    assert all(block.pre_norm for block in blocks)
    inputs, patterns = [], []
    handles = [block.layer_norm.register_forward_hook(lambda module, args, output: inputs.append(output.detach().clone())) for block in blocks]
    hooks = Hooks().add("pattern", lambda layer, pattern: patterns.append(pattern.clone()))
    try:
        with torch.inference_mode(), hooks.attach(model):
            model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    engine = Engine(loaded, progress=False)
    items = list(engine.encode(enumerate([Example("the big red house is under the tree.")]), RunStats()))
    batch = engine.run_batch(items, needs=PassNeeds(norms=True, vectors=True))
    heads, hidden = loaded.num_heads, model.config.hidden_size
    head_dim = hidden // heads
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for layer, block in enumerate(blocks):
        x = inputs[layer][0].numpy()  # LN(x): [n, hidden]
        attention = block.attention
        if kind == "gpt2":
            w = attention.c_attn.weight.detach().numpy()
            b = attention.c_attn.bias.detach().numpy()
            value = (x @ w + b)[:, 2 * hidden:]
            w_out = attention.c_proj.weight.detach().numpy()  # Conv1D: [in, out]
        elif kind == "gpt_neox":
            qkv = x @ attention.query_key_value.weight.detach().numpy().T + attention.query_key_value.bias.detach().numpy()
            value = qkv.reshape(len(x), heads, 3 * head_dim)[:, :, 2 * head_dim:].reshape(len(x), hidden)
            w_out = attention.dense.weight.detach().numpy().T
        else:
            v_proj = attention.v_proj
            value = x @ v_proj.weight.detach().numpy().T + (v_proj.bias.detach().numpy() if v_proj.bias is not None else 0)
            value = np.repeat(value.reshape(len(x), kv_heads, head_dim), heads // kv_heads, axis=1).reshape(len(x), hidden)
            w_out = attention.o_proj.weight.detach().numpy().T
        transformed = np.stack([value[:, h * head_dim:(h + 1) * head_dim] @ w_out[h * head_dim:(h + 1) * head_dim] for h in range(heads)])
        norms = np.linalg.norm(transformed, axis=-1)  # [head, key]
        np.testing.assert_allclose(batch.key_norms[layer, 0].numpy(), norms, rtol=1e-10)
        np.testing.assert_allclose(batch.vector_norms[layer, 0, :, 2].numpy(), norms, rtol=1e-10)
        np.testing.assert_allclose(batch.vector_norms[layer, 0, :, 1].numpy(), np.linalg.norm(value.reshape(len(x), heads, head_dim), axis=-1).T,
                                   rtol=1e-10)
        a = patterns[layer][0].numpy()
        weighted = a * norms[:, None, :]
        np.testing.assert_allclose(batch.weighted("norm").attentions[layer, 0].numpy(), weighted / weighted.sum(-1, keepdims=True), rtol=1e-10)


def test_mixing_ratios_are_refused_on_a_pre_norm_block(tiny_gpt2_dir):
    from bertology.core.errors import BertologyError

    engine = Engine(float64_model(tiny_gpt2_dir), progress=False)
    items = list(engine.encode(enumerate([Example("the cat sat.")]), RunStats()))
    with pytest.raises(BertologyError, match="pre-norm"):
        engine.run_batch(items, needs=PassNeeds(mixing=True))


def test_a_uniform_head_on_a_decoder_is_uniform_over_the_keys_each_query_sees(tiny_gpt2_dir):
    from bertology.core.model.interventions import Intervention, attach_variants

    loaded = float64_model(tiny_gpt2_dir)
    ids = torch.tensor([loaded.tokenizer("the cat sat on the mat.")["input_ids"]])
    seen = []
    hooks = attach_variants(Hooks(), [Intervention(uniform=frozenset({(0, 1)}))], loaded.num_heads)
    hooks.add("pattern", lambda layer, pattern: seen.append(pattern.clone()) if layer == 0 else None)
    with torch.inference_mode(), hooks.attach(loaded.model):
        loaded.model(input_ids=ids)
    n = ids.shape[1]
    expected = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    np.testing.assert_allclose(seen[0][0, 1].numpy(), expected, rtol=1e-12)


@pytest.mark.parametrize("kind", list(tiny_decoder_configs()))
def test_other_decoder_families_give_transformers_eager_maps(kind):
    from transformers import AutoModelForCausalLM

    from bertology.core.model.hooks import register_attention

    register_attention()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_decoder_configs()[kind]).double().eval()
    ids = torch.randint(3, 100, (1, 9))
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        reference = model(input_ids=ids, output_attentions=True)
    model.config._attn_implementation = "bertology"
    patterns = []
    hooks = Hooks().add("pattern", lambda layer, pattern: patterns.append(pattern.clone()))
    with torch.no_grad(), hooks.attach(model):
        logits = model(input_ids=ids).logits
    assert kind_of(model.config) is DECODER and len(patterns) == 2
    for expected, pattern in zip(reference.attentions, patterns):  # transformers' eager softmax is float32: equal to its precision
        np.testing.assert_allclose(pattern.numpy(), expected.numpy(), atol=2e-7, rtol=0)
    np.testing.assert_allclose(logits.numpy(), reference.logits.numpy(), atol=1e-6, rtol=0)
    blocks = attention_blocks(model)
    assert len(blocks) == 2 and all(block.pre_norm == (kind != "opt_post_norm") for block in blocks)
    assert blocks[0].output_weight.shape == (model.config.num_attention_heads * (getattr(model.config, "head_dim", None) or 8), model.config.hidden_size)


def test_a_decoder_that_bypasses_the_attention_interface_is_refused_in_one_line(tmp_path):
    # GPT-Neo computes attention in its own code: bertology's hook points never fire, so it cannot read its maps
    from conftest import byte_level_bpe
    from transformers import GPTNeoConfig, GPTNeoForCausalLM, PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(), bos_token="<|endoftext|>", eos_token="<|endoftext|>").save_pretrained(tmp_path)
    GPTNeoForCausalLM(GPTNeoConfig(num_layers=2, num_heads=4, hidden_size=32, attention_types=[[["global", "local"], 1]], window_size=4,
                                   max_position_embeddings=64, vocab_size=300)).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="a gpt_neo model computes attention in its own code, not through transformers' attention interface"):
        load_model(tmp_path, device="cpu")
