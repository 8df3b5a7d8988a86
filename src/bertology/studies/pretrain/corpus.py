"""The corpus a pre-training run reads: plain text, one document per file, paragraphs separated by blank lines and split
into sentences by spaCy's rule-based ``sentencizer``; validation is the last ``validation_share`` of every document's
sentences, the same sentences and validation text for every objective. The objective
(:mod:`~bertology.studies.pretrain.objectives`) trains the vocabulary and makes the instances; this module reads the
files, splits them, puts both texts in pieces (:func:`read_corpus`) and makes the fixed validation batches with their
unigram yardstick (:func:`validation_set`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

from bertology.core.errors import CorpusError, StateError
from bertology.core.model.models import quiet_transformers
from bertology.core.statistics.stats import keyed_rng
from bertology.core.text.corpora import numbered_lines
from bertology.studies.pretrain.objectives import Objective
from bertology.studies.pretrain.settings import PretrainSettings


def corpus_files(paths: list[str | Path]) -> list[Path]:
    """The text files of ``paths``: files as given, folders expanded to their ``*.txt`` files (sorted)."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.glob("*.txt"))
            if not found:
                raise CorpusError(path, None, "no .txt files in this folder")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise CorpusError(path, None, "no such file or folder")
    return files


def read_documents(files: list[Path]) -> list[list[str]]:
    """Each file as one document: its sentences, in order (paragraphs end at blank lines)."""
    import spacy

    splitter = spacy.blank("en")
    splitter.add_pipe("sentencizer")
    documents = []
    for path in files:
        paragraphs, current = [], []
        for _, line in numbered_lines(path):
            if line.strip():
                current.append(line.strip())
            elif current:
                paragraphs.append(" ".join(current))
                current = []
        if current:
            paragraphs.append(" ".join(current))
        sentences = [sentence.text for doc in splitter.pipe(paragraphs, batch_size=256) for sentence in doc.sents if sentence.text.strip()]
        if not sentences:
            raise CorpusError(path, None, "no text in this file")
        documents.append(sentences)
    return documents


def documents_for_pairs(documents: list[list[str]], parts: int = 10) -> list[list[str]]:
    """Documents to draw next-sentence negatives from: a single document is cut into ``parts`` consecutive parts.

    A negative pair needs its second segment from another document; with one file there is none,
    and every pair would be a true continuation.
    """
    if len(documents) != 1:
        return documents
    sentences = documents[0]
    bounds = np.linspace(0, len(sentences), min(parts, len(sentences)) + 1).astype(int)
    return [sentences[start:end] for start, end in zip(bounds, bounds[1:]) if end > start]


def split_documents(documents: list[list[str]], validation_share: float) -> tuple[list[list[str]], list[list[str]]]:
    """Training and validation documents: the last ``validation_share`` of each document's sentences is held out."""
    train, validation = [], []
    for sentences in documents:
        held = int(round(len(sentences) * validation_share))
        train.append(sentences[: len(sentences) - held])
        if held:
            validation.append(sentences[len(sentences) - held :])
    return train, validation


def unigram_cross_entropy(train_ids: list[list[list[int]]], targets: np.ndarray, vocab_size: int) -> float:
    """``-mean_t ln p(t)`` over the pieces ``targets``, ``p`` = add-one smoothed training piece frequencies."""
    pieces = np.fromiter((piece for document in train_ids for sentence in document for piece in sentence), dtype=np.int64)
    counts = np.bincount(pieces, minlength=vocab_size) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[targets].mean())


