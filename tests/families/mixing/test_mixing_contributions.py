"""The mixing family's ALTI and value-zeroing shares (--contributions) against numpy ports of the authors' code."""

from __future__ import annotations

import numpy as np
import torch
from conftest import float64_model, tiny_examples
from reference.alti import alti
from reference.value_zeroing import value_zeroing

from bertology.core.engine import Engine
from bertology.families.mixing.analyzer import ContextMixing


def test_the_share_from_other_tokens_equals_the_ports(tiny_bert_dir):
    loaded = float64_model(tiny_bert_dir)
    examples = [example for example in tiny_examples() if example.text_pair is None]  # the ports embed without segment ids
    analyzer = ContextMixing(("alti", "value_zeroing"))
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
