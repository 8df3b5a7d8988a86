"""Rollout on decoders (docs/methods.md#decoders): every query but row 0, and the last row, against numpy."""

from __future__ import annotations

import numpy as np
from conftest import TEXTS, eager_reference

from bertology.core.engine import Engine
from bertology.core.model.kinds import DECODER
from bertology.core.text.corpora import Example
from bertology.families.rollout.analyzer import AttentionRollout, rollout_rows, rollout_targets

DECODER_ROLLOUT_ROWS, DECODER_ROLLOUT_TARGETS = rollout_rows(DECODER), rollout_targets(DECODER)

EXAMPLES = [Example(text) for text in TEXTS]


def test_decoder_rollout_equals_numpy(gpt2_64):
    analyzer = AttentionRollout(gpt2_64.kind)
    Engine(gpt2_64, batch_size=3, progress=False).run(EXAMPLES, [analyzer])
    table = analyzer.result().set_index(["layer", "row", "target"])
    assert set(table.index.unique("row")) == set(DECODER_ROLLOUT_ROWS) and set(table.index.unique("target")) == set(DECODER_ROLLOUT_TARGETS)
    expected = {}
    for reference in eager_reference(gpt2_64, EXAMPLES):
        n = len(reference["ids"])
        punct = np.array([gpt2_64.punct_by_id[piece] for piece in reference["ids"]], dtype=float)
        rolled = np.eye(n)
        for layer, maps in enumerate(reference["attentions"]):
            step = 0.5 * maps.mean(0) + 0.5 * np.eye(n)
            rolled = (step / step.sum(-1, keepdims=True)) @ rolled
            later = rolled[1:]  # every query but row 0
            values = {("all", "first"): later[:, 0].mean(), ("all", "punct"): (later @ punct).mean(), ("all", "self"): np.diag(rolled)[1:].mean(),
                      ("last_row", "first"): rolled[-1, 0], ("last_row", "punct"): rolled[-1] @ punct, ("last_row", "self"): rolled[-1, -1]}
            for key, value in values.items():
                expected.setdefault((layer, *key), []).append(value)
    for key, values in expected.items():
        np.testing.assert_allclose(table.loc[key, "value"], np.mean(values), rtol=1e-10, err_msg=str(key))
