"""The engine's reading of examples into length-sorted batches, within bounded windows, capped at ``max_length``.

Each example is tokenized from a bounded part of its text (:meth:`LengthCappedReading.read`), so that neither memory nor
time grows with a sentence's length, then truncated or skipped past ``max_length``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import torch
from transformers import BatchEncoding

from bertology.core.engine.batch import Encoded
from bertology.core.engine.settings import PassSettings
from bertology.core.engine.stats import MIN_PIECES, RunStats
from bertology.core.model.models import LoadedModel
from bertology.core.text.corpora import Example

#: Bounded reading (:meth:`Engine.read`): a sentence is tokenized from its first ``CUT_MARGIN + CHARS_PER_PIECE * max_length``
#: characters, twice as many while that part cannot decide; the pieces in a part's last ``CUT_MARGIN`` characters (or a
#: WordPiece model's longest word, where longer) may differ from the whole sentence's (a word cut short) and decide nothing.
CHARS_PER_PIECE = 8
CUT_MARGIN = 1000


class LengthCappedReading:
    """The :class:`~bertology.core.engine.run.Engine`'s reading of examples into batches (a part of the engine: it reads
    the engine's model and :class:`~bertology.core.engine.settings.PassSettings`)."""

    model: LoadedModel
    settings: PassSettings  # resolved on the model: max_length an int

    def _encode(self, sentences: list[str], truncate: bool) -> BatchEncoding:
        """The encoding of a sentence or a pair, with offsets and segment ids; with ``truncate``, cut to ``max_length``."""
        return self.model.tokenizer(
            *sentences,
            truncation="longest_first" if truncate else False,
            max_length=self.settings.max_length if truncate else None,
            return_offsets_mapping=True,
            return_token_type_ids=True,
        )

    def read(self, example: Example) -> tuple[list[str], BatchEncoding]:
        """``(parts, encoding)``: the example's sentence (or two) cut to parts that decide what ``max_length`` does to it, and
        their encoding untruncated, so that neither memory nor time grows with a sentence's length.

        A sentence over the limit (:data:`CHARS_PER_PIECE`) is cut, and the cut stands once more than ``budget`` pieces
        (``max_length`` less the special tokens) lie before the part's margin (:data:`CUT_MARGIN`): those are the whole
        sentence's first pieces, so the whole is over ``max_length`` as well and truncation keeps only pieces among them.
        Otherwise the limit doubles, up to the whole sentence; a sentence that fits is never cut. In a pair, a cut sentence
        also needs more such pieces than the other sentence, where that one is whole, so that truncation (longest first)
        shares ``max_length`` between the two as it would between the whole ones; where both are cut, the one piece an odd
        budget leaves goes to the part with more pieces. A tokenizer that truncates on the left reads the whole sentences."""
        tokenizer = self.model.tokenizer
        sentences = [text for text in (example.text, example.text_pair) if text is not None]
        if tokenizer.truncation_side != "right" or all(len(sentence) <= CUT_MARGIN + CHARS_PER_PIECE * self.settings.max_length for sentence in sentences):
            return sentences, self._encode(sentences, truncate=False)
        margin = max(CUT_MARGIN, getattr(tokenizer.backend_tokenizer.model, "max_input_chars_per_word", 0))
        budget = self.settings.max_length - tokenizer.num_special_tokens_to_add(pair=len(sentences) == 2)
        limits = [margin + CHARS_PER_PIECE * self.settings.max_length] * len(sentences)
        while True:
            parts = [sentence[:limit] for sentence, limit in zip(sentences, limits)]
            encoding = self._encode(parts, truncate=False)
            cut = [len(part) < len(sentence) for part, sentence in zip(parts, sentences)]
            sides = encoding.sequence_ids()
            pieces = [sides.count(k) for k in range(len(parts))]
            decided = [sum(1 for (_, end), side in zip(encoding["offset_mapping"], sides) if side == k and end <= len(part) - margin)
                       for k, part in enumerate(parts)]
            undecided = [k for k in range(len(parts)) if cut[k] and not (
                decided[k] > budget and all(cut[other] or decided[k] > pieces[other] for other in range(len(parts)) if other != k))]
            if not undecided:
                return parts, encoding
            for k in undecided:
                limits[k] *= 2

    def encode(self, indexed: Iterable[tuple[int, Example]], stats: RunStats) -> Iterator[Encoded]:
        """Tokenize examples (a bounded part of each: :meth:`read`), truncating or skipping those over ``max_length``, and
        skipping those of fewer than :data:`MIN_PIECES` pieces (degenerate); ``stats`` counts each."""
        for index, example in indexed:
            parts, encoding = self.read(example)
            truncated = len(encoding["input_ids"]) > self.settings.max_length
            if truncated and self.settings.overflow == "skip":
                stats.skipped += 1
                stats.leave_out(index, example)
                continue
            if truncated:
                encoding = self._encode(parts, truncate=True)
            if len(encoding["input_ids"]) < MIN_PIECES:
                stats.degenerate += 1
                stats.leave_out(index, example)
                continue
            stats.truncated += int(truncated)
            yield Encoded(
                index=index,
                example=example,
                input_ids=encoding["input_ids"],
                token_type_ids=encoding.get("token_type_ids"),
                offsets=[tuple(o) for o in encoding["offset_mapping"]],
                sequence_ids=encoding.sequence_ids(),
                truncated=truncated,
            )

    def windows(self, encoded: Iterable[Encoded]) -> Iterator[list[list[Encoded]]]:
        """Consecutive windows of ``batch_size * sort_window`` encoded examples, each as its length-sorted batches:
        sorting within a window cuts padding while memory stays bounded."""
        iterator = iter(encoded)
        while window := list(itertools.islice(iterator, self.settings.batch_size * self.settings.sort_window)):
            window.sort(key=lambda item: (len(item), item.index))
            batches, start = [], 0
            while start < len(window):
                stop = start + 1
                while stop < len(window) and self.fits(stop - start + 1, len(window[stop])):
                    stop += 1
                batches.append(window[start:stop])
                start = stop
            yield batches

    def fits(self, count: int, longest: int) -> bool:
        """Whether ``count`` sequences padded to ``longest`` pieces make one batch: at most ``batch_size`` sequences, or
        with ``batch_tokens`` at most that many padded pieces; and at most ``max_attention_elements`` of attention."""
        within = count <= self.settings.batch_size if self.settings.batch_tokens is None else count * longest <= self.settings.batch_tokens
        return within and count * self.model.num_layers * self.model.num_heads * longest * longest <= self.settings.max_attention_elements

    def batches(self, encoded: Iterable[Encoded]) -> Iterator[list[Encoded]]:
        """Length-sorted batches, sorted within windows so that memory stays bounded."""
        for window in self.windows(encoded):
            yield from window

    def collate(self, items: list[Encoded]) -> dict[str, torch.Tensor]:
        """Pad a batch into tensors on the model's device."""
        pad_id = self.model.tokenizer.pad_token_id or 0
        width = max(len(item) for item in items)
        input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.bool)
        token_types = torch.zeros((len(items), width), dtype=torch.long)
        segments = torch.full((len(items), width), -1, dtype=torch.long)
        for row, item in enumerate(items):
            n = len(item)
            input_ids[row, :n] = torch.tensor(item.input_ids)
            mask[row, :n] = True
            if item.token_type_ids is not None:
                token_types[row, :n] = torch.tensor(item.token_type_ids)
            segments[row, :n] = torch.tensor([-1 if s is None else s for s in item.sequence_ids])
        device = self.model.device
        return {
            "input_ids": input_ids.to(device),
            "mask": mask.to(device),
            "token_type_ids": token_types.to(device),
            "segment_ids": segments.to(device),
        }

