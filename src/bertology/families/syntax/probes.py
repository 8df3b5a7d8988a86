"""Clark et al.'s (2019) attention-based parsing probe, in two variants.

For dependent i and candidate parent j (the root, or another word), the probe scores

- ``attn``: ``s(i, j) = sum_k w_k A_k[i, j] + sum_k u_k A_k[j, i] + b [j = root]``,
- ``attn+emb``: the same, but each head's weights depend on the two words,
  ``w_k(i, j) = w_k + (e_i P)_k + (e_j Q)_k`` (and likewise ``u_k``), where ``e`` are the words'
  static input embeddings from the model itself (the paper used GloVe),

over the word-level maps ``A_k`` of every head k (docs/methods.md#notation-and-word-level-attention) in both directions, and is
trained with a softmax over candidates (cross-entropy on the gold parent). The root candidate is
the [CLS] unit. Evaluation is unlabelled attachment score (UAS) over every word, root included.
Baselines: right-branching, left-branching, the best fixed offset (chosen on training data), and the null model's probe
(docs/methods.md#the-null-model): each variant trained on the same sentences, folds and seed with ``A_k`` replaced by each
layer's uniform head ``U[i, j] = 1 / |S_i|`` over the keys row i saw, at word level (``uniform_attn``, ``uniform_attn+emb``:
2 channels a layer; the latter is in effect a probe of the embeddings and of position). A variant beats the baselines
only if its UAS exceeds the best of the three offset baselines and its uniform probe, by a one-sided paired bootstrap over
the held-out sentences (:func:`probe_verdicts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps, stack_layers
from bertology.core.statistics.stats import MIN_SAMPLE, corrected, keyed_rng, sequence_key, withheld
from bertology.core.text.alignment import to_word_level
from bertology.families.syntax.analyzer import OFFSETS

VARIANTS = ("attn", "attn+emb")
#: Every probe trained per split: each variant on the heads' maps, then on the uniform head's (``uniform_<variant>``).
PROBES = (*VARIANTS, *(f"uniform_{variant}" for variant in VARIANTS))
#: The fixed-offset baselines, named as in the ``uas`` of :func:`evaluate`.
OFFSET_BASELINES = ("right_branching", "left_branching", "best_offset")


@dataclass
class ProbeSentence:
    """One sentence's probe inputs: ``features[channel, dependent, candidate]`` (candidate 0 is the
    root, candidate j the j-th word) from every head, ``uniform_features`` the same from every layer's uniform head,
    ``heads`` (gold candidate per word) and word ``embeddings``."""

    source: str
    key: str  # stable identity (line and text, not the file's name; stats.sequence_key): orders sentences and fixes their folds
    features: np.ndarray  # float16 [2 * layers * heads, m, m + 1]
    uniform_features: np.ndarray  # float16 [2 * layers, m, m + 1]
    heads: np.ndarray  # int [m]
    embeddings: np.ndarray  # float16 [m, dim]


class ProbeData(LayerwiseAnalyzer):
    """Collects the probe's inputs for every sentence with a tree (one forward pass with the rest).

    Its memory grows with the treebank (``2 L (H + 1) m (m+1)`` half-floats per sentence of m words: the heads' and
    the uniform head's), as a probe's training set must. ``result()`` lists the sentences kept. Sentences with a word
    that no piece covers (cut by truncation) are left out.
    """

    name = "probe_data"

    def __init__(self) -> None:
        self.sentences: dict[str, ProbeSentence] = {}
        self._kept: list[int] = []  # the batch's sentences whose every word has a piece
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per layer, each kept sentence's (heads', uniform) features

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            self._pending = []
            self._kept = []
            for b, example in enumerate(batch.examples):
                word_units = batch.alignments[b].word_unit[: len(example.heads)] if example.has_tree else None
                if word_units is not None and not (word_units < 0).any():
                    self._kept.append(b)
        features = []  # per kept sentence: ([2, head, m, m + 1], [2, 1, m, m + 1]) at this layer
        uniform = maps.uniform(batch) if self._kept else None  # [batch, 1, n, n]
        for b in self._kept:
            alignment, n = batch.alignments[b], int(batch.host_lengths[b])
            word_maps = maps.word_attention(batch, b)  # [head, u, u]
            uniform_maps = to_word_level(uniform[b, :, :n, :n], alignment)  # [1, u, u], as word_attention merges the heads'
            words = torch.as_tensor(alignment.word_unit[: len(batch.examples[b].heads)], device=word_maps.device)
            candidates = torch.cat([torch.as_tensor([alignment.unit_of_piece[0]], device=word_maps.device), words])
            features.append((pair_features(word_maps, words, candidates), pair_features(uniform_maps, words, candidates)))
        self._pending.append(features)

    def finish_batch(self, batch: Batch) -> None:
        for row, b in enumerate(self._kept):
            example, alignment, n = batch.examples[b], batch.alignments[b], int(batch.host_lengths[b])
            word_units = alignment.word_unit[: len(example.heads)]
            # [direction, layer, head, m, m + 1], flattened in that order as the probe reads its channels
            features = stack_layers([layer[row][0] for layer in self._pending], batch, dim=1)
            uniform = stack_layers([layer[row][1] for layer in self._pending], batch, dim=1)  # [direction, layer, 1 (or head), m, m + 1]
            heads = features.shape[2]
            both = torch.cat([features, uniform], dim=2).cpu().numpy()  # one copy of the heads' and the uniform head's
            assignment = torch.as_tensor(alignment.assignment[word_units], dtype=torch.float32, device=features.device)
            embeddings = (assignment / assignment.sum(1, keepdim=True)) @ batch.input_embeddings[b, :n].float()
            key = repr(sequence_key(example))
            shape = (-1, len(word_units), len(word_units) + 1)
            self.sentences[key] = ProbeSentence(
                source=example.source,
                key=key,
                features=both[:, :, :heads].reshape(shape),
                uniform_features=both[:, :, heads:].reshape(shape),
                heads=np.asarray(example.heads),
                embeddings=embeddings.half().cpu().numpy(),
            )
        self._pending, self._kept = [], []

    def merge(self, other: "ProbeData") -> "ProbeData":
        self._check_mergeable(other)
        self.sentences.update(other.sentences)
        return self

    def result(self) -> pd.DataFrame:
        ordered = self.ordered()
        return pd.DataFrame({"source": [s.source for s in ordered], "words": [len(s.heads) for s in ordered]})

    def ordered(self) -> list[ProbeSentence]:
        return [self.sentences[key] for key in sorted(self.sentences)]


def pair_features(word_maps: torch.Tensor, words: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``[2, channel, m, m + 1]`` half floats of word-level maps ``[channel, u, u]``: ``A[i, j]`` (dep->head, row of
    dependent i at candidate j) and ``A[j, i]`` (head->dep), for the dependents' units ``words`` and the ``candidates``
    (the root's unit, then the words')."""
    dep_to_head = word_maps[:, words][:, :, candidates]
    head_to_dep = word_maps[:, candidates][:, :, words].transpose(-1, -2)
    return torch.stack([dep_to_head, head_to_dep]).half()


def uniform_view(sentences: Sequence[ProbeSentence]) -> list[ProbeSentence]:
    """The sentences with the uniform head's features in place of the heads': what the ``uniform_`` probes train on."""
    return [dataclasses.replace(sentence, features=sentence.uniform_features) for sentence in sentences]


class AttentionProbe(nn.Module):
    """The probe's scoring function (see the module docstring); ``variant`` is ``attn`` or ``attn+emb``."""

    def __init__(self, channels: int, embedding_dim: int, variant: str = "attn"):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}")
        self.variant = variant
        self.weights = nn.Parameter(torch.zeros(channels))
        self.root_bias = nn.Parameter(torch.zeros(()))
        if variant == "attn+emb":
            self.dependent = nn.Linear(embedding_dim, channels, bias=False)
            self.candidate = nn.Linear(embedding_dim, channels, bias=False)
            self.root_embedding = nn.Parameter(torch.zeros(embedding_dim))
            nn.init.zeros_(self.dependent.weight)
            nn.init.zeros_(self.candidate.weight)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """``features [batch, channel, m, m + 1]``, ``embeddings [batch, m, dim]`` -> scores ``[batch, m, m + 1]``."""
        if self.variant == "attn":
            scores = torch.einsum("k,bkij->bij", self.weights, features)
        else:
            root = self.root_embedding.expand(embeddings.shape[0], 1, -1)
            candidates = torch.cat([root, embeddings], dim=1)
            weights = self.weights[None, None, None, :] + self.dependent(embeddings)[:, :, None, :] + self.candidate(candidates)[:, None, :, :]
            scores = torch.einsum("bijk,bkij->bij", weights, features)
        scores = scores.clone()
        scores[:, :, 0] += self.root_bias
        return scores


