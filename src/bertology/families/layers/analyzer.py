"""Word vectors of every layer for the layer-wise probes (the Primer, sections 4-5; docs/methods.md#layer-probes).

:class:`WordVectors` keeps, for each sentence with a tree whose words all kept their pieces, every layer's vector of
every word (``layer 0``: the embeddings), the word's form, UPOS tag and dependency relation. A word's vector is its
first piece's (``pooling="first"``) or the mean of its pieces (``"mean"``). At most ``max_sentences`` are kept: those
that come first in their file (by line; sentences given in memory, by text), whatever the batches, shards or order in
which they arrive (the rest are counted in ``seen``). Vectors are kept in
float16 (a probe standardises its features, so the rounding is far below what it can read).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps

POOLINGS = ("first", "mean")


def sentence_key(example) -> tuple[int, str, str]:
    """Where a sentence stands in its corpus: its line (-1 in memory), then its text(s); orders the sentences kept."""
    return (example.line if example.line is not None else -1, example.text, example.text_pair or "")


@dataclass
class LayerSentence:
    """One sentence's words: ``forms``, ``upos``, ``relations``, ``heads`` (1-based, 0 = root), and ``vectors[layer, word, dim]``."""

    key: tuple[int, str, str]
    forms: tuple[str, ...]
    upos: tuple[str, ...]
    relations: tuple[str, ...]
    heads: tuple[int, ...]
    vectors: np.ndarray


class WordVectors(LayerwiseAnalyzer):
    """Every layer's word vectors of the first ``max_sentences`` sentences with trees (see the module docstring)."""

    name = "word_vectors"
    folds_row_blocks = True  # it reads no maps, only the layers' outputs
    needs = frozenset({"hidden_states"})

    def __init__(self, pooling: str = "first", max_sentences: int = 3000):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}")
        self.pooling, self.max_sentences = pooling, max_sentences
        self.sentences: dict[tuple[int, str, str], LayerSentence] = {}
        self.seen = 0

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        """Reads no maps: the layers' outputs come with the batch's end."""

    def finish_batch(self, batch: Batch) -> None:
        for b, example in enumerate(batch.examples):
            if not example.has_tree:
                continue
            alignment = batch.alignments[b]
            units = alignment.word_unit[: len(example.heads)]
            if (units < 0).any():
                continue
            self.seen += 1
            key = sentence_key(example)
            if len(self.sentences) >= self.max_sentences and key > max(self.sentences):
                continue
            n = int(batch.host_lengths[b])
            shares = torch.as_tensor(alignment.assignment[units], dtype=batch.hidden_states.dtype, device=batch.hidden_states.device)
            if self.pooling == "first":
                first = (shares > 0).to(torch.int8).argmax(dim=1)
                weights = torch.zeros_like(shares)
                weights[torch.arange(len(units)), first] = 1.0
            else:
                weights = shares / shares.sum(dim=1, keepdim=True)
            vectors = torch.einsum("wp,lpd->lwd", weights, batch.hidden_states[:, b, :n])
            upos = example.upos if example.upos is not None else ("_",) * len(units)
            self.sentences[key] = LayerSentence(key, tuple(example.words), tuple(upos), tuple(example.relations), tuple(example.heads),
                                                  vectors.half().cpu().numpy())
            self._keep_first()

    def _keep_first(self) -> None:
        while len(self.sentences) > self.max_sentences:
            del self.sentences[max(self.sentences)]

    def merge(self, other: "WordVectors") -> "WordVectors":
        self._check_mergeable(other)
        self.sentences.update(other.sentences)
        self.seen += other.seen
        self._keep_first()
        return self

    def ordered(self) -> list[LayerSentence]:
        return [self.sentences[key] for key in sorted(self.sentences)]

    @property
    def capped(self) -> bool:
        return self.seen > len(self.sentences)

    def result(self) -> pd.DataFrame:
        """The sentences kept: ``line, text, words``."""
        ordered = self.ordered()
        return pd.DataFrame({"line": [s.key[0] for s in ordered], "text": [s.key[1] for s in ordered], "words": [len(s.forms) for s in ordered]})
