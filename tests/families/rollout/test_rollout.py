"""Attention rollout (Abnar & Zuidema 2020, METHODS.md section 7) against a plain numpy loop."""

import numpy as np
import torch
from conftest import tiny_examples

from bertology.core.engine import Engine, RunStats
from bertology.core.model.kinds import ENCODER
from bertology.families.rollout.analyzer import AttentionRollout, rollout, rollout_rows, rollout_targets

ROLLOUT_ROWS, ROLLOUT_TARGETS = rollout_rows(ENCODER), rollout_targets(ENCODER)


def numpy_rollout(maps):
    """``maps[layer, head, n, n]`` of one sequence -> ``R[layer, n, n]`` by the definition, one layer at a time."""
    n = maps.shape[-1]
    rolled = np.eye(n)
    out = []
    for layer in maps:
        step = 0.5 * layer.mean(axis=0) + 0.5 * np.eye(n)
        step = step / step.sum(axis=1, keepdims=True)
        rolled = step @ rolled
        out.append(rolled)
    return np.stack(out)


def test_rollout_of_padded_maps_equals_numpy_on_the_real_tokens():
    rng = np.random.default_rng(0)
    lengths, width = (5, 3), 5
    maps = np.zeros((3, len(lengths), 2, width, width))
    for b, n in enumerate(lengths):
        raw = rng.random((3, 2, n, n))
        maps[:, b, :, :n, :n] = raw / raw.sum(-1, keepdims=True)
    rolled = rollout(torch.from_numpy(maps)).numpy()
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(rolled[:, b, :n, :n], numpy_rollout(maps[:, b, :, :n, :n]), atol=1e-14)
        np.testing.assert_allclose(rolled[:, b, :n, :n].sum(-1), 1.0, atol=1e-14)  # rows stay distributions
        assert not rolled[:, b, :n, n:].any()  # the real tokens never reach padding


def test_rollout_of_one_identity_layer_is_half_attention_plus_half_self():
    maps = torch.zeros(1, 1, 1, 3, 3, dtype=torch.float64)
    maps[..., :, 0] = 1.0  # every token looks at the first
    rolled = rollout(maps)[0, 0]
    assert torch.allclose(rolled, torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5]], dtype=torch.float64))


def test_the_analyzer_averages_per_sequence_values_computed_by_hand(tiny_bert):
    examples = tiny_examples()
    engine = Engine(tiny_bert, progress=False)
    analyzer = AttentionRollout(tiny_bert.kind)
    engine.run(examples, [analyzer])
    table = analyzer.result().set_index(["layer", "row", "target"])

    items = list(engine.encode(enumerate(examples), RunStats()))
    expected = {}
    for item in items:
        batch = engine.run_batch([item])
        ids = np.array(item.input_ids)
        rolled = numpy_rollout(batch.attentions[:, 0].double().numpy())
        sets = {"cls": ids == tiny_bert.cls_token_id, "sep": ids == tiny_bert.sep_token_id, "punct": batch.punct_mask[0].numpy()}
        cls = int(np.flatnonzero(ids == tiny_bert.cls_token_id)[0])
        for layer, r in enumerate(rolled):
            for target in ROLLOUT_TARGETS:
                every = np.mean(np.diag(r)) if target == "self" else r[:, sets[target]].sum(1).mean()
                row = r[cls, cls] if target == "self" else r[cls, sets[target]].sum()
                expected.setdefault((layer, "all", target), []).append(every)
                expected.setdefault((layer, "cls_row", target), []).append(row)
    assert len(table) == len(expected) == tiny_bert.num_layers * len(ROLLOUT_ROWS) * len(ROLLOUT_TARGETS)
    for key, values in expected.items():
        assert table.loc[key, "value"] == np.float64(np.mean(values)) or np.isclose(table.loc[key, "value"], np.mean(values), atol=1e-6), key
        assert table.loc[key, "n"] == len(examples)


def test_every_line_of_the_figure_shows_even_where_two_coincide(tiny_bert):
    """Issue 26: at the [CLS] position, 'its own input token' is [CLS], so its line lies on the [CLS] line. Each line has its
    own marker and line style, each marker smaller than the one before (drawn over it), and the legend says why two coincide."""
    from bertology.families.rollout.report import rollout_by_layer

    analyzer = AttentionRollout(tiny_bert.kind)
    Engine(tiny_bert, progress=False).run(tiny_examples(), [analyzer])
    table = analyzer.result()
    figure = rollout_by_layer(table, ENCODER)
    for axis, row in zip(figure.axes, ("cls_row", "all")):
        lines = [container.lines[0] for container in axis.containers]
        assert len(lines) == len(ROLLOUT_TARGETS)
        assert len({(line.get_marker(), str(line.get_linestyle())) for line in lines}) == len(lines)
        sizes = [line.get_markersize() for line in lines]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
        for line, target in zip(lines, ROLLOUT_TARGETS):
            np.testing.assert_array_equal(line.get_ydata(), table[(table.row == row) & (table.target == target)].value)
    cls_row = table[table.row == "cls_row"].set_index(["layer", "target"]).value.unstack()
    np.testing.assert_allclose(cls_row["self"], cls_row["cls"], atol=1e-12)  # the two lines that lie on one another
    assert [text.get_text() for text in figure.axes[0].get_legend().get_texts()][-1] == "its own input token (= input [CLS] here)"


def test_the_summary_gives_each_targets_first_and_last_layer_and_the_peak_between():
    import pandas as pd

    from bertology.families import FamilyResult, get_family

    values = {"cls": [0.1, 0.3, 0.5, 0.4], "sep": [0.2, 0.2, 0.25, 0.3], "punct": [0.05, 0.01, 0.02, 0.03], "self": [0.6, 0.4, 0.2, 0.1]}
    rows = [(layer, row, target, values[target][layer] * (1 if row == "all" else 2), 0.0, 1.0, 10)
            for layer in range(4) for row in ROLLOUT_ROWS for target in ROLLOUT_TARGETS]
    table = pd.DataFrame(rows, columns=["layer", "row", "target", "value", "ci_low", "ci_high", "n"])
    assert get_family("rollout").summary(FamilyResult(tables={"rollout": table})) == [
        "attention rollout from every query (Abnar & Zuidema 2020): to itself 0.60 in layer 0 to 0.10 in layer 3; "
        "to [CLS] 0.10 in layer 0 to 0.40 in layer 3 (highest 0.50, layer 2); to [SEP] 0.20 in layer 0 to 0.30 in layer 3; "
        "to punctuation 0.05 in layer 0 to 0.03 in layer 3 (lowest 0.01, layer 1)"
    ]  # the [CLS] row (doubled here) is not the line's


def test_the_summary_of_a_run_matches_its_table(tiny_bert):
    from bertology.api import analyze
    from bertology.families import get_family

    result = analyze(tiny_bert, tiny_examples(), analyses=["rollout"], progress=False, view=False)
    [line] = get_family("rollout").summary(result.results["rollout"])
    every = result.table("rollout")[result.table("rollout").row == "all"].set_index(["target", "layer"]).value
    last = tiny_bert.num_layers - 1
    for target, name in (("self", "itself"), ("cls", "[CLS]"), ("sep", "[SEP]"), ("punct", "punctuation")):
        assert f"to {name} {every[target, 0]:.2f} in layer 0 to {every[target, last]:.2f} in layer {last}" in line
