"""Olsson et al.'s synthetic probe (bertology.core.text.synthetic): drawn as it is read (a --limit draws only its
sequences), the same sequences as the list the probe was drawn into before, the flags it takes, and the exact length
of its sequences against the positions a run reads."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from bertology.core.errors import BertologyError
from bertology.core.model.models import load_tokenizer
from bertology.core.text.synthetic import (
    SYNTHETIC_LENGTH,
    require_synthetic_fits,
    synthetic_corpus,
    synthetic_probe_length,
    synthetic_repeats,
    whole_word_pieces,
)

#: The special tokens each tiny model's tokenizer puts around a text: GPT-2 none, Llama its BOS, BERT [CLS] and [SEP].
SPECIAL = {"tiny_gpt2_dir": 0, "tiny_llama_dir": 1, "tiny_bert_dir": 2}


class CountingTokenizer:
    """A tokenizer that counts the texts it decodes (each draw of the probe decodes one sequence), and fails past ``most``
    of them: a probe drawn whole before it is read fails at once rather than drawing 2,000,000 sequences."""

    def __init__(self, tokenizer, most: int = 1000):
        self.tokenizer, self.decoded, self.most = tokenizer, 0, most

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def decode(self, ids):
        self.decoded += 1
        assert self.decoded <= self.most, f"drew more than {self.most} sequences"
        return self.tokenizer.decode(ids)


def drawn_as_before(tokenizer, count: int, length: int, seed: int) -> list[str]:
    """The probe's texts as the code that built it as one list drew them: numpy's generator seeded with ``seed`` choosing
    ``length`` pieces from the list of whole-word pieces, a draw kept where its text tokenizes back to the pieces."""
    pool, rng, texts = whole_word_pieces(tokenizer), np.random.default_rng(seed), []
    while len(texts) < count:
        half = rng.choice(pool, size=length).tolist()
        text = tokenizer.decode(half + half)
        if tokenizer(text, add_special_tokens=False)["input_ids"] == half + half:
            texts.append(text)
    return texts


@pytest.fixture(scope="module")
def gpt2_tokenizer(tiny_gpt2_dir):
    return load_tokenizer(str(tiny_gpt2_dir))


def test_a_limit_draws_only_its_sequences(gpt2_tokenizer):
    """A probe of 2,000,000 sequences read to a limit of 10 draws as many sequences as a probe of 10 (nothing is drawn
    before it is read), and they are those 10."""
    counting = CountingTokenizer(gpt2_tokenizer)
    probe = synthetic_repeats(counting, 2_000_000, 8, seed=3)
    assert isinstance(probe, Iterator) and counting.decoded == 0
    examples, info = synthetic_corpus(counting, 2_000_000, 8, 3, limit=10)
    alone = CountingTokenizer(gpt2_tokenizer)
    ten, _ = synthetic_corpus(alone, 10, 8, 3, limit=None)
    assert len(examples) == 10 and 10 <= counting.decoded == alone.decoded
    assert [example.text for example in examples] == [example.text for example in ten]
    assert info == {"name": "synthetic-repeats-2000000x8", "path": None, "format": "synthetic repeats", "sha256": None}


@pytest.mark.parametrize("model", list(SPECIAL))
def test_the_first_sequences_are_those_the_whole_probe_was_drawn_into(model, request):
    """The first 12 sequences of a probe of 2,000,000 are a probe of 12's, and the texts the list-building code drew with
    the same seed (tables of earlier runs do not change)."""
    tokenizer = load_tokenizer(str(request.getfixturevalue(model)))
    first = [example.text for example, _ in zip(synthetic_repeats(tokenizer, 2_000_000, 9, seed=7), range(12))]
    assert first == [example.text for example in synthetic_repeats(tokenizer, 12, 9, seed=7)] == drawn_as_before(tokenizer, 12, 9, 7)
    assert first != drawn_as_before(tokenizer, 12, 9, 8)


def test_the_probe_flags_go_together():
    assert synthetic_probe_length(None, None, None) is None
    assert synthetic_probe_length(None, 5, None) == SYNTHETIC_LENGTH == 50
    assert synthetic_probe_length(None, 5, 7) == 7
    with pytest.raises(BertologyError, match=r"^--synthetic-length 7 is the length of the --synthetic-repeats probe's sequences: give "
                                             r"--synthetic-repeats N with it"):
        synthetic_probe_length(None, None, 7)
    with pytest.raises(BertologyError, match=r"^--synthetic-repeats makes the corpus: give no corpus \(--corpus\) with it$"):
        synthetic_probe_length("corpus.txt", 5, None)


@pytest.mark.parametrize("model", list(SPECIAL))
def test_the_longest_probe_that_fits_is_told_exactly(model, request):
    """Each tokenizer's sequence is two copies and its special tokens, counted here by tokenizing the probe as the engine does;
    the longest length whose sequence is at most 32 pieces fits, one more is refused, naming the positions and that length."""
    tokenizer = load_tokenizer(str(request.getfixturevalue(model)))
    lengths = {length: len(tokenizer(next(synthetic_repeats(tokenizer, 1, length)).text)["input_ids"]) for length in range(2, 20)}
    assert all(pieces == 2 * length + SPECIAL[model] for length, pieces in lengths.items())
    longest = max(length for length, pieces in lengths.items() if pieces <= 32)
    require_synthetic_fits(tokenizer, longest, 32, 32, "tiny")
    special = f"{SPECIAL[model]} special token{'' if SPECIAL[model] == 1 else 's'}"
    with pytest.raises(BertologyError) as refused:
        require_synthetic_fits(tokenizer, longest + 1, 32, 32, "tiny")
    assert str(refused.value) == (f"--synthetic-length {longest + 1} makes sequences of {lengths[longest + 1]} pieces (two copies of "
                                  f"{longest + 1} and {special}), more than the 32 positions tiny reads: their second copies would be cut; "
                                  f"the longest that fits is --synthetic-length {longest}")
    with pytest.raises(BertologyError, match=r"more than --max-length 20: .* the longest that fits is --synthetic-length "
                                             rf"{max(length for length, pieces in lengths.items() if pieces <= 20)}$"):
        require_synthetic_fits(tokenizer, longest, 20, 32, "tiny")
    with pytest.raises(BertologyError, match=r"no --synthetic-length fits \(it is at least 2\)$"):
        require_synthetic_fits(tokenizer, 2, 3 + SPECIAL[model], 32, "tiny")
