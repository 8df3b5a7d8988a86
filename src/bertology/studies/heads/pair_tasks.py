"""The built-in pair sets of ``bertology patch --task``: ``ioi``, ``induction`` and ``agreement``.

Built offline from a few templates and the model's own single-piece words, ``n`` pairs drawn with a seed:

* ``ioi``, indirect object identification (Wang et al. 2022): "When Mary and John went to the store, John gave a drink
  to" -> " Mary" over " John"; the corrupted prompt names three different people ("... Alice and Bob ..., Carol gave ...",
  their ABC set), so that nothing in it points to the answer;
* ``induction``: ``k`` random pieces, then the same pieces again up to the last, whose successor in the first copy is the
  answer; the corrupted prompt changes that successor in the first copy, which becomes the wrong piece;
* ``agreement``, subject-verb number agreement across an attractor (Linzen et al. 2016): "The key to the cabinets" ->
  " is" over " are"; the corrupted prompt swaps the numbers of the subject and the attractor ("The keys to the cabinet").

On an encoder the answer slot is its mask token, read by the masked-LM head; ``induction`` is a decoder's.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from bertology.core.errors import BertologyError
from bertology.core.model.kinds import DECODER
from bertology.studies.heads.pairs import EncodedPair, encode_pair, pair_key, single_piece

TASKS = ("ioi", "induction", "agreement")
#: Pairs of a built-in set when ``--n`` is not given.
TASK_PAIRS = 100
NAMES = ("Mary", "John", "Alice", "Bob", "James", "Sarah", "David", "Anna", "Paul", "Kate", "Tom", "Lisa", "Mark", "Laura", "Peter", "Emma")
IOI_TEMPLATES = (
    "When {A} and {B} went to the store, {C} gave a drink to",
    "When {A} and {B} got a snack at the house, {C} decided to give it to",
    "Then, {A} and {B} had a long argument, and afterwards {C} said to",
)
#: Singular and plural nouns, and the verb pairs (singular, plural) of the agreement set.
NOUNS = (("key", "keys"), ("cabinet", "cabinets"), ("dog", "dogs"), ("author", "authors"), ("book", "books"), ("table", "tables"),
         ("picture", "pictures"), ("house", "houses"), ("boy", "boys"), ("girl", "girls"))
VERBS = (("is", "are"), ("was", "were"), ("has", "have"))
AGREEMENT_TEMPLATE = "The {subject} near the {attractor}"
#: Pieces in each copy of an induction prompt.
INDUCTION_LENGTH = 10


def _word(kind, word: str) -> str:
    """How ``word`` follows a space in a prompt: with its space for a decoder's byte-level pieces, bare for an encoder's."""
    return f" {word}" if kind is DECODER else word


def _single(tokenizer, kind, words) -> list:
    """The words (or tuples of words) of ``words`` whose every word is one piece where a prompt puts it."""
    return [w for w in words if all(single_piece(tokenizer, _word(kind, part)) is not None for part in ((w,) if isinstance(w, str) else w))]


def _finish(tokenizer, kind, prompt: str) -> str:
    """The prompt with its answer slot: nothing more for a decoder (the next piece), the mask token for an encoder."""
    return prompt if kind is DECODER else f"{prompt} {tokenizer.mask_token} ."


def _encoded(tokenizer, kind, fields: dict, index: int, task: str) -> EncodedPair:
    pair = encode_pair(tokenizer, kind, fields, index)
    if isinstance(pair, str):
        raise BertologyError(f"--task {task}: this tokenizer cannot build the set: {pair}")
    return pair


def ioi_pairs(tokenizer, kind, n: int, seed: int) -> list[EncodedPair]:
    names = _single(tokenizer, kind, NAMES)
    if len(names) < 5:
        raise BertologyError(f"--task ioi: the tokenizer has {len(names)} single-piece names of {', '.join(NAMES)}; it needs 5")
    rng = np.random.default_rng(seed)
    pairs = []
    for index in range(n):
        template = IOI_TEMPLATES[rng.integers(len(IOI_TEMPLATES))]
        a, b, c, d, e = (names[i] for i in rng.choice(len(names), size=5, replace=False))
        clean, corrupt = template.format(A=a, B=b, C=b), template.format(A=c, B=d, C=e)
        pairs.append(_encoded(tokenizer, kind, {"clean": _finish(tokenizer, kind, clean), "corrupt": _finish(tokenizer, kind, corrupt),
                                                "answer": _word(kind, a), "wrong": _word(kind, b)}, index, "ioi"))
    return pairs


def agreement_pairs(tokenizer, kind, n: int, seed: int) -> list[EncodedPair]:
    nouns, verbs = _single(tokenizer, kind, NOUNS), _single(tokenizer, kind, VERBS)
    if len(nouns) < 2 or not verbs:
        raise BertologyError(f"--task agreement: the tokenizer has {len(nouns)} single-piece noun pairs (needs 2) and {len(verbs)} verb pairs (needs 1)")
    rng = np.random.default_rng(seed)
    pairs = []
    for index in range(n):
        (subject, subjects), (attractor, attractors) = (nouns[i] for i in rng.choice(len(nouns), size=2, replace=False))
        singular, plural = verbs[rng.integers(len(verbs))]
        clean = AGREEMENT_TEMPLATE.format(subject=subject, attractor=attractors)
        corrupt = AGREEMENT_TEMPLATE.format(subject=subjects, attractor=attractor)
        pairs.append(_encoded(tokenizer, kind, {"clean": _finish(tokenizer, kind, clean), "corrupt": _finish(tokenizer, kind, corrupt),
                                                "answer": _word(kind, singular), "wrong": _word(kind, plural)}, index, "agreement"))
    return pairs


def induction_pairs(tokenizer, kind, n: int, seed: int) -> list[EncodedPair]:
    if kind is not DECODER:
        raise BertologyError("--task induction predicts the next piece: it needs a decoder (a causal language model)")
    special = set(tokenizer.all_special_ids)
    pieces = np.array([i for i in range(len(tokenizer)) if i not in special])
    if len(pieces) < INDUCTION_LENGTH + 1:
        raise BertologyError(f"--task induction: the tokenizer has {len(pieces)} ordinary pieces; it needs {INDUCTION_LENGTH + 1}")
    start = tuple(tokenizer("")["input_ids"])  # BOS where the tokenizer adds it (Llama's)
    rng = np.random.default_rng(seed)
    pairs = []
    for index in range(n):
        drawn = rng.choice(pieces, size=INDUCTION_LENGTH + 1, replace=False).tolist()
        first, other = drawn[:INDUCTION_LENGTH], drawn[INDUCTION_LENGTH]
        cut = int(rng.integers(INDUCTION_LENGTH // 2, INDUCTION_LENGTH))  # the answer is first[cut]: the second copy stops before it
        corrupted = [*first[:cut], other, *first[cut + 1:]]
        second = first[:cut]
        clean, corrupt = (*start, *first, *second), (*start, *corrupted, *second)
        pairs.append(EncodedPair(clean, corrupt, first[cut], other, len(clean) - 1, index))
    return pairs


#: How many pairs are drawn for each one asked for, so that ``n`` distinct ones are found among them.
DRAWS_PER_PAIR = 20


def task_pairs(task: str, tokenizer, kind, n: int, seed: int) -> list[EncodedPair]:
    """``n`` distinct pairs of the built-in set ``task`` (:data:`TASKS`), seeded: the first ``n`` of a seeded stream of draws
    that differ (a repeated pair is not a new observation); a set too small for ``n`` is refused in one line."""
    builders = {"ioi": ioi_pairs, "induction": induction_pairs, "agreement": agreement_pairs}
    if task not in builders:
        raise BertologyError(f"unknown --task {task!r}; use {', '.join(TASKS)}")
    distinct: dict[tuple, EncodedPair] = {}
    for pair in builders[task](tokenizer, kind, DRAWS_PER_PAIR * n, seed):
        distinct.setdefault(pair_key(pair), replace(pair, line=len(distinct)))
        if len(distinct) == n:
            return list(distinct.values())
    raise BertologyError(f"--task {task}: this tokenizer makes {len(distinct)} distinct pairs of the set; give --n {len(distinct)} or fewer")
