"""Clark et al.'s (2019) attention-based parsing probe, in two variants.

For dependent i and candidate parent j (the root, or another word), the probe scores

- ``attn``: ``s(i, j) = sum_k w_k A_k[i, j] + sum_k u_k A_k[j, i] + b [j = root]``,
- ``attn+emb``: the same, but each head's weights depend on the two words,
  ``w_k(i, j) = w_k + (e_i P)_k + (e_j Q)_k`` (and likewise ``u_k``), where ``e`` are the words'
  static input embeddings from the model itself (the paper used GloVe),

over the word-level maps ``A_k`` of every head k (docs/methods.md#notation-and-word-level-attention) in both directions, and is
trained with a softmax over candidates (cross-entropy on the gold parent). The root candidate is
the [CLS] unit. Evaluation is unlabelled attachment score (UAS) over every word, root included.
Baselines: right-branching, left-branching and the best fixed offset (chosen on training data).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps
from bertology.core.statistics.stats import keyed_rng, sequence_key
from bertology.families.syntax.analyzer import OFFSETS

VARIANTS = ("attn", "attn+emb")


@dataclass
class ProbeSentence:
    """One sentence's probe inputs: ``features[channel, dependent, candidate]`` (candidate 0 is the
    root, candidate j the j-th word), ``heads`` (gold candidate per word) and word ``embeddings``."""

    source: str
    key: str  # stable identity (line and text, not the file's name; stats.sequence_key): orders sentences and fixes their folds
    features: np.ndarray  # float16 [2 * layers * heads, m, m + 1]
    heads: np.ndarray  # int [m]
    embeddings: np.ndarray  # float16 [m, dim]


class ProbeData(LayerwiseAnalyzer):
    """Collects the probe's inputs for every sentence with a tree (one forward pass with the rest).

    Its memory grows with the treebank (``2 L H m (m+1)`` half-floats per sentence of m words), as
    a probe's training set must. ``result()`` lists the sentences kept. Sentences with a word that
    no piece covers (cut by truncation) are left out.
    """

    name = "probe_data"

    def __init__(self) -> None:
        self.sentences: dict[str, ProbeSentence] = {}
        self._kept: list[int] = []  # the batch's sentences whose every word has a piece
        self._pending: list[list[torch.Tensor]] = []  # per layer, each kept sentence's features

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            self._pending = []
            self._kept = []
            for b, example in enumerate(batch.examples):
                word_units = batch.alignments[b].word_unit[: len(example.heads)] if example.has_tree else None
                if word_units is not None and not (word_units < 0).any():
                    self._kept.append(b)
        features = []  # per kept sentence: [2, head, m, m + 1] at this layer
        for b in self._kept:
            alignment = batch.alignments[b]
            word_maps = maps.word_attention(batch, b)  # [head, u, u]
            words = torch.as_tensor(alignment.word_unit[: len(batch.examples[b].heads)], device=word_maps.device)
            candidates = torch.cat([torch.as_tensor([alignment.unit_of_piece[0]], device=word_maps.device), words])
            dep_to_head = word_maps[:, words][:, :, candidates]
            head_to_dep = word_maps[:, candidates][:, :, words].transpose(-1, -2)
            features.append(torch.stack([dep_to_head, head_to_dep]).half())
        self._pending.append(features)

    def finish_batch(self, batch: Batch) -> None:
        for row, b in enumerate(self._kept):
            example, alignment, n = batch.examples[b], batch.alignments[b], int(batch.host_lengths[b])
            word_units = alignment.word_unit[: len(example.heads)]
            # [direction, layer, head, m, m + 1], flattened in that order as the probe reads its channels
            features = torch.stack([layer[row] for layer in self._pending], dim=1)
            assignment = torch.as_tensor(alignment.assignment[word_units], dtype=torch.float32, device=features.device)
            embeddings = (assignment / assignment.sum(1, keepdim=True)) @ batch.input_embeddings[b, :n].float()
            key = repr(sequence_key(example))
            self.sentences[key] = ProbeSentence(
                source=example.source,
                key=key,
                features=features.reshape(-1, len(word_units), len(word_units) + 1).cpu().numpy(),
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
    ordered = sorted(sentences, key=lambda s: len(s.heads))
    return [_pad(ordered[i : i + size]) for i in range(0, len(ordered), size)]


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
            features, embeddings, heads, allowed = batches[index]
            scores = probe(features, embeddings).masked_fill(~allowed, -1e9)
            loss = nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]), heads.reshape(-1), ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return probe.eval()


def probe_uas(probe: AttentionProbe, sentences: Sequence[ProbeSentence]) -> float:
    """Unlabelled attachment score: share of words whose highest-scoring candidate is the gold parent."""
    correct = total = 0
    with torch.no_grad():
        for features, embeddings, heads, allowed in _batches(sentences, 64):
            predicted = probe(features, embeddings).masked_fill(~allowed, -torch.inf).argmax(-1)
            valid = heads != -100
            correct += int((predicted[valid] == heads[valid]).sum())
            total += int(valid.sum())
    return correct / total


def offset_predictions(words: int, offset: int) -> np.ndarray:
    """Candidate index predicted for each word by a fixed offset (outside the sentence: the root)."""
    target = np.arange(words) + offset
    return np.where((target >= 0) & (target < words), target + 1, 0)


def baseline_uas(sentences: Sequence[ProbeSentence], offset: int) -> float:
    """UAS of always attaching a word to the word at ``offset`` (+1 right-branching, -1 left)."""
    correct = sum(int((offset_predictions(len(s.heads), offset) == s.heads).sum()) for s in sentences)
    return correct / sum(len(s.heads) for s in sentences)


def evaluate(train: Sequence[ProbeSentence], test: Sequence[ProbeSentence], epochs: int = 30, seed: int = 0, bar: tqdm | None = None) -> dict:
    """UAS on ``test`` of both probe variants trained on ``train``, and of the baselines; ``bar`` advances by one per variant."""
    best_offset = max(OFFSETS, key=lambda k: baseline_uas(train, k))
    scores = {}
    for variant in VARIANTS:
        scores[variant] = probe_uas(train_probe(train, variant, epochs=epochs, seed=seed), test)
        if bar is not None:
            bar.update(1)
    scores.update(right_branching=baseline_uas(test, 1), left_branching=baseline_uas(test, -1), best_offset=baseline_uas(test, best_offset))
    return {"uas": scores, "best_offset": best_offset, "train_sentences": len(train), "test_sentences": len(test)}


def cross_validate(sentences: Sequence[ProbeSentence], folds: int = 5, epochs: int = 30, seed: int = 0, progress: bool = False) -> dict:
    """k-fold cross-validation over sentences (each sentence's fold is fixed by a hash of its key); ``progress``: a bar
    over the folds' probes."""
    fold_of = np.array([keyed_rng(seed, "fold", s.key).integers(folds) for s in sentences])
    runs = []
    with tqdm(total=folds * len(VARIANTS), unit="probe", desc="parsing probe", disable=not progress) as bar:
        for fold in range(folds):
            train = [s for s, f in zip(sentences, fold_of) if f != fold]
            test = [s for s, f in zip(sentences, fold_of) if f == fold]
            if train and test:
                runs.append(evaluate(train, test, epochs=epochs, seed=seed, bar=bar))
    names = runs[0]["uas"].keys()
    return {
        "evaluation": f"{folds}-fold cross-validation over sentences",
        "uas": {name: float(np.mean([run["uas"][name] for run in runs])) for name in names},
        "uas_sd": {name: float(np.std([run["uas"][name] for run in runs], ddof=1)) if len(runs) > 1 else None for name in names},
        "folds": runs,
        "sentences": len(sentences),
        "words": int(sum(len(s.heads) for s in sentences)),
    }

