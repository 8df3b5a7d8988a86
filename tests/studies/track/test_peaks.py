"""LayerPeaks and peak_layers (track's peak analyzer, docs/methods.md#track-and-the-learning-curve-verdict) against numpy by hand."""

import numpy as np
import pytest
import torch
from families.profile.test_profile import padded_batch


def attention_to_by_hand(a: np.ndarray, cls: list[int], sep: list[int], punct: list[int]) -> dict:
    """Clark et al.'s attention to [CLS], [SEP] and punctuation of one n x n map, ``(1/n) sum_i sum_{j in K} a[i, j]``, as plain loops."""
    n = a.shape[0]
    return {name: sum(a[i, j] for i in range(n) for j in keys) / n for name, keys in (("cls", cls), ("sep", sep), ("punct", punct))}


def test_layer_peaks_bootstrap_by_hand():
    from types import SimpleNamespace

    from bertology.core.statistics.stats import bootstrap_weights
    from bertology.core.text.corpora import Example
    from bertology.studies.track.peaks import LayerPeaks

    rng = np.random.default_rng(1)
    flags = [([0], [3], [2]), ([0], [3, 6], [5]), ([0], [4], [1])]
    lengths = [4, 7, 5]
    # maps[b][layer][head]
    maps = [[[rng.dirichlet(np.full(n, 0.4), size=n) for _ in range(2)] for _ in range(3)] for n in lengths]
    examples = [Example(f"sequence {b}", source=f"s:{b}") for b in range(3)]
    per_layer = []
    for layer in range(3):
        heads = []
        for head in range(2):
            attention, m = padded_batch([maps[b][layer][head] for b in range(3)], flags)
            heads.append(attention)
        per_layer.append(torch.cat(heads, dim=1))
    from bertology.core.engine import LayerMaps
    from bertology.core.model.kinds import ENCODER

    batch = SimpleNamespace(attentions=torch.stack(per_layer), mask=m["mask"], anchors={"cls": m["cls"], "sep": m["sep"]}, punct_mask=m["punct"],
                            examples=examples, num_layers=len(per_layer), layer_maps=lambda layer: LayerMaps(layer, per_layer[layer]), kind=ENCODER,
                            query_mask=m["mask"], device=m["mask"].device)
    peaks = LayerPeaks(ENCODER, bootstrap=30, seed=2)
    peaks.update(batch)
    assert peaks.metrics == ("cls", "sep", "punct")

    # by hand: a sequence's layer value is the mean over heads; replicate r weights sequence b by w_b[r]
    values = np.array([[[np.mean([attention_to_by_hand(maps[b][layer][head], *flags[b])[metric] for head in range(2)]) for metric in ("cls", "sep", "punct")]
                        for layer in range(3)] for b in range(3)])  # [sequence, layer, metric]
    weights = np.stack([bootstrap_weights(2, 30, e) for e in examples])  # [sequence, 1 + B]
    with np.errstate(invalid="ignore"):  # a replicate that drew no sequence has no mean
        expected = np.einsum("br,blm->rlm", weights, values) / weights.sum(axis=0)[:, None, None]
    np.testing.assert_allclose(peaks.replicate_means(), expected, rtol=1e-10)
    # the excess over the uniform head, whose every row puts 1/n on each key: |K|/n on a set K
    uniform = np.array([[[len(keys) / lengths[b] for keys in flags[b]] for _ in range(3)] for b in range(3)])  # [sequence, layer, metric]
    with np.errstate(invalid="ignore"):
        expected_excess = np.einsum("br,blm->rlm", weights, values - uniform) / weights.sum(axis=0)[:, None, None]
    np.testing.assert_allclose(peaks.replicate_excess(), expected_excess, rtol=1e-10, atol=1e-12)
    table = peaks.result()
    np.testing.assert_allclose(table.value, values.mean(axis=0).ravel(), rtol=1e-10)
    np.testing.assert_allclose(table.excess, (values - uniform).mean(axis=0).ravel(), rtol=1e-10, atol=1e-12)
    found = peaks.peaks().set_index("metric")
    for k, metric in enumerate(("cls", "sep", "punct")):
        assert found.loc[metric, "peak_layer"] == values.mean(axis=0)[:, k].argmax()
        assert found.loc[metric, "agreement"] == pytest.approx(np.mean(expected[1:, :, k].argmax(axis=1) == values.mean(axis=0)[:, k].argmax()))
    # 95% percentile intervals of the replicates (a 90% interval would take the 5th and 95th)
    low, high = np.nanpercentile(expected[1:], [2.5, 97.5], axis=0)  # [layer, metric]; NaN: a replicate that drew no sequence
    np.testing.assert_allclose(table.ci_low, low.ravel(), rtol=1e-10)
    np.testing.assert_allclose(table.ci_high, high.ravel(), rtol=1e-10)
    peak_low, peak_high = np.percentile(expected[1:].argmax(axis=1), [2.5, 97.5], axis=0)
    np.testing.assert_array_equal(found.loc[["cls", "sep", "punct"], "ci_low"], peak_low)
    np.testing.assert_array_equal(found.loc[["cls", "sep", "punct"], "ci_high"], peak_high)