def collate(collator: DataCollatorForLanguageModeling, rows: list[dict], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch on ``device``: the collator pads (and masks), the next-sentence labels pass through where the rows have them."""
    batch = collator([{k: v for k, v in row.items() if k != "next_sentence_label"} for row in rows])
    if "next_sentence_label" in rows[0]:
        batch["next_sentence_label"] = torch.tensor([row["next_sentence_label"] for row in rows])
    return {k: v.to(device) for k, v in batch.items()}


@dataclass
class RunCorpus:
    """The corpus as a run reads it: its files and documents (sentences), their pieces (training and validation text),
    and the instances the objective makes of them."""

    files: list[Path]
    documents: list[list[str]]
    train_ids: list[list[list[int]]]
    validation_ids: list[list[list[int]]]
    objective: Objective
    tokenizer: PreTrainedTokenizerFast
    max_length: int
    seed: int

    def instances(self, ids: list[list[list[int]]], rng: np.random.Generator) -> list[dict]:
        return self.objective.instances(ids, self.max_length, rng, self.tokenizer)

    def facts(self) -> dict:
        """What ``pretraining.json`` and the manifest record of the corpus."""
        return {"files": [str(f) for f in self.files], "documents": len(self.documents), "sentences": sum(map(len, self.documents)),
                "training_pieces": int(sum(len(s) for document in self.train_ids for s in document))}

    def epoch_rows(self, index: int) -> list[dict]:
        """The training instances of epoch ``index``, (paired and) shuffled by a generator keyed by the epoch."""
        rng = keyed_rng(self.seed, "epoch", index)
        rows = self.instances(self.train_ids, rng)
        return [rows[i] for i in rng.permutation(len(rows))]


def run_tokenizer(objective: Objective, train_text: list[list[str]], settings: PretrainSettings, saved: Path | None) -> PreTrainedTokenizerFast:
    """The vocabulary saved with the training state in ``saved`` where the run resumes (the saved weights were trained with
    it), else the ``objective``'s trained on ``train_text``."""
    if saved is not None:
        try:
            return objective.tokenizer_class.from_pretrained(saved)
        except Exception as exc:  # transformers and tokenizers raise many kinds for a damaged file, the bare Exception included
            raise StateError(saved, f"cannot read the tokenizer saved with the training state ({' '.join(str(exc).split())[:120]}); "
                                    f"delete {saved} to start over") from None
    return objective.train_tokenizer([s for document in train_text for s in document], settings.vocab_size, settings.max_length)


def read_corpus(files: list[Path], settings: PretrainSettings, objective: Objective, saved: Path | None) -> RunCorpus:
    """The corpus's documents split into training and validation text, the tokenizer (:func:`run_tokenizer`), and both
    texts in pieces."""
    documents = documents_for_pairs(read_documents(files))  # the same sentences and validation text for both objectives
    train_text, validation_text = split_documents(documents, settings.validation_share)
    tokenizer = run_tokenizer(objective, train_text, settings, saved)

    def encode(docs: list[list[str]]) -> list[list[list[int]]]:
        return [tokenizer(document, add_special_tokens=False)["input_ids"] if document else [] for document in docs]

    with quiet_transformers():  # sentences longer than max_length are fine here: instances are cut to size
        train_ids, validation_ids = encode(train_text), encode(validation_text)
    return RunCorpus(files, documents, train_ids, validation_ids, objective, tokenizer, settings.max_length, settings.seed)


@dataclass
class Validation:
    """What a run is validated on: fixed (already masked) batches, and the unigram yardstick on their scored pieces."""

    rows: list[dict]
    on_training_text: bool  # a corpus too small to hold text out: (fixed) training instances stand in
    batches: list[dict[str, torch.Tensor]]
    unigram: float


def validation_set(corpus: RunCorpus, settings: PretrainSettings, torch_device: torch.device) -> Validation:
    """The validation instances (held-out text, or fixed training instances where there is none), masked once into fixed
    batches, and the unigram cross-entropy of their scored pieces; refused where no piece is scored."""
    seed, batch_size, objective = settings.seed, settings.batch_size, corpus.objective
    validation_rows = corpus.instances(corpus.validation_ids, keyed_rng(seed, "validation"))
    validated_on_training_text = not validation_rows
    if validated_on_training_text:  # a corpus too small to hold text out: validate on (fixed) training instances, and say so
        validation_rows = corpus.instances(corpus.train_ids, keyed_rng(seed, "validation"))[:batch_size]
    validation_collator = objective.collator(corpus.tokenizer, settings, seed=seed + 1)
    validation_batches = [collate(validation_collator, validation_rows[i : i + batch_size], torch_device)
                          for i in range(0, len(validation_rows), batch_size)]
    targets = np.concatenate([objective.scored_labels(batch).cpu().numpy() for batch in validation_batches])
    if not len(targets):  # no validation loss to measure: its mean would be NaN
        raise CorpusError(corpus.files[0], None, "too little text to validate on: no validation piece is masked or has a next piece")
    unigram = unigram_cross_entropy(corpus.train_ids, targets, len(corpus.tokenizer))
    return Validation(validation_rows, validated_on_training_text, validation_batches, unigram)
