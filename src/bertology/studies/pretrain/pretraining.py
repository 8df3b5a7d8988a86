"""Pre-training a small BERT, or a small GPT-2-style decoder, from scratch: the checkpoint series that training-dynamics
analyses track.

The encoder's recipe is BERT's (Devlin et al. 2019), scaled down:

- corpus: plain text, one document per file, paragraphs separated by blank lines and split into
  sentences by spaCy's rule-based ``sentencizer``;
- vocabulary: WordPiece trained on the training text with HF ``tokenizers`` (lower-cased);
- instances: ``[CLS] A [SEP] B [SEP]``, where A and B are runs of whole sentences filling
  ``max_length``; half of the time B is the text that follows A (next-sentence label 0), half of
  the time a run from another document (label 1), so that [SEP] separates two segments the model
  must relate. The pairing is redrawn every epoch;
- masked-LM: 15% of the non-special pieces are chosen, of those 80% become [MASK], 10% a random
  piece and 10% stay (transformers' ``DataCollatorForLanguageModeling``). The output projection is
  applied only at the chosen positions: the same loss for about a seventh of its cost;
- loss = masked-LM cross-entropy + next-sentence cross-entropy; AdamW with linear warm-up and decay.

The decoder's (``objective="causal-lm"``, ``bertology pretrain --causal``) is GPT-2's (Radford et al. 2019), scaled down,
on the same sentences and the same validation text, so that ``track`` can follow the attention sink's emergence
(Gu et al. 2025, docs/methods.md#decoders):

- vocabulary: byte-level BPE trained on the training text with HF ``tokenizers`` (cased, no unknown piece); the
  tokenizer adds nothing around a text: no [CLS] or [SEP], and no BOS, so that the first piece is the first token, as GPT-2's;
- instances: runs of whole sentences of one document, at most ``max_length`` pieces each, so that every run starts
  at a sentence (as ``track`` reads a corpus);
- loss = the causal LM loss, the next-token cross-entropy ``-mean_t ln p(x_{t+1} | x_{<=t})`` over every piece but
  the first of each run; AdamW with the same schedule.

Checkpoints are saved at log-spaced steps (step 0, the random initialisation, included), each a
model folder (config, weights, tokenizer) that every bertology command accepts as ``--model``.

Yardstick for "the model has learnt something": the unigram cross-entropy
``-mean_t ln p(t)`` over the validation pieces ``t`` the loss scores (masked LM: the masked ones; causal LM: every
piece but a run's first), where ``p`` is the add-one smoothed piece frequency of the training text; the model's loss
is measured on the same pieces (validation = the last ``validation_share`` of every document's sentences).

A corpus too small to hold any sentence out (a document holds one out from 26 sentences at the default 2%; a
one-sentence corpus never does) is validated on fixed training instances, and the run says so: a warning line, the
field ``corpus.validated_on_training_text`` of the manifest and ``pretraining.json``, and the report's words. It is not
refused: a toy or smoke-test corpus is what such a run is for, and its scores still show whether the model fits its text;
but they are no measure of generalisation, and nothing may pass them off as one.

A run that diverges (a loss, a validation score or a weight that is not a finite number, as ``--learning-rate 1e30``
gives within two steps) stops at that step with one line (:class:`~bertology.core.learning.training.TrainingDiverged`) that
names the last good checkpoint; nothing non-finite is saved, so every checkpoint and training state kept is a good one.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import (
    BertConfig,
    BertForPreTraining,
    BertTokenizerFast,
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    get_linear_schedule_with_warmup,
)
from transformers.utils import logging as hf_logging

from bertology.core.errors import BertologyError, CorpusError, StateError
from bertology.core.learning.tasks import next_token_losses
from bertology.core.learning.training import (
    TrainingDiverged,
    check_generator_state,
    check_learning_rate,
    load_training_state,
    random_states,
    resume_training,
    save_training_state,
)
from bertology.core.model.models import first_non_finite, quiet_transformers, resolve_device
from bertology.core.statistics.stats import keyed_rng
from bertology.core.storage.digests import file_digest
from bertology.core.storage.runfolder import RunFolder, claims_out, complete_run, link_tree
from bertology.core.storage.safeload import finite_array, whole_number
from bertology.core.text.corpora import numbered_lines

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
#: The byte-level BPE's special tokens: GPT-2's end of text (its BOS and EOS, never added by the tokenizer) and the padding of batches.
BPE_SPECIAL_TOKENS = ("<|endoftext|>", "<pad>")
#: What a pre-training state holds (:func:`pretrain`); a state without one of them is from an older bertology.
PRETRAIN_STATE_KEYS = ("model", "optimizer", "scheduler", "mask_rng", "random", "step", "epoch", "position", "losses", "evaluations", "settings")
CHECKPOINT_PREFIX = "step-"


@dataclass(frozen=True)
class Objective:
    """What a pre-training objective trains and records."""

    name: str  # PretrainSettings.objective
    architecture: str
    loss: str  # the report's and the manifest's words for the loss
    step_losses: tuple[str, ...]  # the training losses of each step (loss.csv, between step and learning_rate)
    scores: tuple[str, ...]  # the validation scores of each checkpoint (checkpoints.csv: val_<score>); the first is the loss
    score_names: tuple[str, ...]  # the scores in a refusal of a damaged state


OBJECTIVES = {objective.name: objective for objective in (
    Objective("masked-lm", "BERT", "masked-LM cross-entropy + next-sentence cross-entropy (Devlin et al. 2019)", ("mlm_loss", "nsp_loss"),
              ("mlm_loss", "nsp_accuracy"), ("loss", "accuracy")),
    Objective("causal-lm", "GPT-2", "causal LM loss: next-token cross-entropy (Radford et al. 2019)", ("lm_loss",), ("lm_loss",), ("loss",)),
)}


@dataclass
class PretrainSettings:
    """What a pre-training run does (saved with its training state: a resume must match)."""

    corpus: list[str]
    vocab_size: int = 8000
    layers: int = 4
    heads: int = 8
    hidden: int = 256
    intermediate: int = 1024
    max_length: int = 128
    batch_size: int = 32
    steps: int = 1500
    learning_rate: float = 1e-3
    warmup: float = 0.06
    weight_decay: float = 0.01
    mask_probability: float = 0.15
    checkpoints: int = 12
    validation_share: float = 0.02
    seed: int = 0
    corpus_sha256: list[str] | None = None  # each corpus file's content: a resume never trains on an edited corpus
    objective: str = "masked-lm"  # a key of OBJECTIVES
    linear_checkpoints: bool = False  # checkpoints evenly spaced (checkpoint_steps), for a change in mid-run such as induction heads'


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


def train_wordpiece(sentences: list[str], vocab_size: int, max_length: int) -> BertTokenizerFast:
    """A lower-cased WordPiece tokenizer trained on ``sentences`` (HF ``tokenizers``), wrapped for transformers.

    The trainer numbers pieces of equal rank in hash order, which changes from process to process;
    WordPiece's output does not depend on the numbering, so the pieces are renumbered (special
    tokens first, then sorted) to make the same corpus give the same ids.
    """
    from tokenizers import BertWordPieceTokenizer
    from tokenizers.models import WordPiece

    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(sentences, vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    pieces = list(SPECIAL_TOKENS) + sorted(set(wordpiece.get_vocab()) - set(SPECIAL_TOKENS))
    wordpiece._tokenizer.model = WordPiece({piece: i for i, piece in enumerate(pieces)}, unk_token="[UNK]")
    return BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, model_max_length=max_length)


def train_byte_level_bpe(sentences: list[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's, Radford et al. 2019) trained on ``sentences`` (HF ``tokenizers``), wrapped for transformers.

    Cased, every byte a piece (no unknown piece), and nothing added around a text: no [CLS]/[SEP] and no BOS, the
    first piece is the first token, as with GPT-2's tokenizer. ``<|endoftext|>`` is its BOS and EOS, ``<pad>`` pads
    batches. A text's first word gets the space marker ``Ġ`` too (``add_prefix_space``): a sentence is cut into the
    same pieces alone as inside a run. The trainer ranks merges by count, ties by the pair, so the same corpus gives the
    same pieces and ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=True)  # offsets without the leading space: pieces align with words
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(BPE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(sentences, trainer)
    end = BPE_SPECIAL_TOKENS[0]
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=end, eos_token=end, pad_token=BPE_SPECIAL_TOKENS[1], model_max_length=max_length)


def make_instances(documents: list[list[list[int]]], max_length: int, rng: np.random.Generator,
                   cls_id: int, sep_id: int) -> list[dict]:
    """Sentence-pair instances for masked-LM + next-sentence prediction (Devlin et al.'s ``create_instances_from_document``).

    Sentences of a document are gathered until they fill ``max_length - 3`` pieces; the run is cut
    at a random sentence boundary into A and B. With probability 1/2 (always for a one-sentence
    run), B is replaced by a run of sentences from another document (``next_sentence_label`` 1)
    and the unused sentences go back into the stream. A pair that is too long loses pieces from
    the end of its longer segment.
    """
    budget = max_length - 3
    instances = []
    for d, sentences in enumerate(documents):
        chunk, length, i = [], 0, 0
        while i < len(sentences):
            chunk.append(sentences[i])
            length += len(sentences[i])
            if i == len(sentences) - 1 or length >= budget:
                cut = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
                segment_a = [piece for sentence in chunk[:cut] for piece in sentence]
                others = [k for k in range(len(documents)) if k != d and documents[k]]
                if others and (len(chunk) == 1 or rng.random() < 0.5):
                    other = documents[others[int(rng.integers(len(others)))]]
                    start = int(rng.integers(len(other)))
                    segment_b = []
                    for sentence in other[start:]:
                        segment_b.extend(sentence)
                        if len(segment_b) >= budget - len(segment_a):
                            break
                    label = 1
                    i -= len(chunk) - cut  # the sentences not used go back into the stream
                else:
                    segment_b, label = [piece for sentence in chunk[cut:] for piece in sentence], 0
                while len(segment_a) + len(segment_b) > budget:
                    (segment_a if len(segment_a) > len(segment_b) else segment_b).pop()
                if segment_a and segment_b:
                    instances.append(
                        {
                            "input_ids": [cls_id, *segment_a, sep_id, *segment_b, sep_id],
                            "token_type_ids": [0] * (len(segment_a) + 2) + [1] * (len(segment_b) + 1),
                            "special_tokens_mask": [1] + [0] * len(segment_a) + [1] + [0] * len(segment_b) + [1],
                            "next_sentence_label": label,
                        }
                    )
                chunk, length = [], 0
            i += 1
    return instances


def make_causal_instances(documents: list[list[list[int]]], max_length: int) -> list[dict]:
    """Instances for the causal LM loss: runs of whole sentences of one document, at most ``max_length`` pieces each,
    so that every run starts at a sentence; a sentence longer than ``max_length`` is cut into runs of its own."""
    instances = []
    for sentences in documents:
        run: list[int] = []
        for sentence in sentences:
            for start in range(0, len(sentence), max_length):
                part = sentence[start : start + max_length]
                if len(run) + len(part) > max_length:
                    instances.append({"input_ids": run})
                    run = []
                run = run + part
        if run:
            instances.append({"input_ids": run})
    return instances


def checkpoint_steps(steps: int, count: int, linear: bool = False) -> list[int]:
    """Step 0 and ``count - 1`` log-spaced steps from ``min(10, steps)`` to ``steps`` (fewer where they coincide); with
    ``linear``, ``count`` evenly spaced steps from 0 to ``steps``: dense through the middle of the run, where a phase
    change such as the induction heads' (Olsson et al. 2022) falls, not only at its start."""
    if count < 2:
        return [steps]
    if linear:
        return sorted({0, *np.round(np.linspace(0, steps, count)).astype(int).tolist(), steps})
    spaced = np.geomspace(min(10, steps), steps, count - 1) if steps > 0 else np.array([])
    return sorted({0, *np.round(spaced).astype(int).tolist(), steps})


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def run_identity(settings: PretrainSettings) -> dict:
    """What tells one pre-training run from another, written into each of its checkpoints' ``pretraining_step.json`` (``run``;
    ``bertology track`` refuses a series of checkpoints of two runs): a random ``id`` drawn when the run starts (a resume keeps
    it), its ``seed`` and its ``recipe``, a digest of its settings but the seed and the corpus files' names."""
    recipe = json.dumps({key: value for key, value in asdict(settings).items() if key not in ("seed", "corpus")}, sort_keys=True)
    return {"id": uuid.uuid4().hex, "seed": settings.seed, "recipe": hashlib.sha256(recipe.encode()).hexdigest()[:16]}


def check_pretraining_state(path: Path, state: dict, steps: int, objective: Objective) -> None:
    """Refuse a pre-training state (read by :func:`~bertology.studies.finetune.finetuning.load_training_state`) whose own parts are
    damaged: a step past ``steps``, the masking generator's state, epoch and position whole numbers from 0, a row of
    finite (step, the ``objective``'s losses, learning rate) per step, and per checkpoint saved an evaluation
    (step, checkpoint name, its validation scores)."""
    step = whole_number(state["step"], "step", path, high=steps)
    check_generator_state(state["mask_rng"], "mask_rng", path)
    whole_number(state["epoch"], "epoch", path)
    whole_number(state["position"], "position", path)
    if len(state["losses"]) != step:
        raise StateError(path, f"'losses' has {len(state['losses'])} rows for {step} steps")
    if step:
        finite_array(state["losses"], "losses", path, shape=(step, 2 + len(objective.step_losses)))
    if not isinstance(state["evaluations"], list):
        raise StateError(path, "'evaluations' must be a list")
    width = 2 + len(objective.scores)
    for row in state["evaluations"]:
        if not (isinstance(row, (list, tuple)) and len(row) == width
                and row[1] == checkpoint_name(whole_number(row[0], "an evaluation's step", path, high=step))):
            raise StateError(path, f"'evaluations' must hold (step, checkpoint name, validation {', '.join(objective.score_names)}) rows")
        finite_array(row[2:], f"an evaluation's {' and '.join(objective.score_names)}", path, shape=(width - 2,))


def pretraining_losses(network: BertForPreTraining, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked-LM and next-sentence cross-entropies (means) and the next-sentence logits; the LM head runs only at masked positions."""
    output = network.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"])
    masked = batch["labels"] != -100
    scores = network.cls.predictions(output.last_hidden_state[masked])
    next_logits = network.cls.seq_relationship(output.pooler_output)
    return F.cross_entropy(scores, batch["labels"][masked]), F.cross_entropy(next_logits, batch["next_sentence_label"]), next_logits


def next_token_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[batch, n - 1]``: the piece each position but the last predicts, ``labels[:, 1:]`` (-100 where that is padding)."""
    return batch["labels"][:, 1:]


def causal_lm_loss(network: GPT2LMHeadModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal LM loss: the next-token cross-entropy ``-mean_t ln p(x_{t+1} | x_{<=t})``, the mean over the pieces
    that have a next piece (the logits at position t score the piece at t + 1; padding scores nothing)."""
    logits = network(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    summed, predicted = next_token_losses(logits, batch["input_ids"], batch["attention_mask"].bool())  # the loss importance and gradients use
    return summed.sum() / predicted.sum()


def scored_labels(batch: dict[str, torch.Tensor], objective: Objective) -> torch.Tensor:
    """The pieces the ``objective``'s loss scores in ``batch``: the masked ones (masked LM), or every piece but each
    run's first (causal LM)."""
    labels = batch["labels"] if objective.name == "masked-lm" else next_token_labels(batch)
    return labels[labels != -100]


def training_losses(network, batch: dict[str, torch.Tensor], objective: Objective) -> tuple[torch.Tensor, ...]:
    """The ``objective``'s training losses of one batch (:attr:`Objective.step_losses`); their sum is minimised."""
    if objective.name == "masked-lm":
        return pretraining_losses(network, batch)[:2]
    return (causal_lm_loss(network, batch),)


def _collate(collator: DataCollatorForLanguageModeling, rows: list[dict], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch on ``device``: the collator pads (and masks), the next-sentence labels pass through where the rows have them."""
    batch = collator([{k: v for k, v in row.items() if k != "next_sentence_label"} for row in rows])
    if "next_sentence_label" in rows[0]:
        batch["next_sentence_label"] = torch.tensor([row["next_sentence_label"] for row in rows])
    return {k: v.to(device) for k, v in batch.items()}


def evaluate(network, batches: list[dict[str, torch.Tensor]], objective: Objective) -> dict[str, float]:
    """The ``objective``'s validation scores on fixed (already masked) batches: the loss, a mean over the scored pieces
    (:func:`scored_labels`), and for the masked LM the next-sentence accuracy."""
    network.eval()
    total, count, correct, pairs = 0.0, 0, 0, 0
    with torch.inference_mode():
        for batch in batches:
            scored = len(scored_labels(batch, objective))
            if objective.name == "masked-lm":
                loss, _, next_logits = pretraining_losses(network, batch)
                correct += int((next_logits.argmax(-1) == batch["next_sentence_label"]).sum())
                pairs += len(next_logits)
            else:
                loss = causal_lm_loss(network, batch)
            if scored:  # a batch with no scored piece (a lone run of one piece) adds nothing: its mean is NaN
                total += float(loss) * scored
                count += scored
    network.train()
    loss = total / max(count, 1)
    return {"mlm_loss": loss, "nsp_accuracy": correct / max(pairs, 1)} if objective.name == "masked-lm" else {"lm_loss": loss}


def unigram_cross_entropy(train_ids: list[list[list[int]]], targets: np.ndarray, vocab_size: int) -> float:
    """``-mean_t ln p(t)`` over the pieces ``targets``, ``p`` = add-one smoothed training piece frequencies."""
    pieces = np.fromiter((piece for document in train_ids for sentence in document for piece in sentence), dtype=np.int64)
    counts = np.bincount(pieces, minlength=vocab_size) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[targets].mean())


@dataclass
class _Corpus:
    """The corpus as a run reads it: its files and documents (sentences), their pieces (training and validation text),
    and the instances made of them."""

    files: list[Path]
    documents: list[list[str]]
    train_ids: list[list[list[int]]]
    validation_ids: list[list[list[int]]]
    causal: bool
    max_length: int
    seed: int
    cls_id: int | None
    sep_id: int | None

    def instances(self, ids: list[list[list[int]]], rng: np.random.Generator) -> list[dict]:
        return make_causal_instances(ids, self.max_length) if self.causal else make_instances(ids, self.max_length, rng, self.cls_id, self.sep_id)

    def epoch_rows(self, index: int) -> list[dict]:
        """The training instances of epoch ``index``, (paired and) shuffled by a generator keyed by the epoch."""
        rng = keyed_rng(self.seed, "epoch", index)
        rows = self.instances(self.train_ids, rng)
        return [rows[i] for i in rng.permutation(len(rows))]


@dataclass
class _Validation:
    """What a run is validated on: fixed (already masked) batches, and the unigram yardstick on their scored pieces."""

    rows: list[dict]
    on_training_text: bool  # a corpus too small to hold text out: (fixed) training instances stand in
    batches: list[dict[str, torch.Tensor]]
    unigram: float


@dataclass
class _Run:
    """A pre-training run under way: the model and what trains it, where its work is kept (``training``), and how far
    it has gone (step, epoch and position in the epoch's instances, the losses so far and the checkpoints saved)."""

    settings: PretrainSettings
    goal: Objective
    training: Path
    network: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast
    optimizer: torch.optim.Optimizer
    scheduler: object
    collator: DataCollatorForLanguageModeling
    validation_batches: list[dict[str, torch.Tensor]]
    device: torch.device
    step: int = 0
    epoch: int = 0
    position: int = 0
    losses: list = field(default_factory=list)
    evaluations: list = field(default_factory=list)
    identity: dict = field(default_factory=dict)  # run_identity: drawn when the run starts, kept by a resume

    def resume(self, state: dict) -> None:
        """Go on from a saved training state: its weights, optimiser, schedule, random states, progress and the run's identity
        (a state saved before runs had one keeps the one drawn now)."""
        path = self.training / "state" / "state.pt"
        resume_training(path, state, self.network, self.optimizer, self.scheduler)  # and torch's random state: dropout
        identity = state.get("run", self.identity)
        if not (isinstance(identity, dict) and set(identity) == {"id", "seed", "recipe"} and isinstance(identity["id"], str)
                and isinstance(identity["recipe"], str) and identity["seed"] == self.settings.seed):
            raise StateError(path, f"'run' must be this run's identity (id, seed {self.settings.seed}, recipe), not {str(identity)[:80]}")
        self.identity = identity
        self.collator.generator.set_state(state["mask_rng"])
        self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
        self.losses, self.evaluations = state["losses"], state["evaluations"]

    def stop_if_diverged(self, at: int, values: dict[str, float], weights: bool = False) -> None:
        """Stop the run at step ``at`` where one of ``values`` (losses or validation scores) or, with ``weights``, a weight
        is not a finite number, before anything of that step is saved; what was saved before is kept."""
        what = next((f"its {name} is {value}" for name, value in values.items() if not math.isfinite(value)), None)
        if what is None and weights and first_non_finite(self.network) is not None:
            what = "its weights are no longer finite numbers"
        if what is not None:
            kept = (f"the last good checkpoint is {(self.training / 'checkpoints' / self.evaluations[-1][1]).resolve()}" if self.evaluations
                    else "no checkpoint was saved")
            raise TrainingDiverged(f"pre-training diverged at step {at}: {what} (--learning-rate {self.settings.learning_rate:g}); stopped, {kept}; "
                                   "lower --learning-rate and give another --out")

    def save_state(self) -> None:
        self.stop_if_diverged(self.step, {}, weights=True)
        save_training_state(self.training / "state", {
            "model": self.network.state_dict(), "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "mask_rng": self.collator.generator.get_state(), "random": random_states(), "step": self.step, "epoch": self.epoch,
            "position": self.position, "losses": self.losses, "evaluations": self.evaluations, "settings": asdict(self.settings),
            "run": self.identity,
        }, self.tokenizer)

    def save_checkpoint(self) -> None:
        scores = evaluate(self.network, self.validation_batches, self.goal)
        self.stop_if_diverged(self.step, {f"validation {score}": value for score, value in scores.items()}, weights=True)
        name = checkpoint_name(self.step)
        target = self.training / "checkpoints" / name
        with quiet_transformers():
            self.network.save_pretrained(target)
            self.tokenizer.save_pretrained(target)
        marker = {"step": self.step, **scores, "run": self.identity}
        (target / "pretraining_step.json").write_text(json.dumps(marker, indent=2, allow_nan=False) + "\n")
        self.evaluations.append((self.step, name, *scores.values()))

    def take_step(self, batch: dict[str, torch.Tensor]) -> None:
        """One optimiser step on ``batch``, its losses recorded; a loss that is not finite stops the run before the step."""
        parts = training_losses(self.network, batch, self.goal)
        values = [part.item() for part in parts]
        self.stop_if_diverged(self.step + 1, dict(zip(self.goal.step_losses, values)))
        sum(parts).backward()
        torch.nn.utils.clip_grad_norm_(self.network.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.step += 1
        self.losses.append((self.step, *values, self.scheduler.get_last_lr()[0]))


def _resume_or_start(training: Path, settings: PretrainSettings, goal: Objective) -> dict | None:
    """The training state saved in ``training`` by an unfinished run of these very settings, or None (and ``training``
    cleared) where none was saved; the state of a run with other settings is refused, and so is a damaged one."""
    state_folder = training / "state"
    state = load_training_state(state_folder / "state.pt", PRETRAIN_STATE_KEYS) if (state_folder / "state.pt").is_file() else None
    if state is None:
        shutil.rmtree(training, ignore_errors=True)  # a start that never saved a state: nothing to resume
    elif state.get("settings") != asdict(settings):
        raise BertologyError(f"{state_folder}: the training state of a run with other settings or another corpus is there; use another --out or delete it")
    else:
        check_pretraining_state(state_folder / "state.pt", state, settings.steps, goal)
    return state


def _tokenizer(train_text: list[list[str]], settings: PretrainSettings, resumed: bool, state_folder: Path) -> PreTrainedTokenizerFast:
    """The vocabulary saved with the training state where the run resumes (the saved weights were trained with it), else
    one trained on ``train_text``: WordPiece for the masked LM, byte-level BPE for the causal LM."""
    causal = settings.objective == "causal-lm"
    if resumed:
        try:
            return (PreTrainedTokenizerFast if causal else BertTokenizerFast).from_pretrained(state_folder)
        except Exception as exc:  # transformers and tokenizers raise many kinds for a damaged file, the bare Exception included
            raise StateError(state_folder, f"cannot read the tokenizer saved with the training state ({' '.join(str(exc).split())[:120]}); "
                                           f"delete {state_folder} to start over") from None
    train_tokenizer = train_byte_level_bpe if causal else train_wordpiece
    return train_tokenizer([s for document in train_text for s in document], settings.vocab_size, settings.max_length)


def _read_corpus(files: list[Path], settings: PretrainSettings, resumed: bool, state_folder: Path) -> tuple[_Corpus, PreTrainedTokenizerFast]:
    """The corpus's documents split into training and validation text, the tokenizer (:func:`_tokenizer`), and both
    texts in pieces."""
    documents = documents_for_pairs(read_documents(files))  # the same sentences and validation text for both objectives
    train_text, validation_text = split_documents(documents, settings.validation_share)
    tokenizer = _tokenizer(train_text, settings, resumed, state_folder)

    def encode(docs: list[list[str]]) -> list[list[list[int]]]:
        return [tokenizer(document, add_special_tokens=False)["input_ids"] if document else [] for document in docs]

    with quiet_transformers():  # sentences longer than max_length are fine here: instances are cut to size
        train_ids, validation_ids = encode(train_text), encode(validation_text)
    corpus = _Corpus(files, documents, train_ids, validation_ids, settings.objective == "causal-lm", settings.max_length, settings.seed,
                     tokenizer.cls_token_id, tokenizer.sep_token_id)
    return corpus, tokenizer


def _validation(corpus: _Corpus, tokenizer: PreTrainedTokenizerFast, settings: PretrainSettings, goal: Objective,
                torch_device: torch.device) -> _Validation:
    """The validation instances (held-out text, or fixed training instances where there is none), masked once into fixed
    batches, and the unigram cross-entropy of their scored pieces; refused where no piece is scored."""
    seed, batch_size = settings.seed, settings.batch_size
    validation_rows = corpus.instances(corpus.validation_ids, keyed_rng(seed, "validation"))
    validated_on_training_text = not validation_rows
    if validated_on_training_text:  # a corpus too small to hold text out: validate on (fixed) training instances, and say so
        validation_rows = corpus.instances(corpus.train_ids, keyed_rng(seed, "validation"))[:batch_size]
    validation_collator = DataCollatorForLanguageModeling(tokenizer, mlm=not corpus.causal, mlm_probability=settings.mask_probability, seed=seed + 1)
    validation_batches = [_collate(validation_collator, validation_rows[i : i + batch_size], torch_device)
                          for i in range(0, len(validation_rows), batch_size)]
    targets = np.concatenate([scored_labels(batch, goal).cpu().numpy() for batch in validation_batches])
    if not len(targets):  # no validation loss to measure: its mean would be NaN
        raise CorpusError(corpus.files[0], None, "too little text to validate on: no validation piece is masked or has a next piece")
    unigram = unigram_cross_entropy(corpus.train_ids, targets, len(tokenizer))
    return _Validation(validation_rows, validated_on_training_text, validation_batches, unigram)


def _build_model(tokenizer: PreTrainedTokenizerFast, settings: PretrainSettings, torch_device: torch.device) -> torch.nn.Module:
    """A randomly initialised model of the settings' size on ``torch_device``: a GPT-2 for the causal LM, else a BERT."""
    if settings.objective == "causal-lm":
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=settings.max_length, n_embd=settings.hidden, n_layer=settings.layers,
                            n_head=settings.heads, n_inner=settings.intermediate, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return GPT2LMHeadModel(config).to(torch_device)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=settings.hidden, num_hidden_layers=settings.layers,
                        num_attention_heads=settings.heads, intermediate_size=settings.intermediate, max_position_embeddings=settings.max_length,
                        type_vocab_size=2, pad_token_id=tokenizer.pad_token_id)
    return BertForPreTraining(config).to(torch_device)


def _optimiser(network: torch.nn.Module, settings: PretrainSettings) -> tuple[torch.optim.Optimizer, object]:
    """AdamW (no decay on biases and layer-norm weights) and its linear warm-up and decay over the run's steps."""
    undecayed = [p.ndim < 2 for p in network.parameters()]  # biases and layer-norm weights (BERT's LayerNorm, GPT-2's ln_*)
    groups = [
        {"params": [p for p, flat in zip(network.parameters(), undecayed) if not flat], "weight_decay": settings.weight_decay},
        {"params": [p for p, flat in zip(network.parameters(), undecayed) if flat], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=settings.learning_rate, betas=(0.9, 0.98), eps=1e-6)
    scheduler = get_linear_schedule_with_warmup(optimizer, max(1, int(settings.warmup * settings.steps)), settings.steps)
    return optimizer, scheduler


def _train(run: _Run, corpus: _Corpus, rows: list[dict], stop_at: int, save_every: int, progress: bool) -> list[dict]:
    """Train up to step ``stop_at``, saving the checkpoints at their steps (step 0 first) and the training state every
    ``save_every`` steps and at the end; returns the instances of the epoch it stopped in. A batch with no piece to score
    is passed over; an epoch and more of them is refused."""
    goal, batch_size, steps = run.goal, run.settings.batch_size, run.settings.steps
    saved_steps = set(checkpoint_steps(steps, run.settings.checkpoints, run.settings.linear_checkpoints))
    done = {row[0] for row in run.evaluations}
    run.network.train()
    if run.step == 0 and 0 not in done:
        run.save_checkpoint()
    if run.epoch:  # resumed in a later epoch
        rows = corpus.epoch_rows(run.epoch)
    unscored = 0  # batches in a row with no piece to score
    with tqdm(total=steps, initial=run.step, unit="step", desc="pre-training", disable=not progress) as bar:
        while run.step < stop_at:
            if run.position >= len(rows):
                run.epoch, run.position = run.epoch + 1, 0
                rows = corpus.epoch_rows(run.epoch)
            batch = _collate(run.collator, rows[run.position : run.position + batch_size], run.device)
            run.position += batch_size
            if not len(scored_labels(batch, goal)):  # no piece masked, or runs of one piece (a tiny corpus): no LM loss, so no step
                unscored += 1
                if unscored > len(rows):  # a whole epoch and more
                    raise CorpusError(corpus.files[0], None, "too little text to train on: no training batch has a piece masked or a next piece")
                continue
            unscored = 0
            run.take_step(batch)
            bar.update(1)
            bar.set_postfix({goal.step_losses[0].removesuffix("_loss"): f"{np.mean([row[1] for row in run.losses[-50:]]):.3f}"})
            if run.step in saved_steps:
                run.save_checkpoint()
            if run.step in saved_steps or run.step % save_every == 0 or run.step == stop_at:
                run.save_state()
    return rows


def _summary(run: _Run, corpus: _Corpus, validation: _Validation, rows: list[dict], out: str | Path, resumed_from: int, seconds: float) -> dict:
    """``pretraining.json``: the objective, corpus, model, settings, final validation scores against the unigram yardstick,
    and the run's facts."""
    goal, settings, network = run.goal, run.settings, run.network
    final = dict(zip(goal.scores, run.evaluations[-1][2:]))
    return {
        "objective": settings.objective,
        "loss": goal.loss,
        "corpus": {"files": settings.corpus, "documents": len(corpus.documents), "sentences": sum(map(len, corpus.documents)),
                   "training_pieces": int(sum(len(s) for document in corpus.train_ids for s in document)),
                   "validation_instances": len(validation.rows), "validated_on_training_text": validation.on_training_text},
        "model": {"architecture": goal.architecture, "parameters": sum(p.numel() for p in network.base_model.parameters()),
                  "vocab_size": len(run.tokenizer)},
        # a causal run masks nothing: its settings leave the masking share out
        "settings": {key: value for key, value in asdict(settings).items() if key != "mask_probability" or settings.objective == "masked-lm"},
        "device": str(run.device),
        "steps": settings.steps,
        "epochs": round(run.epoch + run.position / max(len(rows), 1), 2),
        "resumed_from_step": resumed_from or None,
        "seconds": round(seconds, 1),
        "final_checkpoint": str((Path(out) / "checkpoints" / run.evaluations[-1][1]).resolve()),
        **{f"val_{score}": value for score, value in final.items()},
        "unigram_cross_entropy": validation.unigram,
        f"train_{goal.step_losses[0]}_last_50": float(np.mean([row[1] for row in run.losses[-50:]])),
    }


def _write_run(out: str | Path, run: _Run, summary: dict, command: list[str] | None) -> None:
    """Replace ``out`` whole with the finished run: its checkpoints, ``loss.csv``, ``checkpoints.csv``, ``pretraining.json``,
    the report and the manifest."""
    from bertology.studies.pretrain.report import pretraining_report

    goal = run.goal
    folder = RunFolder(out)  # replaces out whole, training/ with it
    link_tree(run.training / "checkpoints", folder.path / "checkpoints")
    loss_table = pd.DataFrame(run.losses, columns=["step", *goal.step_losses, "learning_rate"])
    checkpoint_table = pd.DataFrame(run.evaluations, columns=["step", "checkpoint", *(f"val_{score}" for score in goal.scores)])
    folder.write_table("loss", loss_table)
    folder.write_table("checkpoints", checkpoint_table)
    folder.write_json("pretraining.json", summary)
    manifest = {key: summary[key] for key in ("objective", "loss", "corpus", "model", "settings", "device", "steps", "resumed_from_step")}
    complete_run(folder, manifest, report=pretraining_report(folder, summary, loss_table, checkpoint_table), command=command)


@claims_out(work="training", words=("device", "objective"))
def pretrain(
    corpus: list[str | Path] | str | Path,
    out: str | Path,
    *,
    objective: str = "masked-lm",
    vocab_size: int = 8000,
    layers: int = 4,
    heads: int = 8,
    hidden: int = 256,
    intermediate: int | None = None,
    max_length: int = 128,
    batch_size: int = 32,
    steps: int = 1500,
    learning_rate: float = 1e-3,
    warmup: float = 0.06,
    weight_decay: float = 0.01,
    mask_probability: float = 0.15,
    checkpoints: int = 12,
    linear_checkpoints: bool = False,
    validation_share: float = 0.02,
    seed: int = 0,
    device: str = "auto",
    save_every: int = 200,
    max_steps: int | None = None,
    progress: bool = True,
    command: list[str] | None = None,
) -> dict:
    """Pre-train a model of the given size from scratch on ``corpus`` (text files or folders of ``*.txt``): a BERT with the
    masked-LM and next-sentence losses (``objective="masked-lm"``), or a GPT-2-style decoder with the causal LM loss
    (``"causal-lm"``; ``mask_probability`` plays no part). :data:`OBJECTIVES` says what each records.

    Writes to ``out``: ``checkpoints/step-NNNNNN/`` (model folders, each with a ``pretraining_step.json``: its step, validation
    scores and the run's identity, :func:`run_identity`), ``checkpoints.csv`` (step,
    validation scores: masked-LM loss and next-sentence accuracy, or the causal LM loss), ``loss.csv`` (training losses per step),
    ``loss_curve.png``, ``report.html`` and ``pretraining.json`` (the objective and its loss, settings, corpus, unigram
    baseline, final losses, wall time). While training, the checkpoints so far and the training state
    (saved every ``save_every`` steps, read back with ``weights_only=True``) are kept in ``out/training/``:
    the same call resumes an interrupted run, and an earlier run in ``out`` stays whole until the new
    one replaces it at the end. ``max_steps`` stops early (tests use it to interrupt).

    A batch with no piece to score (none masked, or runs of one piece: only a tiny corpus has them) is passed over, not
    a step: its LM loss would be NaN. A run that diverges stops in one line with the checkpoints so far kept, and a corpus
    too small to hold text out is validated on training text and says so (the module's docstring says why).
    """
    if objective not in OBJECTIVES:
        raise BertologyError(f"unknown objective {objective!r}: use {' or '.join(OBJECTIVES)}")
    if hidden % heads:
        raise BertologyError(f"--hidden {hidden} is not divisible by --heads {heads}")
    check_learning_rate(learning_rate)
    goal, causal = OBJECTIVES[objective], objective == "causal-lm"
    started = time.perf_counter()
    files = corpus_files([corpus] if isinstance(corpus, (str, Path)) else list(corpus))
    settings = PretrainSettings([str(f) for f in files], vocab_size, layers, heads, hidden, intermediate or 4 * hidden, max_length,
                                batch_size, steps, learning_rate, warmup, weight_decay, mask_probability, checkpoints, validation_share, seed,
                                corpus_sha256=[file_digest(Path(f), {}) for f in files], objective=objective,
                                linear_checkpoints=linear_checkpoints)
    torch_device = resolve_device(device)
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)

    training = Path(out) / "training"  # the work of an unfinished run: its state and checkpoints so far
    state = _resume_or_start(training, settings, goal)
    text, tokenizer = _read_corpus(files, settings, state is not None, training / "state")
    rows = text.epoch_rows(0)
    if not rows:
        raise CorpusError(files[0], None, "too little text to make one training instance")
    validation = _validation(text, tokenizer, settings, goal, torch_device)
    network = _build_model(tokenizer, settings, torch_device)
    optimizer, scheduler = _optimiser(network, settings)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=not causal, mlm_probability=mask_probability, seed=seed)
    collator.create_rng()  # the causal LM draws nothing from it; its state is saved all the same
    run = _Run(settings, goal, training, network, tokenizer, optimizer, scheduler, collator, validation.batches, torch_device, identity=run_identity(settings))
    if state is not None:
        run.resume(state)
    resumed_from = run.step

    stop_at = steps if max_steps is None else min(steps, max_steps)
    rows = _train(run, text, rows, stop_at, save_every, progress)
    if run.step < steps:
        return {"interrupted_at_step": run.step, "steps": steps}
    summary = _summary(run, text, validation, rows, out, resumed_from, time.perf_counter() - started)
    _write_run(out, run, summary, command)
    return summary
