"""Pande et al.'s roles on decoders (docs/methods.md#decoders): causal sieve sets, per-row uniform references, row 0 out;
against loops over transformers' own eager maps."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import TEXTS, eager_reference

from bertology.core.engine import Engine
from bertology.core.model.kinds import DECODER
from bertology.core.text.corpora import Example
from bertology.families.roles.analyzer import HeadRoles, role_names

DECODER_ROLES = role_names(DECODER)

EXAMPLES = [Example(text) for text in TEXTS[:5]] + [Example("the cat sat.", "the dog ran."), Example("where is it?", "it is under the table.")]


def by_hand(a: np.ndarray, segments: list[int | None], window: int = 2) -> dict:
    """Sieve scores of one causal map: mean over queries i >= 1 of (1/|S_i|) sum_{S_i} a[i, j] / (1 / (i + 1))."""
    n = a.shape[0]
    local = [sum(a[i, j] for j in range(max(0, i - window), i + 1)) / (min(i, window) + 1) * (i + 1) for i in range(1, n)]
    scores = {"local": np.mean(local), "delimiter": np.mean([a[i, 0] * (i + 1) for i in range(1, n)])}
    if any(segment == 1 for segment in segments):
        terms = []
        for i in range(1, n):
            own = segments[i] if segments[i] is not None else 0
            keys = [j for j in range(i + 1) if segments[j] == own]
            if keys:
                entropy = -sum(a[i, j] * math.log(a[i, j]) for j in range(n) if a[i, j] > 0)
                terms.append(sum(a[i, j] for j in keys) / len(keys) * (i + 1) * entropy)
        scores["block"] = np.mean(terms)
    return scores


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decoder_sieve_scores_equal_loops_over_eager_maps(kind, gpt2_64, llama64):
    loaded = {"gpt2": gpt2_64, "llama": llama64}[kind]
    analyzer = HeadRoles(loaded.kind, tau=1.0)
    Engine(loaded, batch_size=3, progress=False).run(EXAMPLES, [analyzer])
    table = analyzer.result().set_index(["layer", "head", "role"])
    assert set(table.index.unique("role")) == set(DECODER_ROLES)  # no cls or sep variants on a decoder
    rtol = 1e-10 if kind == "gpt2" else 1e-6  # transformers' eager Llama takes its softmax in float32
    references = eager_reference(loaded, EXAMPLES)
    for layer in range(loaded.num_layers):
        for head in range(loaded.num_heads):
            scores = [by_hand(r["attentions"][layer, head], loaded.tokenizer(e.text, e.text_pair).sequence_ids()) for r, e in zip(references, EXAMPLES)]
            for role in DECODER_ROLES:
                values = [s[role] for s in scores if role in s]
                row = table.loc[(layer, head, role)]
                assert row.n == len(values)
                np.testing.assert_allclose(row["mean"], np.mean(values), rtol=rtol, err_msg=f"{layer}-{head} {role}")


def test_uniform_causal_attention_scores_one_on_every_role():
    # uniform attention over the keys each row sees is the reference: a decoder's role scores give every role exactly 1 (the
    # block's entropy weight aside), whatever the row, where a score against 1/n would drift with the row
    import torch

    from bertology.core.model.kinds import first_token_mask
    from bertology.families.roles.analyzer import role_scores

    n = 7
    attention = torch.tensor(np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None])[None, None]  # [batch 1, head 1, n, n]
    mask = torch.ones(1, n, dtype=torch.bool)
    scores = role_scores(attention, mask, {"first": first_token_mask(mask)}, torch.zeros(1, n, dtype=torch.long), DECODER, any_pair=False)
    assert tuple(scores) == ("local", "delimiter", "block") == DECODER_ROLES
    np.testing.assert_allclose([scores["local"].item(), scores["delimiter"].item()], 1.0, rtol=1e-12)
    assert torch.isnan(scores["block"]).all()  # no pair: no block score
