"""Attention patterns (Kovaleva et al. 2019, "Revealing the Dark Secrets of BERT"; docs/methods.md#patterns).

Tables: ``patterns`` (``layer, head, pattern, share, n, majority``) and ``patterns_by_layer``; in
memory, ``pattern_examples`` (example maps per class) for the thumbnails. The rules classify by default;
``classifier=PATH`` (``--classifier``) uses a classifier trained on hand labels instead. On a ``labels`` corpus
(``bertology patterns --train LABELS.jsonl``) the family also trains one (:mod:`bertology.families.patterns.trained`):
tables ``pattern_training`` (F1 per class, trained and rules) and ``pattern_confusion``, and ``classifier.json``.
"""

from __future__ import annotations

import math
from pathlib import Path

from bertology.core.errors import BertologyError
from bertology.families import Family, FamilyResult, Option, register_family


def parse_thresholds(text: str):
    """``name=value,...`` -> :class:`~bertology.families.patterns.analyzer.PatternThresholds` (defaults for names not given)."""
    from dataclasses import fields

    from bertology.families.patterns.analyzer import PatternThresholds

    known = {f.name for f in fields(PatternThresholds)}
    values = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in known:
            raise BertologyError(f"--pattern-thresholds: unknown threshold {name!r} (known: {', '.join(sorted(known))})")
        try:
            values[name] = float(value)
        except ValueError:
            raise BertologyError(f"--pattern-thresholds: {name} needs a number, not {value!r}") from None
    return PatternThresholds(**values)


class Patterns(Family):
    name = "patterns"
    title = "Classify every head's maps as vertical, diagonal, vertical+diagonal, block or heterogeneous (Kovaleva et al. 2019)."
    corpus_flag = "--train"
    options = (
        Option("pattern_thresholds", None, "Pattern rule thresholds, e.g. 'vertical=0.5,diagonal=0.5,mixed_min=0.25,mixed_total=0.6,block=0.8'.",
               parse=parse_thresholds),
        Option("classifier", None, "A pattern classifier trained on hand labels (classifier.json from `bertology patterns --train`) instead of the rules.",
               type=Path),
    )
    outputs = ("patterns", "patterns_by_layer")
    optional_outputs = ("pattern_training", "pattern_confusion", "classifier")
    in_memory = ("pattern_examples",)

    def prepare(self, settings):
        from bertology.families.patterns.trained import TrainedClassifier

        if settings["classifier"] is not None:
            TrainedClassifier.load(settings["classifier"])  # a bad file is refused before the model loads

    def analyzers(self, settings, kind):
        from bertology.families.patterns.analyzer import HeadPatterns, PatternThresholds, RuleClassifier
        from bertology.families.patterns.trained import LabelledMaps, TrainedClassifier

        rules = RuleClassifier(settings["pattern_thresholds"] or PatternThresholds())
        classifier = TrainedClassifier.load(settings["classifier"]) if settings["classifier"] is not None else rules
        return {"patterns": HeadPatterns(classifier, seed=settings["seed"]), "labelled": LabelledMaps(rules)}

    def finish(self, analyzers, context):
        from bertology.families.patterns.trained import train_classifier

        patterns, labelled = analyzers["patterns"], analyzers["labelled"]
        result = FamilyResult(tables={"patterns": patterns.result(), "patterns_by_layer": patterns.by_layer()},
                              extras={"pattern_examples": patterns.examples()})
        if labelled.items:  # a labels corpus: learn the classes from the hand labels
            labelled.check()
            training, confusion, document = train_classifier([item for item in labelled.ordered()], seed=context.settings["seed"])
            result.tables.update(pattern_training=training, pattern_confusion=confusion)
            result.documents["classifier"] = {**document, "trained_on": context.corpus["name"]}
        return result

    def section(self, folder, result, settings):
        from dataclasses import asdict

        from bertology.core.model.kinds import kind_named
        from bertology.families.patterns.analyzer import PatternThresholds
        from bertology.families.patterns.report import patterns_section, training_section

        thresholds = asdict(settings["pattern_thresholds"] or PatternThresholds()) if settings["classifier"] is None else None
        section = patterns_section(folder, result.tables["patterns"], result.tables["patterns_by_layer"], result.extras["pattern_examples"], thresholds,
                                   kind_named(settings["kind"]))
        if settings["classifier"] is not None:
            section.notes.append(f"Classes from the trained classifier {settings['classifier']}, not the rules.")
        if "pattern_training" in result.tables:
            section.tables.append(training_section(folder, section, result.tables["pattern_training"], result.tables["pattern_confusion"]))
        return section

    def claims(self, result):
        """Each head whose majority class is a pattern (not heterogeneous): the rules compare every map with the uniform map of
        the same sequence, so a uniform head's majority is heterogeneous."""
        from bertology.families.summaries import by_view

        lines = []
        for prefix, table in by_view(result.tables["patterns"]):
            heads = table[(table.pattern == table.majority) & (table.majority != "heterogeneous") & (table.share > 0)]
            lines += [f"{prefix}{int(row.layer)}-{int(row.head)} {row.majority}: {row.share:.0%} of its maps" for row in heads.itertuples()]
        return lines

    def summary(self, result):
        """The share of all maps in each class, and how many heads have each class as their majority; with hand labels, the
        cross-validated F1 of the trained classifier beside the rules'."""
        from bertology.families.patterns.analyzer import PATTERNS
        from bertology.families.summaries import by_view

        lines = []
        for (prefix, shares), (_, heads) in zip(by_view(result.tables["patterns_by_layer"]), by_view(result.tables["patterns"])):
            overall = shares[shares.layer == -1].set_index("pattern").share
            majority = heads.drop_duplicates(["layer", "head"]).majority.value_counts()
            if overall.empty or majority.empty:
                continue
            lines.append(f"{prefix}pattern classes, share of all maps: " + ", ".join(f"{p} {overall[p]:.0%}" for p in PATTERNS if p in overall.index)
                         + f"; heads by majority class (of {int(majority.sum())}): " + ", ".join(f"{p} {majority[p]}" for p in PATTERNS if p in majority.index))
        if "pattern_training" not in result.tables:
            return lines
        table = result.tables["pattern_training"].set_index(["method", "class"]).f1
        trained = table.loc["trained"]
        classes = [c for c in trained.index if not c.startswith("macro") and not math.isnan(trained[c])]  # the classes with labels
        return lines + ["cross-validated F1 by class, trained (rules): "
                        + ", ".join(f"{c} {table['trained', c]:.2f} ({table['rules', c]:.2f})" for c in classes)
                        + "; classifier saved as classifier.json"]

    def by_layer(self, result):
        shares = result.tables["patterns_by_layer"]
        shares = shares[shares.layer >= 0]
        return shares.assign(quantity="share of maps: " + shares.pattern, value=shares.share)[["quantity", "layer", "value"]]


register_family(Patterns())
