"""Frame-semantic heads (Kovaleva et al. 2019, section 4.3; docs/methods.md#frame-heads).

For each annotated pair of a frame's target T and one of its core elements E (character spans, turned into the
pieces that overlap them), a head's score is Kovaleva et al.'s ``max(max_{i in E, j in T} a[i, j], max_{i in T, j in E} a[i, j])``:
the largest attention weight between any token of the element and any token of the target, in either direction.

Baseline: the same score for a position-matched random pair, the target's and the element's words both moved by one
random shift ``s != 0`` (in words, the same for both, so the pair keeps its distance, order and sizes) that keeps
them inside the sentence; ``s`` is drawn from a generator keyed by the sentence, the frame and the element
(:func:`~bertology.core.statistics.stats.keyed_rng`), so it does not depend on batches or shards. A pair with no such shift
(a sentence too short) has no baseline.

``score`` is the mean over every (target, element) pair of the corpus, as Kovaleva et al. average it; ``baseline`` and
``difference`` (score minus baseline, pair by pair) are means over the pairs that have a baseline; intervals are over
pairs. The null (docs/methods.md#the-null-model): the uniform head of the layer (``1 / |S_i|`` on the keys each query saw,
``LayerMaps.visible``) scored the same way, ``uniform`` its score and ``excess`` the head's difference less the uniform
head's (on a decoder a shifted pair sits at other rows, whose uniform weights differ; on an encoder the uniform head's
difference is 0 and ``excess`` is ``difference``). The test takes the sentence as its unit, because the pairs of one
sentence share its maps: each sentence's mean excess over its pairs, tested one-sided, ``H0: mean <= 0``
(:func:`~bertology.core.statistics.stats.t_test_greater`), over the sentences, corrected over the heads.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, Encoded, LayerMaps, stack_layers
from bertology.core.statistics.stats import MIN_SAMPLE, RunningMoments, keyed_rng, merge_moments, sequence_key, t_test_greater
from bertology.core.text.alignment import default_word_spans

#: What is averaged over the pairs: the pair's score, its baseline's score, the difference of the two, the uniform head's
#: score, and the head's difference less the uniform head's (the quantity tested).
FRAME_QUANTITIES = ("score", "baseline", "difference", "uniform", "excess")


def span_pieces(item: Encoded, span: tuple[int, int]) -> list[int]:
    """Pieces of sentence A whose characters overlap ``span`` = [start, end)."""
    start, end = span
    return [p for p, ((begin, stop), segment) in enumerate(zip(item.offsets, item.sequence_ids))
            if segment == 0 and stop > begin and begin < end and start < stop]


def pair_score(maps: torch.Tensor, target: list[int], element: list[int]) -> torch.Tensor:
    """Kovaleva et al.'s score of every head, ``[layer, head]``: the largest weight between the pieces of
    ``element`` and of ``target``, in either direction (``maps``: ``[layer, head, n, n]``)."""
    target_index, element_index = torch.tensor(target, device=maps.device), torch.tensor(element, device=maps.device)
    element_to_target = maps[:, :, element_index][:, :, :, target_index].amax(dim=(-2, -1))
    target_to_element = maps[:, :, target_index][:, :, :, element_index].amax(dim=(-2, -1))
    return torch.maximum(element_to_target, target_to_element)


def shifted_pair(text: str, target: tuple[int, int], element: tuple[int, int], rng: np.random.Generator):
    """The target's and element's spans moved together by a random number of words ``s != 0`` within the text,
    or None where no shift keeps both inside it."""
    words = default_word_spans(text)

    def covered(span):
        return [k for k, (begin, end) in enumerate(words) if begin < span[1] and span[0] < end]

    target_words, element_words = covered(target), covered(element)
    if not target_words or not element_words:
        return None
    low, high = min(target_words + element_words), max(target_words + element_words)
    shifts = [s for s in range(-low, len(words) - high) if s != 0]
    if not shifts:
        return None
    s = int(rng.choice(shifts))

    def moved(indices):
        return words[indices[0] + s][0], words[indices[-1] + s][1]

    return moved(target_words), moved(element_words)


class FrameHeads(LayerwiseAnalyzer):
    """Per head: Kovaleva et al.'s frame score, its position-matched random baseline and their difference (see the
    module docstring). ``result()``: ``layer, head, score, ci_low, ci_high, baseline, difference, uniform, excess, t, p, n,
    pairs``."""

    name = "frames"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._pairs: RunningMoments | None = None  # over pairs: [layer, head, quantity]
        self._sentences: RunningMoments | None = None  # over sentences: [layer, head], the mean difference of their pairs
        self.pairs = 0
        self.matched = 0
        self._pairs_of: list[tuple] = []  # the batch's sequences with frame pairs: (sequence, its pairs' pieces)
        self._pending: list[torch.Tensor] = []  # one [pair, head, score/baseline/difference] per layer

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            self._pending, self._pairs_of = [], []
            for b, (item, example) in enumerate(zip(batch.items, batch.examples)):
                pairs = []  # ((target, element) pieces, the shifted pair's pieces or None)
                for f, annotation in enumerate(example.frames or ()):
                    target = span_pieces(item, annotation.target)
                    for name, span in annotation.elements:
                        element = span_pieces(item, span)
                        if not target or not element:
                            continue  # cut by truncation
                        shifted = shifted_pair(example.text, annotation.target, span, keyed_rng(self.seed, *sequence_key(example), f, name))
                        pieces = None if shifted is None else (span_pieces(item, shifted[0]), span_pieces(item, shifted[1]))
                        pairs.append(((target, element), pieces if pieces is not None and pieces[0] and pieces[1] else None))
                if pairs:
                    self._pairs_of.append((b, pairs))
        scores = []  # per pair, in order: the FRAME_QUANTITIES of every head at this layer
        for b, pairs in self._pairs_of:
            n = int(batch.host_lengths[b])
            sequence_maps = maps.attention[None, b, :, :n, :n]  # [1, head, n, n]
            uniform_map = maps.uniform(batch)[None, b, :, :n, :n].to(maps.attention.dtype)  # [1, 1 or head, n, n]: the uniform head
            for pieces, shifted in pairs:
                score, uniform = pair_score(sequence_maps, *pieces)[0], pair_score(uniform_map, *pieces)[0]
                if shifted is not None:
                    baseline, uniform_baseline = pair_score(sequence_maps, *shifted)[0], pair_score(uniform_map, *shifted)[0]
                else:
                    baseline = uniform_baseline = torch.full_like(score, torch.nan)
                difference = score - baseline
                scores.append(torch.stack([score, baseline, difference, uniform.expand_as(score), difference - (uniform - uniform_baseline)], dim=-1))
        if scores:
            self._pending.append(torch.stack(scores))  # [pair, head, quantity]

    def finish_batch(self, batch: Batch) -> None:
        if not self._pairs_of:
            return
        rows = stack_layers(self._pending, batch, dim=1).double().cpu().numpy()  # [pair, layer, head, quantity]: one copy to the host
        self._pending = []
        differences, start = [], 0
        for _, pairs in self._pairs_of:
            sentence = rows[start : start + len(pairs)]
            start += len(pairs)
            matched = [k for k, (_, shifted) in enumerate(pairs) if shifted is not None]
            self.pairs += len(pairs)
            self.matched += len(matched)
            if matched:
                differences.append(sentence[matched, ..., 4].mean(axis=0))  # the excess over the uniform head
        if self._pairs is None:
            self._pairs, self._sentences = RunningMoments(rows.shape[1:]), RunningMoments(rows.shape[1:3])
        self._pairs.push(rows)
        if differences:
            self._sentences.push(np.stack(differences))
        self._pairs_of = []

    def merge(self, other: "FrameHeads") -> "FrameHeads":
        self._check_mergeable(other)
        self._pairs = merge_moments(self._pairs, other._pairs)
        self._sentences = merge_moments(self._sentences, other._sentences)
        self.pairs += other.pairs
        self.matched += other.matched
        return self

    def result(self, min_sample: int = MIN_SAMPLE) -> pd.DataFrame:
        """Per head: the score and baseline over pairs, and the test over sentences (none on fewer than ``min_sample``)."""
        columns = ["layer", "head", "score", "ci_low", "ci_high", "baseline", "difference", "uniform", "excess", "t", "p", "n", "pairs"]
        if self._pairs is None:
            return pd.DataFrame(columns=columns)
        means = self._pairs.means()
        low, high = self._pairs.interval()
        t, p = t_test_greater(self._sentences, 0.0, min_sample=min_sample)
        layer, head = np.indices(means.shape[:2])
        return pd.DataFrame({
            "layer": layer.ravel(), "head": head.ravel(), "score": means[..., 0].ravel(), "ci_low": low[..., 0].ravel(),
            "ci_high": high[..., 0].ravel(), "baseline": means[..., 1].ravel(), "difference": means[..., 2].ravel(),
            "uniform": means[..., 3].ravel(), "excess": means[..., 4].ravel(),
            "t": t.ravel(), "p": p.ravel(), "n": self._sentences.count.ravel().astype(np.int64), "pairs": self.pairs,
        })[columns]
