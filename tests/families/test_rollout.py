"""Attention rollout (Abnar & Zuidema 2020, METHODS.md section 7) against a plain numpy loop."""

import numpy as np
import torch

from bertology.core.engine import Engine, RunStats
from bertology.families.rollout.analyzer import ROLLOUT_ROWS, ROLLOUT_TARGETS, AttentionRollout, rollout
from conftest import tiny_examples


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
    analyzer = AttentionRollout()
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
