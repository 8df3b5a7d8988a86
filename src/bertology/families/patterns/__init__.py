"""Attention patterns (Kovaleva et al. 2019, "Revealing the Dark Secrets of BERT"; METHODS.md section 4).

Tables: ``patterns`` (``layer, head, pattern, share, n, majority``) and ``patterns_by_layer``; in
memory, ``pattern_examples`` (example maps per class) for the thumbnails.
"""

from __future__ import annotations

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
    options = (
        Option("pattern_thresholds", None, "Pattern rule thresholds, e.g. 'vertical=0.5,diagonal=0.5,mixed_min=0.25,mixed_total=0.6,block=0.8'.",
               parse=parse_thresholds),
    )
    outputs = ("patterns", "patterns_by_layer", "pattern_examples")

    def analyzers(self, settings):
        from bertology.families.patterns.analyzer import HeadPatterns, PatternThresholds, RuleClassifier

        return {"patterns": HeadPatterns(RuleClassifier(settings["pattern_thresholds"] or PatternThresholds()), seed=settings["seed"])}

    def finish(self, analyzers, context):
        patterns = analyzers["patterns"]
        return FamilyResult(tables={"patterns": patterns.result(), "patterns_by_layer": patterns.by_layer()},
                            extras={"pattern_examples": patterns.examples()})

    def section(self, folder, result, settings):
        from dataclasses import asdict

        from bertology.families.patterns.analyzer import PatternThresholds
        from bertology.families.patterns.report import patterns_section

        thresholds = asdict(settings["pattern_thresholds"] or PatternThresholds())
        return patterns_section(folder, result.tables["patterns"], result.tables["patterns_by_layer"], result.extras["pattern_examples"], thresholds)

    def by_layer(self, result):
        shares = result.tables["patterns_by_layer"]
        shares = shares[shares.layer >= 0]
        return shares.assign(quantity="share of maps: " + shares.pattern, value=shares.share)[["quantity", "layer", "value"]]


register_family(Patterns())
