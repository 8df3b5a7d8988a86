"""The profile on decoders (docs/methods.md#decoders) against loops over transformers' own eager maps."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import TEXTS, eager_reference

from bertology.core.engine import Engine
from bertology.core.model.kinds import DECODER
from bertology.core.text.corpora import Example
from bertology.families.profile import analyzer as profile_analyzer
from bertology.families.profile.analyzer import GeneralProfile, profile_metric_names

DECODER_PROFILE_METRICS = profile_metric_names(DECODER)

EXAMPLES = [Example(text) for text in TEXTS] + [Example("the cat sat.", "the dog ran."), Example("a")]


def by_hand(a: np.ndarray, punct: list[int]) -> dict:
    """The decoder profile of one causal n x n map: queries i >= 1 (m = n - 1), entropy smoothed over the i + 1 keys row i sees."""
    n = a.shape[0]
    m = n - 1
    entropy = [-sum(s * math.log(s) for s in (0.9999 * a[i, j] + 0.0001 / (i + 1) for j in range(i + 1))) for i in range(1, n)]
    return {
        "first": sum(a[i, 0] for i in range(1, n)) / m,
        "punct": sum(a[i, j] for i in range(1, n) for j in punct) / m,
        "self": sum(a[i, i] for i in range(1, n)) / m,
        "prev": sum(a[i, i - 1] for i in range(1, n)) / m,
        "entropy": sum(entropy) / m,
        "distance": sum(a[i, j] * (i - j) for i in range(1, n) for j in range(i + 1)) / m,
    }


@pytest.mark.parametrize("cells_at_once", [1 << 19, 1], ids=["every-row", "one-row"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decoder_profile_equals_loops_over_eager_maps(kind, cells_at_once, gpt2_64, llama64, monkeypatch):
    # one row at a time, the entropy of row i reads its keys j <= i alone
    monkeypatch.setattr(profile_analyzer, "CELLS_AT_ONCE", cells_at_once)
    loaded = {"gpt2": gpt2_64, "llama": llama64}[kind]
    analyzer = GeneralProfile(loaded.kind)
    Engine(loaded, batch_size=3, progress=False).run(EXAMPLES, [analyzer])
    table = analyzer.result().set_index(["layer", "head", "metric"])
    assert loaded.kind is DECODER and tuple(table.index.unique("metric")) == DECODER_PROFILE_METRICS  # no cls, sep, next or cls_entropy
    assert DECODER_PROFILE_METRICS == ("first", "punct", "self", "prev", "entropy", "distance")
    references = [r for r in eager_reference(loaded, EXAMPLES) if len(r["ids"]) > 1]  # one token: no query i >= 1, no claim
    assert len(references) == len(EXAMPLES) - (1 if kind == "gpt2" else 0)  # Llama puts BOS before "a": two tokens
    rtol = 1e-10 if kind == "gpt2" else 1e-6  # transformers' eager Llama takes its softmax in float32
    # the uniform head: row i spreads 1 / (i + 1) over the keys j <= i it sees, on the same sequences
    uniform = [by_hand(np.tril(np.ones((len(r["ids"]),) * 2)) / np.arange(1, len(r["ids"]) + 1)[:, None],
                       [k for k, piece in enumerate(r["ids"]) if loaded.punct_by_id[piece]]) for r in references]
    for layer in range(loaded.num_layers):
        for head in range(loaded.num_heads):
            values = [by_hand(r["attentions"][layer, head], [k for k, piece in enumerate(r["ids"]) if loaded.punct_by_id[piece]]) for r in references]
            for metric in DECODER_PROFILE_METRICS:
                row = table.loc[(layer, head, metric)]
                assert row.n == len(references)
                np.testing.assert_allclose(row.value, np.mean([v[metric] for v in values]), rtol=rtol, err_msg=f"{layer}-{head} {metric}")
                np.testing.assert_allclose(row.uniform, np.mean([v[metric] for v in uniform]), rtol=1e-12, err_msg=f"{layer}-{head} {metric}")
                np.testing.assert_allclose(row.excess, np.mean([v[metric] - w[metric] for v, w in zip(values, uniform)]), rtol=rtol, atol=10 * rtol)
    # the entropy's ceiling: uniform attention over the keys each query sees, mean_{i>=1} ln(i + 1), averaged over sequences
    ceiling = np.mean([np.mean([math.log(i + 1) for i in range(1, len(r["ids"]))]) for r in references])
    np.testing.assert_allclose(analyzer.entropy_ceiling(), ceiling, rtol=1e-12)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_the_uniform_null_gets_no_label_but_broad(kind, gpt2_64, llama64, tiny_bert):
    """Every head of the null model is the uniform head: each metric equals its uniform column, no excess, and no label of
    Clark's but ``broad`` (the uniform head's own property). A decoder's first token gets mean_i 1/(i + 1) from it."""
    from bertology.families.profile.analyzer import clark_labels, clark_threshold_values

    loaded = {"gpt2": gpt2_64, "llama": llama64, "bert": tiny_bert}[kind]
    short = [Example(text) for text in ("we saw it.", "a dog ran.", "it is.", "go!")]  # short rows: a large uniform share
    analyzer = GeneralProfile(loaded.kind)
    Engine(loaded, batch_size=3, progress=False, null="uniform").run(EXAMPLES + short, [analyzer])
    table = analyzer.result()
    np.testing.assert_allclose(table.value, table.uniform, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(table.excess, 0.0, atol=1e-6)
    thresholds = clark_threshold_values(loaded.kind)
    lowered = {metric: 0.0 for metric in thresholds if metric != "entropy"}  # every head passes every threshold of a share
    assert clark_labels(table, lowered).empty
    assert set(clark_labels(table, thresholds).label) <= {"broad"}
    if kind != "bert":
        lengths = [len(loaded.tokenizer(e.text, e.text_pair)["input_ids"]) for e in EXAMPLES + short]
        first = np.mean([np.mean([1 / (i + 1) for i in range(1, n)]) for n in lengths if n > 1])
        np.testing.assert_allclose(table[table.metric == "first"].uniform, first, rtol=1e-12)


def entropy_by_hand(a: np.ndarray, causal: bool) -> float:
    """Clark et al.'s smoothed entropy of one n x n map, as numpy: row i spread over the keys it sees (a decoder's j <= i,
    an encoder's every j), ``s = 0.9999 a + 0.0001 / |S_i|``, averaged over the queries (a decoder's i >= 1)."""
    n = a.shape[0]
    seen = np.tril(np.ones((n, n), dtype=bool)) if causal else np.ones((n, n), dtype=bool)
    smoothed = np.where(seen, 0.9999 * a + 0.0001 / seen.sum(1, keepdims=True), 1.0)  # 1 log 1 = 0 off the keys seen
    rows = -(smoothed * np.log(smoothed)).sum(1)
    return float(rows[1:].mean() if causal else rows.mean())


@pytest.mark.parametrize("cells_at_once", [1 << 19, 64], ids=["every-row", "a-row-at-a-time"])
@pytest.mark.parametrize("model", ["minilm", "gpt2_64"])
def test_the_entropy_on_real_sentences_equals_numpy_over_eager_maps(model, cells_at_once, request, shared_data, monkeypatch):
    """The first 30 sentences of the UD English EWT test set (../shared/data; skipped without it), in padded batches of
    eight, on the bundled MiniLM (an encoder, trained) and a float64 GPT-2 (a decoder: each row read up to itself), the
    entropy smoothed a row at a time or a batch's rows at once, against each sentence alone through transformers' eager maps."""
    import itertools

    from bertology.core.text.corpora import Corpus

    loaded = request.getfixturevalue(model)
    monkeypatch.setattr(profile_analyzer, "CELLS_AT_ONCE", cells_at_once)
    examples = list(itertools.islice(Corpus(shared_data / "ud_english_ewt" / "en_ewt-ud-test.conllu"), 30))
    analyzer = GeneralProfile(loaded.kind)
    Engine(loaded, batch_size=8, progress=False).run(examples, [analyzer])
    table = analyzer.result().set_index(["layer", "head", "metric"])
    references = eager_reference(loaded, examples)
    causal = loaded.kind is DECODER
    rtol = 1e-10 if causal else 1e-5  # GPT-2 in float64; MiniLM's maps are float32
    for layer in range(loaded.num_layers):
        for head in range(loaded.num_heads):
            expected = np.mean([entropy_by_hand(r["attentions"][layer, head], causal) for r in references])
            np.testing.assert_allclose(table.loc[(layer, head, "entropy"), "value"], expected, rtol=rtol, err_msg=f"{layer}-{head}")