def _pad(sentences: Sequence[ProbeSentence]):
    """Pad sentences to one tensor batch; ``allowed`` masks padding and each word as its own parent."""
    m = max(len(s.heads) for s in sentences)
    channels, dim = sentences[0].features.shape[0], sentences[0].embeddings.shape[1]
    features = torch.zeros(len(sentences), channels, m, m + 1)
    embeddings = torch.zeros(len(sentences), m, dim)
    heads = torch.full((len(sentences), m), -100, dtype=torch.long)
    allowed = torch.zeros(len(sentences), m, m + 1, dtype=torch.bool)
    for b, sentence in enumerate(sentences):
        k = len(sentence.heads)
        features[b, :, :k, : k + 1] = torch.from_numpy(sentence.features.astype(np.float32))
        embeddings[b, :k] = torch.from_numpy(sentence.embeddings.astype(np.float32))
        heads[b, :k] = torch.from_numpy(sentence.heads)
        allowed[b, :k, : k + 1] = True
        allowed[b, torch.arange(k), torch.arange(k) + 1] = False
    return features, embeddings, heads, allowed


def _batches(sentences: Sequence[ProbeSentence], size: int):
    """``(indices, padded)`` per batch of up to ``size`` sentences, by length; ``indices`` index ``sentences``."""
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i].heads))
    return [(order[i : i + size], _pad([sentences[k] for k in order[i : i + size]])) for i in range(0, len(order), size)]


