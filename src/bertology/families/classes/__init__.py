"""Attention to token classes (Kovaleva et al. 2019; docs/methods.md#token-classes).

``--class NAME=SPEC`` (API: ``classes=["NAME=SPEC", ...]``), SPEC one of ``upos:TAG``, ``deprel:RELATION`` (gold trees
or ``--parser spacy``), ``words:FILE`` (one word a line; ``words:negation`` is bundled) and ``regex:PATTERN``. Without
classes, the family measures nouns and verbs (where there are trees), negation words and punctuation.
Table: ``classes`` (``layer, head, class, row, value, ci_low, ci_high, n, baseline, ratio, uniform, excess, excess_ci_low,
excess_ci_high``). Figure: one layer x head
heat map per class.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from bertology.core.errors import BertologyError, CorpusError
from bertology.families import Family, FamilyResult, Option, register_family

#: Word lists bundled with bertology, for ``words:NAME`` when no file of that name exists.
BUNDLED_WORD_LISTS = ("negation",)


def read_word_list(where: str) -> frozenset[str]:
    """The casefolded words of a word-list file (one a line; blank lines and lines starting with # are skipped)."""
    path = Path(where)
    if not path.exists() and where in BUNDLED_WORD_LISTS:
        path = Path(str(resources.files("bertology") / "data" / f"{where}.txt"))
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise CorpusError(path, None, f"no such word list (a file, or one of the bundled lists: {', '.join(BUNDLED_WORD_LISTS)})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(path, None, f"cannot read the word list ({exc})") from None
    words = frozenset(line.strip().casefold() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not words:
        raise CorpusError(path, None, "the word list has no words")
    return words


def parse_class(text: str):
    """``NAME=KIND:VALUE`` -> :class:`~bertology.families.classes.analyzer.TokenClass`; one line for a malformed one."""
    from bertology.families.classes.analyzer import CLASS_KINDS, TokenClass

    if not isinstance(text, str):
        if isinstance(text, TokenClass):
            return text
        raise BertologyError(f"a class is a text NAME=KIND:VALUE, not {text!r}")
    name, equals, spec = text.partition("=")
    kind, colon, value = spec.partition(":")
    name, kind = name.strip(), kind.strip()
    if not equals or not colon or not name or not value:
        raise BertologyError(f"--class {text!r}: write NAME=KIND:VALUE, KIND one of {', '.join(CLASS_KINDS)} (e.g. noun=upos:NOUN)")
    if kind not in CLASS_KINDS:
        raise BertologyError(f"--class {text!r}: unknown kind {kind!r}; choose one of {', '.join(CLASS_KINDS)}")
    if kind == "regex":
        try:
            re.compile(value)
        except re.error as exc:
            raise BertologyError(f"--class {text!r}: not a regular expression ({exc})") from None
    return TokenClass(name, kind, value, read_word_list(value) if kind == "words" else frozenset())


def parse_classes(texts) -> tuple:
    """Several ``--class`` values (or one text) -> a tuple of classes with distinct names."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    classes = tuple(parse_class(text) for text in texts)
    names = [token_class.name for token_class in classes]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise BertologyError(f"--class: the name {repeated[0]!r} is given twice")
    return classes


def default_classes(with_trees: bool) -> tuple:
    """Nouns and verbs (UPOS, where there are trees), negation words (the bundled list) and punctuation."""
    specs = (["noun=upos:NOUN", "verb=upos:VERB"] if with_trees else []) + ["negation=words:negation", r"punctuation=regex:[^\w\s]+"]
    return parse_classes(specs)


class Classes(Family):
    name = "classes"
    title = "Attention to token classes (UPOS tags, relations, word lists, patterns) against each class's share of words (Kovaleva et al. 2019)."
    default = False
    options = (
        Option("classes", None, "A class of words, NAME=SPEC: upos:TAG or deprel:RELATION (trees: CoNLL-U or --parser spacy), "
               "words:FILE (one word a line; 'negation' is bundled) or regex:PATTERN (matches the whole word) "
               "[default: nouns and verbs where there are trees, negation words, punctuation].",
               parse=parse_classes, multiple=True, flag="--class", reads_files=True),
    )
    outputs = ("classes",)

    def prepare(self, settings):
        with_trees = settings["parser"] is not None
        classes = default_classes(with_trees) if settings["classes"] in (None, (), []) else parse_classes(settings["classes"])
        for token_class in classes:
            if token_class.needs_trees and not with_trees:
                raise BertologyError(f"--class {token_class.spec} needs dependency trees: give a CoNLL-U corpus or --parser spacy")
        settings["classes"] = classes

    def analyzers(self, settings, kind):
        from bertology.families.classes.analyzer import ClassAttention

        return {"classes": ClassAttention(kind, settings["classes"])}

    def finish(self, analyzers, context):
        import numpy as np

        analyzer, least = analyzers["classes"], context.settings["min_sample"]
        for name, count in analyzer.occurrences().items():
            if count == 0:
                context.warnings.append(f"class {name!r} never occurs in {context.corpus['name']}: its rows are empty")
            elif count < least:
                context.warnings.append(f"class {name!r} occurs in {count} sequences of {context.corpus['name']}, fewer than --min-sample "
                                        f"{least}: its intervals are left empty and no head is named for it")
        table = analyzer.result()
        table.loc[table.n < least, ["ci_low", "ci_high", "excess_ci_low", "excess_ci_high"]] = np.nan  # no interval, and no claim, on too little data
        return FamilyResult(tables={"classes": table})

    def section(self, folder, result, settings):
        from bertology.core.model.kinds import kind_named
        from bertology.families.classes.report import classes_section

        return classes_section(folder, result.tables["classes"], settings["classes"], kind_named(settings["kind"]))

    def summary(self, result):
        from bertology.families.classes.report import top_heads

        table = result.tables["classes"]
        top = top_heads(table, 3)
        lines = [f"most attention to {name} beyond a uniform head: " + ", ".join(
                     f"{int(r.layer)}-{int(r.head)} ({r.value:.2f} vs uniform {r.uniform:.2f}, {r.ratio:.1f}x its share {r.baseline:.2f})"
                     for r in rows.itertuples())
                 for name, rows in top.groupby("class", sort=False)]
        measured = table[table.ci_low.notna()]["class"].unique()
        lines += [f"no head gives {name} more attention than a uniform head" for name in measured if name not in set(top["class"])]
        return lines

    def claims(self, result):
        """The heads named for a class: the most attention to it beyond the uniform head's, its excess's interval above 0."""
        from bertology.families.classes.report import top_heads
        from bertology.families.summaries import by_view

        return [f"{prefix}{row._1}: {int(row.layer)}-{int(row.head)} {row.value:.3f} vs uniform {row.uniform:.3f}"
                for prefix, table in by_view(result.tables["classes"]) for row in top_heads(table, 3).itertuples()]

    def overview(self, result):
        from bertology.families.classes.report import top_heads

        return top_heads(result.tables["classes"], 3)

    def by_layer(self, result):
        table = result.tables["classes"]
        rows = table[table.row == "all"].groupby(["class", "layer"], sort=False).value.mean().reset_index()
        return rows.assign(quantity="attention to " + rows["class"])[["quantity", "layer", "value"]]


register_family(Classes())
