"""The keys each query sees come from the mask the model applied, layer by layer (sliding windows, alternating local and
global layers), and the uniform null model (``Engine(null="uniform")``) is the model with every query projection zeroed."""

import pytest
import torch
from conftest import float64_model, tiny_examples

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Engine, RunStats
from bertology.core.errors import BertologyError
from bertology.core.model.hooks import register_attention
from bertology.core.model.models import describe_model


def windowed(tiny_llama_dir, name: str, window: int):
    """A tiny ``name`` decoder (Mistral: a sliding window in every layer; Gemma 2: local and global layers alternating) with
    the tiny Llama's tokenizer, float64."""
    import transformers as T

    llama = float64_model(tiny_llama_dir)
    sizes = dict(vocab_size=llama.model.config.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, sliding_window=window, pad_token_id=llama.tokenizer.pad_token_id)
    config = T.MistralConfig(**sizes) if name == "mistral" else T.Gemma2Config(head_dim=8, **sizes)
    register_attention()
    torch.manual_seed(0)
    model = T.AutoModel.from_config(config, attn_implementation="bertology").double().eval()
    return describe_model(model, llama.tokenizer, name=name, device=torch.device("cpu"))


def window_by_hand(n: int, width: int, window: int | None) -> torch.Tensor:
    """``[width, width]``: query i sees key j when both are real, j <= i, and (with a window) i - j < window."""
    seen = torch.zeros(width, width, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            seen[i, j] = window is None or i - j < window
    return seen


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_the_visible_keys_are_the_mask_the_model_applied_layer_by_layer(tiny_llama_dir, name):
    loaded = windowed(tiny_llama_dir, name, window=3)
    engine = Engine(loaded, progress=False)
    items = list(engine.encode(enumerate(tiny_examples()[:3]), RunStats()))
    batch = engine.run_batch(items)
    local_layers = [getattr(loaded.model.config, "layer_types", None)[layer] == "sliding_attention" if name == "gemma2" else True
                    for layer in range(4)]
    assert any(local_layers) and (name == "mistral" or not all(local_layers))  # Gemma 2 alternates
    width = batch.mask.shape[1]
    for layer in range(4):
        expected = torch.stack([window_by_hand(len(item), width, 3 if local_layers[layer] else None) for item in items])
        assert torch.equal(batch.layer_maps(layer).visible(batch), expected), layer
        weighted = batch.attentions[layer].abs().amax(dim=1) > 0  # where some head gives weight
        assert torch.equal(weighted, expected), layer


def test_the_uniform_null_is_the_model_with_its_queries_zeroed(tiny_llama_dir, tiny_bert_dir):
    for folder, query in ((tiny_llama_dir, "q_proj"), (tiny_bert_dir, "query")):
        loaded = float64_model(folder)
        items = list(Engine(loaded, progress=False).encode(enumerate(tiny_examples()[:4]), RunStats()))
        null = Engine(loaded, progress=False, null="uniform").run_batch(items)
        with torch.no_grad():
            for name, parameter in loaded.model.named_parameters():
                if f".{query}." in name:
                    parameter.zero_()
        zeroed = Engine(loaded, progress=False).run_batch(items)
        torch.testing.assert_close(null.attentions, zeroed.attentions, rtol=0, atol=1e-12)
        for layer in range(null.attentions.shape[0]):  # 1 / |S_i| on every key each query sees
            visible = null.layer_maps(layer).visible(null).double()
            uniform = visible / visible.sum(-1, keepdim=True).clamp(min=1)
            torch.testing.assert_close(null.attentions[layer], uniform[:, None].expand_as(null.attentions[layer]), rtol=0, atol=1e-15)


def test_an_unknown_null_model_is_refused(tiny_bert):
    with pytest.raises(BertologyError, match="unknown null model 'zeros'"):
        Engine(tiny_bert, null="zeros")


class UniformRecorder(LayerwiseAnalyzer):
    """Records, per layer, the heads' maps and the layer's uniform head in the view it is given (LayerMaps.uniform)."""

    name = "uniform_recorder"

    def __init__(self):
        self.maps, self.uniform = [], []

    def update_layer(self, batch, maps):
        self.maps.append(maps.attention.double().clone())
        self.uniform.append(maps.uniform(batch).clone())

    def finish_batch(self, batch):
        pass

    def merge(self, other):
        return self

    def result(self):
        return None


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("view", ["attention", "norm", "alti", "value-zeroing"])
def test_under_the_null_model_every_views_uniform_head_is_what_the_heads_show(tiny_gpt2_dir, tiny_bert_dir, view, layerwise):
    # the null model's heads are the uniform head, so in any view of attention (the weights, Kobayashi's norm shares, the
    # per-head ALTI and value-zeroing maps) each head's maps, computed by the pass, equal the uniform head's in that view,
    # computed from the visible keys alone: [batch, 1, n, n] for the weights, one per head in the views of each head's vectors
    for folder in (tiny_gpt2_dir, tiny_bert_dir):
        loaded = float64_model(folder)
        recorder = UniformRecorder()
        engine = Engine(loaded, progress=False, null="uniform", layerwise=layerwise, batch_size=3)
        engine.run(tiny_examples()[:5], [recorder], weightings=[view])
        assert len(recorder.maps) == 2 * loaded.num_layers  # two batches
        for heads, uniform in zip(recorder.maps, recorder.uniform):
            assert uniform.dtype == torch.float64
            assert uniform.shape[1] == (1 if view == "attention" else loaded.num_heads)
            torch.testing.assert_close(heads, uniform.expand_as(heads), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["bert", "gemma2"])
def test_layers_that_saw_the_same_keys_share_one_uniform_head_and_others_have_their_own(tiny_llama_dir, tiny_bert, name):
    """The uniform head is made once a batch where layers saw the same keys (BERT's one mask, padded), and made anew for a
    layer whose mask differs (Gemma 2's local and global layers); each equals the uniform rows over that layer's keys."""
    from bertology.core.model.kinds import uniform_rows

    loaded = tiny_bert if name == "bert" else windowed(tiny_llama_dir, name, window=3)
    engine = Engine(loaded, progress=False)
    items = list(engine.encode(enumerate(tiny_examples()[:3]), RunStats()))
    assert len({len(item) for item in items}) > 1  # padded: the model's own mask is in play
    seen = []

    def keep(batch, layer, maps):
        weights = maps("attention")
        seen.append((weights.uniform(batch), weights.visible(batch).clone()))

    engine.run_batch(items, on_layer=keep)
    for uniform, visible in seen:
        torch.testing.assert_close(uniform, uniform_rows(visible)[:, None], rtol=0, atol=0)
    shared = [later[0] is earlier[0] for earlier, later in zip(seen, seen[1:])]
    if name == "bert":
        assert all(shared) and len(shared) >= 1
    else:
        local = [loaded.model.config.layer_types[layer] == "sliding_attention" for layer in range(len(seen))]
        assert shared == [a == b for a, b in zip(local, local[1:])] and not any(shared)  # alternating: each layer its own