def train_probe(train: Sequence[ProbeSentence], variant: str = "attn", epochs: int = 30, lr: float | None = None,
                batch_size: int = 64, seed: int = 0) -> AttentionProbe:
    """Fit a probe by Adam on the softmax cross-entropy over candidates; deterministic for a seed."""
    torch.manual_seed(seed)
    probe = AttentionProbe(train[0].features.shape[0], train[0].embeddings.shape[1], variant)
    optimizer = torch.optim.Adam(probe.parameters(), lr=lr or (0.05 if variant == "attn" else 0.01))
    batches = _batches(train, batch_size)
    order = np.random.default_rng(seed)
    for _ in range(epochs):
        for index in order.permutation(len(batches)):
            _, (features, embeddings, heads, allowed) = batches[index]
            scores = probe(features, embeddings).masked_fill(~allowed, -1e9)
            loss = nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]), heads.reshape(-1), ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return probe.eval()


def probe_correct(probe: AttentionProbe, sentences: Sequence[ProbeSentence]) -> np.ndarray:
    """Per sentence, the words whose highest-scoring candidate is the gold parent."""
    correct = np.zeros(len(sentences), dtype=np.int64)
    with torch.no_grad():
        for indices, (features, embeddings, heads, allowed) in _batches(sentences, 64):
            predicted = probe(features, embeddings).masked_fill(~allowed, -torch.inf).argmax(-1)
            correct[indices] = ((predicted == heads) & (heads != -100)).sum(-1).numpy()
    return correct


def word_counts(sentences: Sequence[ProbeSentence]) -> np.ndarray:
    """Per sentence, its words m: the dependents UAS counts (the root word included)."""
    return np.array([len(s.heads) for s in sentences], dtype=np.int64)


