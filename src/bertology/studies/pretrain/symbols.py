"""Pre-training on a synthetic task (``bertology pretrain --causal --synthetic repeats``): sequences of random symbols in which
a random segment repeats with a random period and offset (:func:`~bertology.core.text.synthetic.repeated_segment`), made in
memory, so that only content, not position, predicts a repeat: the setting in which small models form induction heads in
minutes (Olsson et al. 2022; METHODS.md section 15).

- vocabulary: ``--vocab-size`` symbols, each a name of lower-case letters of one width (``a``..``z``, then ``aa``..), and the
  byte-level BPE's special tokens, as a word-level tokenizer (:func:`symbol_tokenizer`) saved with every checkpoint, so that
  every command reads a checkpoint's text as it was trained; nothing is added around a text, as GPT-2's tokenizer adds nothing;
- instances: ``--max-length`` symbols each, drawn uniformly; a segment of ``p`` symbols (``p`` uniform from ``--min-period``
  to ``--max-period``) at a uniform offset is copied on for ``round(--repeat-share x --max-length)`` symbols, the share
  of each sequence's symbols that repeat an earlier one by its segment;
- each epoch draws :data:`SEQUENCES_PER_EPOCH` fresh sequences from a generator keyed by the seed and the epoch, the
  validation set :data:`VALIDATION_SEQUENCES` from one keyed by the seed alone (never a training sequence's draw).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from itertools import islice, product

import numpy as np
from transformers import PreTrainedTokenizerFast

from bertology.core.errors import BertologyError
from bertology.core.statistics.stats import keyed_rng
from bertology.core.text.synthetic import repeated_segment
from bertology.studies.pretrain.objectives import BPE_SPECIAL_TOKENS, Objective
from bertology.studies.pretrain.settings import PretrainSettings

#: The synthetic tasks ``--synthetic`` names.
SYNTHETIC_TASKS = ("repeats",)
#: The synthetic settings' defaults: 64 symbols, half of each sequence repeats, periods of 6 to 24 (the issue's recipe, as
#: in Olsson et al.'s small attention-only models).
SYMBOLS, REPEAT_SHARE, MIN_PERIOD, MAX_PERIOD = 64, 0.5, 6, 24
#: Fresh sequences drawn for each epoch, and the fixed validation sequences.
SEQUENCES_PER_EPOCH, VALIDATION_SEQUENCES = 4096, 256
UNKNOWN = "<unk>"
#: A corpus's vocabulary (WordPiece or byte-level BPE): its default size and its least.
TEXT_VOCABULARY, MIN_TEXT_VOCABULARY = 8000, 100


def symbol_names(count: int) -> list[str]:
    """``count`` distinct names of lower-case letters, all of the fewest letters that give that many: ``a``..``z``, then
    ``aa``, ``ab``.. (letters alone, so that ``track``'s synthetic probes draw them as whole words)."""
    width = 1
    while len(string.ascii_lowercase) ** width < count:
        width += 1
    return ["".join(letters) for letters in islice(product(string.ascii_lowercase, repeat=width), count)]


def symbol_tokenizer(count: int, max_length: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of ``count`` symbols (:func:`symbol_names`) split at spaces, after the byte-level BPE's special
    tokens (``<|endoftext|>`` its BOS and EOS, ``<pad>``) and ``<unk>``; it adds nothing around a text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = [*BPE_SPECIAL_TOKENS, UNKNOWN, *symbol_names(count)]
    words = Tokenizer(models.WordLevel({piece: i for i, piece in enumerate(pieces)}, unk_token=UNKNOWN))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # pieces joined by spaces (no piece starts with ##)
    end, pad = BPE_SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=words, bos_token=end, eos_token=end, pad_token=pad, unk_token=UNKNOWN,
                                   model_max_length=max_length)


def synthetic_settings(synthetic: str | None, objective: Objective, vocab_size: int | None, repeat_share: float | None,
                       min_period: int | None, max_period: int | None, max_length: int) -> dict:
    """The synthetic task's settings (:class:`PretrainSettings`' ``synthetic``, ``vocab_size``, ``repeat_share``, ``min_period``,
    ``max_period``), defaults filled in; refused in one line naming the flag: an unknown task, a task without ``--causal``,
    a task's flag without ``--synthetic``, a share outside (0, 1) and periods that do not fit ``--max-length``."""
    given = {"--repeat-share": repeat_share, "--min-period": min_period, "--max-period": max_period}
    if synthetic is None:
        flags = [flag for flag, value in given.items() if value is not None]
        if flags:
            raise BertologyError(f"{flags[0]} is a setting of --synthetic repeats: give --synthetic repeats with it, or leave it out")
        if vocab_size is not None and vocab_size < MIN_TEXT_VOCABULARY:
            raise BertologyError(f"--vocab-size {vocab_size}: a corpus's vocabulary needs at least {MIN_TEXT_VOCABULARY} pieces")
        return {"synthetic": None, "vocab_size": TEXT_VOCABULARY if vocab_size is None else vocab_size}
    if synthetic not in SYNTHETIC_TASKS:
        raise BertologyError(f"--synthetic {synthetic}: unknown synthetic task; use {' or '.join(SYNTHETIC_TASKS)}")
    if objective.masks:
        raise BertologyError("--synthetic repeats trains a decoder (the causal LM loss): give --causal with it")
    share = REPEAT_SHARE if repeat_share is None else repeat_share
    low, high = MIN_PERIOD if min_period is None else min_period, MAX_PERIOD if max_period is None else max_period
    if not 0 < share < 1:
        raise BertologyError(f"--repeat-share must be above 0 and below 1, not {share!r}")
    repeated = round(share * max_length)
    if not 1 <= low <= high:
        raise BertologyError(f"--min-period {low} and --max-period {high}: periods run from 1 up, the least first")
    if repeated < 1 or high + repeated > max_length:
        raise BertologyError(f"--max-period {high} and --repeat-share {share:g} make sequences of {high} + {repeated} symbols with a repeat "
                             f"of at least one, and --max-length is {max_length}: lower them or raise --max-length")
    return {"synthetic": synthetic, "vocab_size": SYMBOLS if vocab_size is None else vocab_size, "repeat_share": share,
            "min_period": low, "max_period": high}


@dataclass
class SyntheticCorpus:
    """The synthetic task as a run reads it, in the shape of :class:`~bertology.studies.pretrain.corpus.RunCorpus`: the
    tokenizer, each epoch's fresh instances, the validation sequences and the first epoch's (the unigram yardstick's text)."""

    settings: PretrainSettings
    objective: Objective
    tokenizer: PreTrainedTokenizerFast
    train_ids: list[list[list[int]]]  # one document: the first epoch's sequences
    validation_ids: list[list[list[int]]]  # one document: the validation sequences
    files: tuple = ()  # no file: nothing a refusal of a file could name

    def sequences(self, count: int, *key) -> list[list[int]]:
        """``count`` sequences of ids (:func:`~bertology.core.text.synthetic.repeated_segment`) drawn by a generator keyed by the
        seed and ``key``."""
        s = self.settings
        rng = keyed_rng(s.seed, "synthetic", *key)
        symbols = np.arange(len(self.tokenizer) - s.vocab_size, len(self.tokenizer))
        repeated = round(s.repeat_share * s.max_length)
        return [repeated_segment(rng, symbols, s.max_length, (s.min_period, s.max_period), repeated)[0] for _ in range(count)]

    def instances(self, ids: list[list[list[int]]], rng: np.random.Generator) -> list[dict]:
        return self.objective.instances(ids, self.settings.max_length, rng, self.tokenizer)  # a sequence fills an instance

    def epoch_rows(self, index: int) -> list[dict]:
        """The training instances of epoch ``index``: fresh sequences (the first epoch's are :attr:`train_ids`)."""
        ids = self.train_ids[0] if index == 0 else self.sequences(SEQUENCES_PER_EPOCH, "epoch", index)
        return [{"input_ids": sequence} for sequence in ids]

    def facts(self) -> dict:
        """What ``pretraining.json`` and the manifest record of the corpus."""
        s = self.settings
        return {"synthetic": s.synthetic, "symbols": s.vocab_size, "repeat_share": s.repeat_share, "periods": [s.min_period, s.max_period],
                "sequences_per_epoch": SEQUENCES_PER_EPOCH, "training_pieces": SEQUENCES_PER_EPOCH * s.max_length}


def synthetic_corpus(settings: PretrainSettings, objective: Objective) -> SyntheticCorpus:
    """The run's :class:`SyntheticCorpus`: its tokenizer, the first epoch's sequences and the validation sequences."""
    tokenizer = symbol_tokenizer(settings.vocab_size, settings.max_length)
    corpus = SyntheticCorpus(settings, objective, tokenizer, [], [])
    corpus.train_ids = [corpus.sequences(SEQUENCES_PER_EPOCH, "epoch", 0)]
    corpus.validation_ids = [corpus.sequences(VALIDATION_SEQUENCES, "validation")]
    return corpus
