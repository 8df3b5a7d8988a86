"""The mixing family's ALTI and value-zeroing shares (--contributions) against numpy ports of the authors' code."""

from __future__ import annotations

import numpy as np
import torch
from conftest import float64_model, tiny_examples
from reference.alti import alti
from reference.value_zeroing import value_zeroing

from bertology.core.engine import Engine, PassNeeds
from bertology.families.mixing.analyzer import ContextMixing


def test_the_share_from_other_tokens_equals_the_ports(tiny_bert_dir):
    loaded = float64_model(tiny_bert_dir)
    examples = [example for example in tiny_examples() if example.text_pair is None]  # the ports embed without segment ids
    analyzer = ContextMixing(loaded.kind, ("alti", "value_zeroing"))
    Engine(loaded, batch_size=3, progress=False).run(examples, [analyzer])
    table = analyzer.result().set_index(["layer", "ratio"])
    shares = {}
    for example in examples:
        ids = torch.tensor(loaded.tokenizer(example.text, example.text_pair)["input_ids"])
        ports = {"alti": alti(loaded.model, ids, ln_eps="model", distance_eps=0.0), "value_zeroing": value_zeroing(loaded.model, ids, per_head=False)}
        for measure, port in ports.items():
            maps, rolled = (port.contributions, port.rollout) if measure == "alti" else (port.layers, port.rollout)
            for layer in range(loaded.num_layers):
                shares.setdefault((layer, measure), []).append(1 - np.diag(maps[layer]).mean())
                shares.setdefault((layer, f"{measure}_rollout"), []).append(1 - np.diag(rolled[layer]).mean())
    for key, values in shares.items():
        np.testing.assert_allclose(table.loc[key, "value"], np.mean(values), atol=1e-8, err_msg=str(key))
        assert table.loc[key, "n"] == len(examples)


def test_on_a_decoder_the_shares_alone_equal_the_mean_over_tokens_of_each_sequences_own_maps(tiny_gpt2_dir):
    # Kobayashi's ratios take a post-norm block: on a decoder the family runs with the contribution measures alone
    from bertology.core.engine import RunStats

    loaded = float64_model(tiny_gpt2_dir)
    examples = tiny_examples()
    analyzer = ContextMixing(loaded.kind, ("alti", "value_zeroing"))  # a decoder: no ratios
    assert analyzer.needs == {"alti", "value_zeroing"}
    engine = Engine(loaded, batch_size=3, progress=False)
    engine.run(examples, [analyzer])
    table = analyzer.result().set_index(["layer", "ratio"])
    assert set(table.index.get_level_values("ratio")) == {"alti", "alti_rollout", "value_zeroing", "value_zeroing_rollout"}
    shares = {}
    for item in engine.encode(enumerate(examples), RunStats()):  # each sequence alone, unpadded
        maps = engine.run_batch([item], needs=PassNeeds(contributions=("alti", "value_zeroing"))).contributions
        for measure, layers in maps.items():
            rolled = None
            for layer, contributions in enumerate(layers[:, 0].numpy()):
                rolled = contributions if rolled is None else contributions @ rolled
                # the mean over queries leaves row 0 out (it sees only itself: c[0, 0] = 1), as every decoder mean does
                shares.setdefault((layer, measure), []).append(1 - np.diag(contributions)[1:].mean())
                shares.setdefault((layer, f"{measure}_rollout"), []).append(1 - np.diag(rolled)[1:].mean())
    for key, values in shares.items():
        np.testing.assert_allclose(table.loc[key, "value"], np.mean(values), atol=1e-9, err_msg=str(key))
        assert table.loc[key, "n"] == len(examples)