def probe_uas(probe: AttentionProbe, sentences: Sequence[ProbeSentence]) -> float:
    """Unlabelled attachment score: share of words whose highest-scoring candidate is the gold parent."""
    return int(probe_correct(probe, sentences).sum()) / int(word_counts(sentences).sum())


def offset_predictions(words: int, offset: int) -> np.ndarray:
    """Candidate index predicted for each word by a fixed offset (outside the sentence: the root)."""
    target = np.arange(words) + offset
    return np.where((target >= 0) & (target < words), target + 1, 0)


def offset_correct(sentences: Sequence[ProbeSentence], offset: int) -> np.ndarray:
    """Per sentence, the words whose parent is the word at ``offset`` (+1 right-branching, -1 left)."""
    return np.array([int((offset_predictions(len(s.heads), offset) == s.heads).sum()) for s in sentences], dtype=np.int64)


def baseline_uas(sentences: Sequence[ProbeSentence], offset: int) -> float:
    """UAS of always attaching a word to the word at ``offset`` (+1 right-branching, -1 left)."""
    return int(offset_correct(sentences, offset).sum()) / int(word_counts(sentences).sum())


def held_out_correct(train: Sequence[ProbeSentence], test: Sequence[ProbeSentence], epochs: int = 30, seed: int = 0,
                     bar: tqdm | None = None) -> tuple[dict[str, np.ndarray], int]:
    """Per method (:data:`PROBES`, then :data:`OFFSET_BASELINES`), the correct words of each ``test`` sentence, every probe
    trained on ``train`` with the same seed, and the best offset (chosen on ``train``); ``bar`` advances by one per probe."""
    best_offset = max(OFFSETS, key=lambda k: baseline_uas(train, k))
    correct = {}
    for prefix, (train_on, test_on) in {"": (train, test), "uniform_": (uniform_view(train), uniform_view(test))}.items():
        for variant in VARIANTS:
            correct[prefix + variant] = probe_correct(train_probe(train_on, variant, epochs=epochs, seed=seed), test_on)
            if bar is not None:
                bar.update(1)
    correct.update(zip(OFFSET_BASELINES, (offset_correct(test, 1), offset_correct(test, -1), offset_correct(test, best_offset))))
    return correct, best_offset


def probe_verdicts(sentences: Sequence[ProbeSentence], correct: dict[str, np.ndarray], seed: int = 0, bootstrap: int = 1000,
                   correction: str = "fdr_bh", min_sample: int = MIN_SAMPLE) -> dict:
    """Per variant, does its UAS on the held-out ``sentences`` beat the baselines, the best of the offset baselines and
    of its own uniform probe (``uniform_<variant>``, same folds and seed)?

    ``correct[method]`` holds each sentence's correct words. A Poisson bootstrap over sentences (weights ``w_s ~ Poisson(1)``
    keyed by the seed and the sentence, docs/methods.md#statistics-conventions) scores every method on the same replicate,
    ``UAS_b = sum_s w_s correct_s / sum_s w_s words_s``; the margin is ``UAS_variant - max_r UAS_r`` over the references
    r, and the one-sided paired p-value ``(1 + #{b: margin_b <= 0}) / (1 + B)``, corrected over the variants
    (``correction``), none on fewer than ``min_sample`` sentences. A variant beats the baselines when its corrected test
    rejects."""
    words = word_counts(sentences).astype(np.float64)
    weights = np.ones((len(sentences), 1 + bootstrap))
    for row, sentence in enumerate(sentences):
        weights[row, 1:] = keyed_rng(seed, "probe", sentence.key).poisson(1.0, bootstrap)
    total = words @ weights
    with np.errstate(invalid="ignore", divide="ignore"):  # a replicate that drew no sentence has no UAS: no win
        uas = {name: (values.astype(np.float64) @ weights) / total for name, values in correct.items()}
    verdicts, p_values = {}, {}
    for variant in VARIANTS:
        references = (*OFFSET_BASELINES, f"uniform_{variant}")
        rivals = np.stack([uas[name] for name in references])  # [reference, 1 + B]
        margin = uas[variant] - rivals.max(axis=0)
        p_values[variant] = float(withheld((1 + np.sum(~(margin[1:] > 0))) / (1 + bootstrap), len(sentences), min_sample))
        low, high = np.nanpercentile(margin[1:], [2.5, 97.5])
        best = references[int(rivals[:, 0].argmax())]
        verdicts[variant] = {"uas": float(uas[variant][0]), "reference": best, "reference_uas": float(uas[best][0]),
                             "margin": float(margin[0]), "ci_low": float(low), "ci_high": float(high)}
    p_adj, reject = corrected(pd.Series(p_values), correction)
    for variant, verdict in verdicts.items():
        verdict.update(p_value=None if np.isnan(p_values[variant]) else p_values[variant],
                       p_adj=None if np.isnan(p_adj[variant]) else float(p_adj[variant]), beats_baselines=bool(reject[variant]))
    return verdicts


