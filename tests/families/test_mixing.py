"""Context-mixing ratios per layer (Kobayashi et al. 2021): the analyzer's means against the engine's per-token ratios by hand.
The ratios themselves are checked against numpy from each architecture's weights in tests/test_norms.py."""

import numpy as np
import pytest

import bertology
from bertology.core.engine import Engine, RunStats
from bertology.core.norms import MIXING_RATIOS
from bertology.families.mixing.analyzer import ContextMixing
from conftest import tiny_examples


def test_the_analyzer_averages_tokens_then_sequences(tiny_bert):
    examples = tiny_examples()
    engine = Engine(tiny_bert, progress=False)
    analyzer = ContextMixing()
    engine.run(examples, [analyzer])
    table = analyzer.result().set_index(["layer", "ratio"])

    per_sequence = []
    for item in engine.encode(enumerate(examples), RunStats()):
        batch = engine.run_batch([item], mixing=True)
        per_sequence.append(batch.mixing[:, 0].double().numpy().mean(axis=1))  # [layer, ratio]: mean over the tokens
    per_sequence = np.stack(per_sequence)
    for layer in range(tiny_bert.num_layers):
        for k, ratio in enumerate(MIXING_RATIOS):
            values = per_sequence[:, layer, k]
            assert table.loc[(layer, ratio), "value"] == pytest.approx(values.mean(), abs=1e-6)
            half = 2.2621571627409915 * values.std(ddof=1) / np.sqrt(len(values))  # t_{0.975, 9}: ten sequences
            assert table.loc[(layer, ratio), "ci_high"] - table.loc[(layer, ratio), "value"] == pytest.approx(half, rel=1e-5)
    assert ((table.value > 0) & (table.value < 1)).all()


def test_mixing_on_the_bundled_model_is_far_below_the_attention_alone(minilm):
    """Kobayashi et al. 2021's finding on BERT holds on MiniLM too: with the residual and the layer norm, a token keeps most of itself."""
    result = bertology.analyze(minilm, ["The old lighthouse keeper climbed the stairs every evening.", "Where did you put the keys?"],
                               analyses=["mixing"], progress=False, view=False)
    wide = result.mixing.pivot(index="layer", columns="ratio", values="value")
    assert (wide.attn_res_ln < 0.5).all() and (wide.attn > wide.attn_res).all()
