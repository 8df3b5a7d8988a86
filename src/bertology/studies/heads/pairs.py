"""Prompt pairs for activation and attribution patching, and the logit difference they are scored by.

A clean prompt ``x`` and a corrupted one ``x'`` of the same length, an answer piece ``a`` and a wrong piece ``b``
(docs/methods.md#which-heads-matter-causally); the metric is the logit difference ``LD = logit_a - logit_b`` at the last
position (a decoder), at the clean prompt's one mask (an encoder's masked-LM head), or of two labels' logits (a sequence
classifier, whose ``answer`` and ``wrong`` name its labels).

:func:`read_pairs` reads them from a JSON-lines file; :mod:`bertology.studies.heads.pair_tasks` builds the built-in sets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bertology.core.errors import BertologyError, CorpusError
from bertology.core.model.kinds import DECODER

#: The keys of one line of a pairs file.
PAIR_KEYS = ("clean", "corrupt", "answer", "wrong")


@dataclass(frozen=True)
class EncodedPair:
    """One pair as the model reads it: both prompts' pieces (same length), the answer and wrong pieces, the position whose
    logits are compared, and where the pair came from (its line in the file, or its index in a built-in set)."""

    clean: tuple[int, ...]
    corrupt: tuple[int, ...]
    answer: int
    wrong: int
    position: int | None  # None: a classifier's logits, one row per prompt
    line: int


def single_piece(tokenizer, text: str) -> int | None:
    """The one piece ``text`` is, tokenized alone without special tokens; None where it is more or fewer, or the unknown piece."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 and ids[0] != tokenizer.unk_token_id else None  # [UNK] stands for any word, not this one


def pair_key(pair: EncodedPair) -> tuple:
    """What makes two pairs the same observation: both prompts' pieces, the answer and the wrong piece."""
    return pair.clean, pair.corrupt, pair.answer, pair.wrong


def read_position(tokenizer, kind, ids: list[int]) -> int | str:
    """The position whose logits the metric reads: the last (a decoder), or the one mask of ``ids`` (an encoder); else the
    reason it has none."""
    if kind is DECODER:
        return len(ids) - 1
    masks = [i for i, piece in enumerate(ids) if piece == tokenizer.mask_token_id]
    if tokenizer.mask_token_id is None or len(masks) != 1:
        return f"the clean prompt must hold exactly one {tokenizer.mask_token or 'mask token'} (it holds {len(masks)}) for a masked-LM head"
    return masks[0]


def _label_pieces(fields: dict, labels: tuple[str, ...]) -> dict | str:
    """A classifier's ``answer`` and ``wrong``: the indices of two of its ``labels``, or the reason they are not."""
    for name in ("answer", "wrong"):
        if fields[name] not in labels:
            return f"{name} {fields[name]!r} is not one of the classifier's labels ({', '.join(labels)})"
    return {name: labels.index(fields[name]) for name in ("answer", "wrong")}


def _vocabulary_pieces(tokenizer, fields: dict) -> dict | str:
    """A language model's ``answer`` and ``wrong``: one piece each, or the reason they are not."""
    pieces = {}
    for name in ("answer", "wrong"):
        pieces[name] = single_piece(tokenizer, fields[name])
        if pieces[name] is None:
            count = len(tokenizer(fields[name], add_special_tokens=False)["input_ids"])
            unknown = count == 1 and tokenizer(fields[name], add_special_tokens=False)["input_ids"][0] == tokenizer.unk_token_id
            return (f"{name} {fields[name]!r} is not in the tokenizer's vocabulary (it is the unknown piece)" if unknown
                    else f"{name} {fields[name]!r} must be one piece of the tokenizer (tokenized alone it is {count})")
    return pieces


def encode_pair(tokenizer, kind, fields: dict, line: int, labels: tuple[str, ...] | None = None) -> EncodedPair | str:
    """``fields`` (clean, corrupt, answer, wrong) encoded, or the reason they cannot be; ``labels``: a classifier's."""
    clean, corrupt = tokenizer(fields["clean"])["input_ids"], tokenizer(fields["corrupt"])["input_ids"]
    if len(clean) != len(corrupt):
        return f"clean and corrupt must tokenize to the same number of pieces ({len(clean)} and {len(corrupt)})"
    if clean == corrupt:
        return "clean and corrupt are the same pieces: a pair needs a difference to patch"
    pieces = _vocabulary_pieces(tokenizer, fields) if labels is None else _label_pieces(fields, labels)
    if isinstance(pieces, str):
        return pieces
    if pieces["answer"] == pieces["wrong"]:
        return f"answer and wrong are the same {'piece' if labels is None else 'label'} ({fields['answer']!r}, {fields['wrong']!r})"
    position = read_position(tokenizer, kind, clean) if labels is None else None
    if isinstance(position, str):
        return position
    return EncodedPair(tuple(clean), tuple(corrupt), pieces["answer"], pieces["wrong"], position, line)


def _fields(text: str, path: Path, number: int) -> dict:
    """One line's fields, checked: a JSON object with the four keys, each a string."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise CorpusError(path, number, f"not a JSON object ({error.msg} at column {error.colno})") from None
    if not isinstance(fields, dict):
        raise CorpusError(path, number, "not a JSON object")
    missing = [key for key in PAIR_KEYS if not isinstance(fields.get(key), str)]
    if missing:
        raise CorpusError(path, number, f"needs {', '.join(PAIR_KEYS)} as strings; {', '.join(missing)} missing or not a string")
    return fields


def read_pairs(path: str | Path, tokenizer, kind, labels: tuple[str, ...] | None = None) -> list[EncodedPair]:
    """Every pair of the JSON-lines file ``path`` (blank lines skipped), encoded (``labels``: a classifier's, which ``answer``
    and ``wrong`` name); the first bad line refused in one line naming it."""
    path = Path(path)
    if not path.is_file():
        raise BertologyError(f"{path}: no such pairs file")
    pairs, seen = [], {}
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            pair = encode_pair(tokenizer, kind, _fields(text, path, number), number, labels)
            if isinstance(pair, str):
                raise CorpusError(path, number, pair)
            if (key := pair_key(pair)) in seen:
                raise CorpusError(path, number, f"the same pair as line {seen[key]}: a repeated pair is not a new observation")
            seen[key] = number
            pairs.append(pair)
    if not pairs:
        raise CorpusError(path, None, "no pairs in the file")
    return pairs
