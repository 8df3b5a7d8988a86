"""Olsson et al.'s (2022) probe of induction heads as a corpus: random whole-word pieces of a model's vocabulary, each
sequence repeated twice (``--synthetic-repeats``, ``--synthetic-length``; docs/methods.md#decoder-head-types); and sequences in
which a random segment repeats with a random period and offset (:func:`repeated_segment`), which ``bertology pretrain
--synthetic repeats`` trains on and ``track``'s induction verdict reads, so that only content, not position, predicts a
repeat (METHODS.md section 15).

The probe is drawn lazily, one sequence at a time, so a run that reads its first ``--limit`` sequences draws only those.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np

from bertology.core.errors import BertologyError
from bertology.core.text.corpora import Example

#: Olsson et al.'s (2022) probe of induction heads: sequences of this many random pieces, each sequence repeated twice.
SYNTHETIC_LENGTH = 50
#: Draws of one synthetic sequence before giving up on a tokenizer whose whole-word pieces do not come back from their text.
SYNTHETIC_TRIES = 100


def repeated_segment(rng: np.random.Generator, pool: np.ndarray, length: int, periods: tuple[int, int],
                     repeated: int | None = None) -> tuple[list[int], int, int]:
    """One sequence of ``length`` pieces drawn uniformly from ``pool`` in which a segment repeats: its period ``p`` uniform in
    ``periods`` (both ends included), its first copy at offset ``o``, then copied on for ``repeated`` pieces,
    ``x[o + p + k] = x[o + k mod p]``, with ``o`` uniform where that fits (``0 <= o <= length - p - repeated``); ``repeated``
    None: the copies run to the end, ``o`` uniform where two whole copies fit (``o <= length - 2p``). Every other piece is
    drawn on its own. Returns ``(pieces, p, o + p)``, the last where the second copy begins (``Example.second_copy``)."""
    period = int(rng.integers(periods[0], periods[1] + 1))
    copied = length - 2 * period if repeated is None else length - period - repeated
    if copied < 0:
        raise BertologyError(f"a segment of {period} pieces repeated for {period if repeated is None else repeated} more does not fit in {length}")
    offset = int(rng.integers(0, copied + 1))
    pieces = rng.choice(pool, size=length)
    end = length if repeated is None else offset + period + repeated
    pieces[offset + period : end] = np.resize(pieces[offset : offset + period], end - offset - period)
    return pieces.tolist(), period, offset + period


def whole_word_pieces(tokenizer) -> list[int]:
    """The ids of ``tokenizer``'s whole-word pieces, special tokens aside: a piece whose text is letters alone (after at most
    a leading space: GPT-2's "Ġcat", Llama's "▁cat", BERT's "cat"; not "##s") and which, twice in a row, reads as two words
    and is given back by tokenizing that text (a piece that only continues a word, GPT-2's "cat" without "Ġ", is not), in id
    order."""
    special = set(tokenizer.all_special_ids)
    candidates = [piece for piece in sorted(set(tokenizer.get_vocab().values())) if piece not in special]
    texts = tokenizer.batch_decode([[piece] for piece in candidates])
    candidates = [piece for piece, text in zip(candidates, texts) if text.strip().isalpha() and text.lstrip(" ") == text.strip()]
    if not candidates:
        return []
    doubled = tokenizer.batch_decode([[piece, piece] for piece in candidates])
    back = _pieces(tokenizer, doubled)
    return [piece for piece, text, ids in zip(candidates, doubled, back) if len(text.split()) == 2 and ids == [piece, piece]]


def _pieces(tokenizer, text: str | list[str]) -> list[int] | list[list[int]]:
    """The ids of ``text``'s pieces (of each text of a list), special tokens aside; no mask is made (a third of the time of
    tokenizing a vocabulary's doubled pieces)."""
    return tokenizer(text, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)["input_ids"]


def synthetic_repeats(tokenizer, count: int, length: int = SYNTHETIC_LENGTH, seed: int = 0) -> Iterator[Example]:
    """Olsson et al.'s (2022) probe of induction heads as a corpus: ``count`` sequences, each ``length`` whole-word pieces of
    the vocabulary (:func:`whole_word_pieces`) drawn uniformly with replacement (numpy's generator seeded with ``seed``)
    and then repeated, ``r_1 .. r_L r_1 .. r_L``, as text (``source`` ``synthetic:K``). Each text tokenizes back to
    exactly the drawn pieces (special tokens aside); a draw whose text does not is drawn again (up to
    :data:`SYNTHETIC_TRIES` times), so the model sees the probe as drawn. The arguments and the vocabulary are checked now;
    the sequences are drawn as they are read, so the first K of any ``count`` are the same K (``itertools.islice``)."""
    if count < 1 or length < 2:
        raise BertologyError(f"a synthetic probe needs at least 1 sequence of at least 2 pieces, not {count} of {length}")
    pool = whole_word_pieces(tokenizer)
    if len(pool) < 2:
        raise BertologyError(f"the tokenizer has {len(pool)} whole-word pieces that come back from their text: too few to draw a synthetic probe from")
    return _draws(tokenizer, np.asarray(pool), count, length, np.random.default_rng(seed))


def _draws(tokenizer, pool: np.ndarray, count: int, length: int, rng: np.random.Generator) -> Iterator[Example]:
    """:func:`synthetic_repeats`' sequences, drawn one at a time from ``pool`` (an array: ``rng.choice`` draws the same
    pieces as from the list, without converting it at every draw)."""
    def draw() -> tuple[list[int], None]:
        half = rng.choice(pool, size=length).tolist()
        return half + half, None

    for number in range(1, count + 1):
        text, _ = _drawn_as_text(tokenizer, draw, f"{length} whole-word pieces", "the synthetic probe")
        yield Example(text, source=f"synthetic:{number}", second_copy=length)


def _drawn_as_text(tokenizer, draw, pieces: str, probe: str) -> tuple[str, object]:
    """The text of the first of :data:`SYNTHETIC_TRIES` draws (``draw() -> (ids, what goes with them)``) whose text tokenizes
    back to exactly its ids, and what goes with it; refused in one line where none does (``pieces`` and ``probe`` name them)."""
    for _ in range(SYNTHETIC_TRIES):
        ids, extra = draw()
        text = tokenizer.decode(ids)
        if _pieces(tokenizer, text) == ids:
            return text, extra
    raise BertologyError(f"no draw of {pieces} in {SYNTHETIC_TRIES} tokenized back to the pieces drawn: this tokenizer cannot carry {probe} as text")


#: The induction probe's sequences (:func:`induction_probe`): this many pieces at most, as the issue's recipe.
PROBE_LENGTH = 64


def probe_periods(length: int) -> tuple[int, int]:
    """The periods of an induction probe's sequences of ``length`` pieces: from a tenth of it (at least 2) to three eighths
    (6 to 24 for 64 pieces), so that two copies of the longest fit with room for an offset."""
    return max(2, round(length / 10)), max(2, length * 3 // 8)


def induction_probe(tokenizer, count: int, length: int, seed: int) -> list[Example]:
    """``count`` sequences of ``length`` whole-word pieces of the vocabulary (:func:`whole_word_pieces`) in which a segment
    repeats to the end at a random period (:func:`probe_periods`) and offset (:func:`repeated_segment`), drawn with numpy's
    generator seeded with ``seed``, as text (``source`` ``induction-probe:K``, ``second_copy`` and ``period`` set): only
    content, not position, tells where a repeat's next piece is, so a head that copies by position scores at one period
    alone. A draw whose text does not tokenize back to its pieces is drawn again (up to :data:`SYNTHETIC_TRIES` times)."""
    pool = np.asarray(whole_word_pieces(tokenizer))
    if len(pool) < 2:
        raise BertologyError(f"the tokenizer has {len(pool)} whole-word pieces that come back from their text: too few to draw an induction probe from")
    rng, periods, examples = np.random.default_rng(seed), probe_periods(length), []

    def draw() -> tuple[list[int], tuple[int, int]]:
        pieces, period, second_copy = repeated_segment(rng, pool, length, periods)
        return pieces, (period, second_copy)

    for number in range(1, count + 1):
        text, (period, second_copy) = _drawn_as_text(tokenizer, draw, f"{length} whole-word pieces", "the induction probe")
        examples.append(Example(text, source=f"induction-probe:{number}", second_copy=second_copy, period=period))
    return examples


def synthetic_probe_length(corpus: object, count: int | None, length: int | None) -> int | None:
    """The length of a run's synthetic probe, ``length`` or :data:`SYNTHETIC_LENGTH` where it is None, or None without a probe
    (``count`` None). A probe given with a corpus, or a length without a probe, is refused in one line naming the flags."""
    if count is None:
        if length is not None:
            raise BertologyError(f"--synthetic-length {length} is the length of the --synthetic-repeats probe's sequences: give "
                                 "--synthetic-repeats N with it, or leave it out")
        return None
    if corpus is not None:
        raise BertologyError("--synthetic-repeats makes the corpus: give no corpus (--corpus) with it")
    return SYNTHETIC_LENGTH if length is None else length


def synthetic_corpus(tokenizer, count: int, length: int, seed: int, limit: int | None) -> tuple[list[Example], dict]:
    """A run's corpus of :func:`synthetic_repeats`: its first ``limit`` sequences (all ``count`` without one; only those
    are drawn) and the corpus facts."""
    examples = list(islice(synthetic_repeats(tokenizer, count, length, seed), limit))
    return examples, {"name": f"synthetic-repeats-{count}x{length}", "path": None, "format": "synthetic repeats", "sha256": None}


def require_synthetic_fits(tokenizer, length: int, max_length: int, model_length: int, model: str) -> None:
    """Refuse, in one line and before any pass, a probe whose sequences are longer than a run reads: two copies of ``length``
    pieces and the special tokens the tokenizer adds (``num_special_tokens_to_add``: Llama's BOS, BERT's [CLS] and [SEP]),
    over ``max_length`` (the run's, at most the ``model_length`` positions ``model`` reads). Cut there, a sequence loses
    its second copy, the rows every score of the probe reads. The line names the longest ``--synthetic-length`` that fits,
    ``(max_length - special) // 2``."""
    special = tokenizer.num_special_tokens_to_add(pair=False)
    pieces = 2 * length + special
    if pieces <= max_length:
        return
    bound = f"the {model_length} positions {model} reads" if max_length >= model_length else f"--max-length {max_length}"
    longest = (max_length - special) // 2
    fits = f"the longest that fits is --synthetic-length {longest}" if longest >= 2 else "no --synthetic-length fits (it is at least 2)"
    raise BertologyError(f"--synthetic-length {length} makes sequences of {pieces} pieces (two copies of {length} and {special} special "
                         f"token{'' if special == 1 else 's'}), more than {bound}: their second copies would be cut; {fits}")
