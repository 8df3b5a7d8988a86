"""Context-mixing ratios per layer (Kobayashi et al. 2021): the analyzer's means against the engine's per-token ratios by hand.
The ratios themselves are checked against numpy from each architecture's weights in tests/test_norms.py."""

import numpy as np
import pytest
from conftest import tiny_examples

import bertology
from bertology.core.engine import Engine, PassNeeds, RunStats
from bertology.core.measures.norms import MIXING_RATIOS
from bertology.families.mixing.analyzer import ContextMixing


def test_the_analyzer_averages_tokens_then_sequences(tiny_bert):
    examples = tiny_examples()
    engine = Engine(tiny_bert, progress=False)
    analyzer = ContextMixing(tiny_bert.kind)
    engine.run(examples, [analyzer])
    table = analyzer.result().set_index(["layer", "ratio"])

    per_sequence = []
    for item in engine.encode(enumerate(examples), RunStats()):
        batch = engine.run_batch([item], needs=PassNeeds(mixing=True))
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
    wide = result.table("mixing").pivot(index="layer", columns="ratio", values="value")
    assert (wide.attn_res_ln < 0.5).all() and (wide.attn > wide.attn_res).all()


def test_the_summary_gives_each_ratio_by_layer():
    import pandas as pd

    from bertology.families import FamilyResult, get_family

    values = {"attn": [0.8, 0.9, 0.85], "attn_res": [0.4, 0.3, 0.45], "attn_res_ln": [0.1, 0.2, 0.15]}
    table = pd.DataFrame([(layer, ratio, values[ratio][layer], 0.0, 1.0, 10) for layer in range(3) for ratio in MIXING_RATIOS],
                         columns=["layer", "ratio", "value", "ci_low", "ci_high", "n"])
    assert get_family("mixing").summary(FamilyResult(tables={"mixing": table})) == [
        "context mixing, the share of a token's new vector from the other tokens (Kobayashi et al. 2021): "
        "by attention alone 0.80 in layer 0 to 0.85 in layer 2 (highest 0.90, layer 1); "
        "with the residual 0.40 in layer 0 to 0.45 in layer 2 (lowest 0.30, layer 1); "
        "with the residual and layer norm 0.10 in layer 0 to 0.15 in layer 2 (highest 0.20, layer 1)"
    ]


def test_the_summary_of_a_run_matches_its_table(tiny_bert):
    from bertology.families import get_family

    result = bertology.analyze(tiny_bert, tiny_examples(), analyses=["mixing"], progress=False, view=False)
    [line] = get_family("mixing").summary(result.results["mixing"])
    wide = result.table("mixing").pivot(index="layer", columns="ratio", values="value")
    last = tiny_bert.num_layers - 1
    for ratio, name in (("attn", "by attention alone"), ("attn_res", "with the residual"), ("attn_res_ln", "with the residual and layer norm")):
        assert f"{name} {wide.loc[0, ratio]:.2f} in layer 0 to {wide.loc[last, ratio]:.2f} in layer {last}" in line