def _uas(correct: dict[str, np.ndarray], words: np.ndarray) -> dict[str, float]:
    """Per method, ``UAS = sum_s correct_s / sum_s words_s`` over the held-out sentences."""
    return {name: int(values.sum()) / int(words.sum()) for name, values in correct.items()}


def evaluate(train: Sequence[ProbeSentence], test: Sequence[ProbeSentence], epochs: int = 30, seed: int = 0, bar: tqdm | None = None,
             bootstrap: int = 1000, correction: str = "fdr_bh", min_sample: int = MIN_SAMPLE) -> dict:
    """UAS on ``test`` of every probe trained on ``train`` (:data:`PROBES`) and of the baselines, and each variant's
    verdict against the baselines (:func:`probe_verdicts`); ``bar`` advances by one per probe."""
    correct, best_offset = held_out_correct(train, test, epochs=epochs, seed=seed, bar=bar)
    return {"uas": _uas(correct, word_counts(test)), "best_offset": best_offset, "train_sentences": len(train), "test_sentences": len(test),
            "verdict": probe_verdicts(test, correct, seed=seed, bootstrap=bootstrap, correction=correction, min_sample=min_sample)}


def cross_validate(sentences: Sequence[ProbeSentence], folds: int = 5, epochs: int = 30, seed: int = 0, progress: bool = False,
                   bootstrap: int = 1000, correction: str = "fdr_bh", min_sample: int = MIN_SAMPLE) -> dict:
    """k-fold cross-validation over sentences (each sentence's fold is fixed by a hash of its key); ``progress``: a bar
    over the folds' probes. ``uas`` is the mean over folds; the verdicts pool every held-out sentence (each is held out
    once) and bootstrap over them (:func:`probe_verdicts`)."""
    fold_of = np.array([keyed_rng(seed, "fold", s.key).integers(folds) for s in sentences])
    runs, held_out, pooled = [], [], {}
    with tqdm(total=folds * len(PROBES), unit="probe", desc="parsing probe", disable=not progress) as bar:
        for fold in range(folds):
            train = [s for s, f in zip(sentences, fold_of) if f != fold]
            test = [s for s, f in zip(sentences, fold_of) if f == fold]
            if train and test:
                correct, best_offset = held_out_correct(train, test, epochs=epochs, seed=seed, bar=bar)
                runs.append({"uas": _uas(correct, word_counts(test)), "best_offset": best_offset, "train_sentences": len(train),
                             "test_sentences": len(test)})
                held_out.extend(test)
                for name, values in correct.items():
                    pooled.setdefault(name, []).append(values)
    names = runs[0]["uas"].keys()
    return {
        "evaluation": f"{folds}-fold cross-validation over sentences",
        "uas": {name: float(np.mean([run["uas"][name] for run in runs])) for name in names},
        "uas_sd": {name: float(np.std([run["uas"][name] for run in runs], ddof=1)) if len(runs) > 1 else None for name in names},
        "verdict": probe_verdicts(held_out, {name: np.concatenate(values) for name, values in pooled.items()}, seed=seed,
                                  bootstrap=bootstrap, correction=correction, min_sample=min_sample),
        "folds": runs,
        "sentences": len(sentences),
        "words": int(sum(len(s.heads) for s in sentences)),
    }