def test_the_rolled_out_shares_multiply_in_layer_order_on_four_layers(tiny_bert_dir):
    """On two layers the mean of a product's diagonal is the same in either order (trace(c1 c0) = trace(c0 c1)), and on a
    decoder's triangular maps in any number of layers, so only a deeper encoder tells ``R_l = c_l R_{l-1}`` from the wrong
    order (issue 39): a four-layer BERT, against loops in numpy."""
    from transformers import BertConfig, BertModel

    from bertology.core.engine import RunStats
    from bertology.core.model.hooks import register_attention
    from bertology.core.model.models import describe_model

    tiny = float64_model(tiny_bert_dir)
    register_attention()
    torch.manual_seed(0)
    # large weights: tokens mix (a random tiny BERT keeps each token almost whole, and then any order agrees)
    config = BertConfig(**{**tiny.model.config.to_dict(), "num_hidden_layers": 4, "initializer_range": 1.0})
    model = BertModel(config, add_pooling_layer=False).double().eval()
    model.config._attn_implementation = "bertology"
    loaded = describe_model(model, tiny.tokenizer, name="deep", device=torch.device("cpu"))
    examples = tiny_examples()
    analyzer = ContextMixing(loaded.kind, ("alti",))
    engine = Engine(loaded, batch_size=3, progress=False)
    engine.run(examples, [analyzer])
    table = analyzer.result().set_index(["layer", "ratio"])
    right, wrong = {}, {}
    for item in engine.encode(enumerate(examples), RunStats()):
        layers = engine.run_batch([item], needs=PassNeeds(contributions=("alti",))).contributions["alti"][:, 0].numpy()
        forward = backward = None
        for layer, contributions in enumerate(layers):
            forward = contributions if forward is None else contributions @ forward  # R_l = c_l R_{l-1}
            backward = contributions if backward is None else backward @ contributions  # the wrong order
            right.setdefault(layer, []).append(1 - np.diag(forward).mean())
            wrong.setdefault(layer, []).append(1 - np.diag(backward).mean())
    for layer in range(4):
        np.testing.assert_allclose(table.loc[(layer, "alti_rollout"), "value"], np.mean(right[layer]), atol=1e-10, err_msg=str(layer))
    assert abs(np.mean(right[3]) - np.mean(wrong[3])) > 1e-6  # the test tells the two orders apart


def test_the_section_says_why_alti_and_value_zeroing_differ_wherever_it_shows_both(tmp_path):
    """Issue 39: ALTI's share from the other tokens (about 0.05 on GPT-2) beside value zeroing's (about 0.85), both right: the
    section that shows both says why they differ (the residual counted as the token's own, or credited to no token)."""
    import pandas as pd

    from bertology.core.model.kinds import DECODER, ENCODER
    from bertology.core.storage.runfolder import RunFolder
    from bertology.families.mixing.report import ALTI_AND_VALUE_ZEROING, mixing_section

    def mixing_table(shares: dict[str, float]) -> pd.DataFrame:
        return pd.DataFrame([{"layer": layer, "ratio": ratio, "value": value, "ci_low": value - 0.01, "ci_high": value + 0.01, "n": 5}
                             for ratio, value in shares.items() for layer in range(2)])

    both = mixing_table({"alti": 0.05, "value_zeroing": 0.85})
    with RunFolder(tmp_path / "run") as folder:
        decoder = mixing_section(folder, both, DECODER)
        encoder = mixing_section(folder, mixing_table({"attn": 0.6, "attn_res": 0.2, "attn_res_ln": 0.2, "alti": 0.05, "value_zeroing": 0.85}), ENCODER)
        alti_alone = mixing_section(folder, mixing_table({"alti": 0.05}), DECODER)
    for section in (decoder, encoder):
        assert section.intro.endswith(ALTI_AND_VALUE_ZEROING)
        assert "alti" in section.tables[0][1].columns and "value_zeroing" in section.tables[0][1].columns
    assert "the residual puts token i's own vector x_i in T_i(x_i)" in ALTI_AND_VALUE_ZEROING
    assert "so it is credited to no token, not even i" in ALTI_AND_VALUE_ZEROING
    assert ALTI_AND_VALUE_ZEROING not in alti_alone.intro