def test_layer_peaks_on_a_decoder_by_hand():
    """A decoder's first token and punctuation over the queries i >= 1 (row 0 sees only itself); a sequence of one token,
    with no such query, takes no part (docs/methods.md#decoders)."""
    from types import SimpleNamespace

    from bertology.core.engine import LayerMaps
    from bertology.core.model.kinds import DECODER
    from bertology.core.statistics.stats import bootstrap_weights
    from bertology.core.text.corpora import Example
    from bertology.studies.track.peaks import LayerPeaks

    rng = np.random.default_rng(3)
    lengths, punct = [5, 1, 7], [[2, 4], [], [3]]

    def causal_map(n: int) -> np.ndarray:
        """Row i: a Dirichlet draw over the keys j <= i."""
        rows = np.zeros((n, n))
        for i in range(n):
            rows[i, : i + 1] = rng.dirichlet(np.full(i + 1, 0.5))
        return rows

    maps = [[[causal_map(n) for _ in range(2)] for _ in range(2)] for n in lengths]  # [sequence][layer][head]
    width = max(lengths)
    attention = torch.zeros(2, len(lengths), 2, width, width, dtype=torch.float64)  # [layer, batch, head, n, n]
    mask, punct_mask = torch.zeros(len(lengths), width, dtype=torch.bool), torch.zeros(len(lengths), width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
        punct_mask[b, punct[b]] = True
        for layer in range(2):
            for head in range(2):
                attention[layer, b, head, :n, :n] = torch.tensor(maps[b][layer][head])
    first = torch.zeros_like(mask)
    first[:, 0] = True
    examples = [Example(f"sequence {b}", source=f"d:{b}") for b in range(len(lengths))]
    batch = SimpleNamespace(attentions=attention, mask=mask, anchors={"first": first}, punct_mask=punct_mask,
                            examples=examples, num_layers=2, layer_maps=lambda layer: LayerMaps(layer, attention[layer]), kind=DECODER,
                            query_mask=mask & (torch.arange(width) > 0), device=mask.device)
    peaks = LayerPeaks(DECODER, bootstrap=20, seed=4)
    peaks.update(batch)
    assert peaks.metrics == ("first", "punct")

    # by hand: mean over heads of (1/(n-1)) sum_{i>=1} a[i, K], for the sequences of more than one token
    kept = [b for b, n in enumerate(lengths) if n > 1]
    values = np.array([[[np.mean([maps[b][layer][head][1:][:, keys].sum() / (lengths[b] - 1) for head in range(2)]) for keys in ([0], punct[b])]
                        for layer in range(2)] for b in kept])  # [sequence, layer, metric]
    weights = np.stack([bootstrap_weights(4, 20, examples[b]) for b in kept])
    with np.errstate(invalid="ignore"):
        expected = np.einsum("br,blm->rlm", weights, values) / weights.sum(axis=0)[:, None, None]
    np.testing.assert_allclose(peaks.replicate_means(), expected, rtol=1e-10)
    # the uniform head's row i puts 1/(i + 1) on each key j <= i
    uniform = np.array([[[sum(sum(1 for j in keys if j <= i) / (i + 1) for i in range(1, lengths[b])) / (lengths[b] - 1) for keys in ([0], punct[b])]
                         for _ in range(2)] for b in kept])
    with np.errstate(invalid="ignore"):
        expected_excess = np.einsum("br,blm->rlm", weights, values - uniform) / weights.sum(axis=0)[:, None, None]
    np.testing.assert_allclose(peaks.replicate_excess(), expected_excess, rtol=1e-10, atol=1e-12)
    table = peaks.result()
    assert table.metric.tolist() == ["first", "punct"] * 2 and (table.n == 2).all()
    assert peaks.peaks().metric.tolist() == ["first", "punct"]


def test_peak_layers_interval_is_the_95_percent_percentile_interval():
    from bertology.studies.track.peaks import peak_layers

    # 40 replicates of one metric over 5 layers: the peak is layer 0 once, 1 twice, 2 in 34, 3 twice, 4 once
    peaks = [0] + [1] * 2 + [2] * 34 + [3] * 2 + [4]
    means = np.zeros((41, 5, 1))
    means[0, 2, 0] = 1.0  # the data peaks at layer 2
    for r, layer in enumerate(peaks, start=1):
        means[r, layer, 0] = 1.0
    row = peak_layers(means, metrics=("cls",)).iloc[0]
    # linear interpolation at rank (B - 1) q / 100 of the sorted peaks: 0.975 -> 0 + 0.975 (1 - 0); 38.025 -> 3 + 0.025 (4 - 3)
    assert (row.peak_layer, row.ci_low, row.ci_high) == (2, pytest.approx(0.975, abs=1e-12), pytest.approx(3.025, abs=1e-12))
    assert row.agreement == 34 / 40  # a 90% interval would be (1, 3)


def test_the_peak_metrics_are_the_kinds_anchors_and_punctuation():
    from bertology.core.model.kinds import DECODER, ENCODER
    from bertology.studies.track.peaks import peak_metrics

    assert peak_metrics(ENCODER) == ("cls", "sep", "punct")
    assert peak_metrics(DECODER) == ("first", "punct")  # no [SEP]: the first token in [CLS]'s place


def test_layer_peaks_refuse_a_batch_or_a_merge_of_another_kind():
    from types import SimpleNamespace

    from bertology.core.engine import LayerMaps
    from bertology.core.model.kinds import DECODER, ENCODER
    from bertology.studies.track.peaks import LayerPeaks

    batch = SimpleNamespace(kind=DECODER, num_layers=1, layer_maps=lambda layer: LayerMaps(layer, torch.zeros(1, 1, 2, 2)))
    with pytest.raises(ValueError, match="built for a model of kind 'encoder', not 'decoder'"):
        LayerPeaks(ENCODER, bootstrap=3).update(batch)
    with pytest.raises(ValueError, match="cannot merge"):
        LayerPeaks(ENCODER, bootstrap=3).merge(LayerPeaks(DECODER, bootstrap=3))
