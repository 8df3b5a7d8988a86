"""Syntactic heads and the attention parsing probe (Clark et al. 2019, section 4).

See docs/methods.md#syntactic-heads-and-the-parsing-probe.

Needs dependency trees (CoNLL-U, or ``parser="spacy"``). Tables: ``syntax`` (``relation, direction,
layer, head, accuracy, n, uniform``), ``syntax_best`` (one row per relation), ``syntax_baselines`` (``relation, direction,
offset, accuracy, n``); document
``probe`` (``probe.json``: UAS of the parsing probe and its baselines, the uniform head's probe among them, and each
variant's ``verdict`` against them).
"""

from __future__ import annotations

from pathlib import Path

from bertology.core.errors import BertologyError
from bertology.families import Family, FamilyResult, Option, register_family


class Syntax(Family):
    name = "syntax"
    title = "Syntactic heads per relation with baselines and significance, and the attention parsing probe (Clark et al. 2019)."
    needs_trees = True
    options = (
        Option("bootstrap", 1000, "Bootstrap replicates over sentences.", minimum=100),
        Option("min_dependents", 25, "Flag relations with fewer dependents.", minimum=1),
        Option("heatmap_relation", "all", "Relation drawn as a layer x head heatmap."),
        Option("probe", True, "Train and evaluate the attention parsing probe.", flag="--probe/--no-probe"),
        Option("probe_test", None, "CoNLL-U file to test the probe on [default: k-fold within the corpus].", type=Path),
        Option("probe_folds", 5, "Folds of the probe's cross-validation.", minimum=2),
        Option("probe_epochs", 20, "Training epochs of the probe.", minimum=1),
    )
    outputs = ("syntax", "syntax_best", "syntax_baselines", "probe")

    def _test_corpus(self, settings):
        from bertology.core.text.corpora import Corpus

        return Corpus(Path(settings["probe_test"]), format="conllu") if settings["probe_test"] is not None else None

    def prepare(self, settings):
        test_corpus = self._test_corpus(settings)
        if test_corpus is not None:
            test_corpus.validate()

    def analyzers(self, settings, kind):
        from bertology.families.syntax.analyzer import RelationHeads
        from bertology.families.syntax.probes import ProbeData

        analyzers = {"relations": RelationHeads(kind, bootstrap=settings["bootstrap"], seed=settings["seed"])}
        if settings["probe"]:
            analyzers["probe"] = ProbeData()
        return analyzers

    def finish(self, analyzers, context):
        from tqdm.auto import tqdm

        from bertology.families.syntax.probes import PROBES, ProbeData, cross_validate, evaluate

        settings, relations = context.settings, analyzers["relations"]
        syntax = relations.result()
        if syntax.empty:
            raise BertologyError("no sentence had a dependency tree with a scorable dependent")
        result = FamilyResult(tables={
            "syntax": syntax,
            "syntax_best": relations.best(min_dependents=settings["min_dependents"], correction=settings["correction"]),
            "syntax_baselines": relations.baselines(),
        })
        if "probe" not in analyzers:
            return result
        sentences, folds, epochs, seed = analyzers["probe"].ordered(), settings["probe_folds"], settings["probe_epochs"], settings["seed"]
        testing = dict(bootstrap=settings["bootstrap"], correction=settings["correction"], min_sample=settings["min_sample"])
        test_corpus = self._test_corpus(settings)
        if test_corpus is not None:
            test_data = ProbeData()
            context.engine.run(test_corpus, [test_data], weightings=[context.weighting])
            with tqdm(total=len(PROBES), unit="probe", desc="parsing probe", disable=not context.progress) as bar:
                probe = evaluate(sentences, test_data.ordered(), epochs=epochs, seed=seed, bar=bar, **testing)
            result.documents["probe"] = {"evaluation": f"trained on {context.corpus['name']}, tested on {test_corpus.name}", **probe}
        elif len(sentences) >= 2 * folds:
            result.documents["probe"] = cross_validate(sentences, folds=folds, epochs=epochs, seed=seed, progress=context.progress, **testing)
        else:
            context.warnings.append(f"parsing probe skipped: {len(sentences)} sentences are too few for {folds}-fold cross-validation")
        return result

    def section(self, folder, result, settings):
        from bertology.families.syntax.report import syntax_section

        return syntax_section(folder, result.tables["syntax"], result.tables["syntax_best"], result.documents.get("probe"),
                              settings["heatmap_relation"], settings["min_dependents"])

    #: Relations the summary names: ``all`` and the most frequent tested ones, up to this many in all.
    SUMMARY_RELATIONS = 5

    def summary(self, result):
        """How many tested relations have a head above the best offset baseline after correction; the best head of ``all``
        and of the most frequent tested relations, against the baseline; the parsing probe's UAS and each variant's verdict
        against the offset baselines and the uniform head's probe. A relation with fewer
        than ``--min-dependents`` dependents (``few``) is not tested and is not named."""
        from bertology.families.summaries import by_view

        lines = []
        for prefix, best in by_view(result.tables["syntax_best"]):
            few = best.few.astype(bool)
            tested = best[~few]  # all first, then by number of dependents
            untested = f"; {int(few.sum())} with fewer dependents than --min-dependents not tested" if few.any() else ""
            lines.append(f"{prefix}syntactic heads: {int(tested.significant.astype(bool).sum())} of {len(tested)} tested relations have a head "
                         f"above both the best offset baseline and the uniform head after correction{untested}")
            for row in tested.head(self.SUMMARY_RELATIONS).itertuples():
                ties = f", {int(row.n_ties)} heads tied" if row.n_ties > 1 else ""
                lines.append(f"{prefix}  {row.relation} ({int(row.n)} dependents): {int(row.layer)}-{int(row.head)} {row.direction} {row.accuracy:.3f} "
                             f"(95% CI {row.ci_low:.3f}-{row.ci_high:.3f}) vs offset {int(row.baseline_offset):+d} {row.baseline_accuracy:.3f}, "
                             f"uniform {row.uniform:.3f}, p_adj {row.p_adj:.2g}{ties}")
        for prefix, probe in probe_documents(result):
            lines.append(f"{prefix}parsing probe UAS ({probe['evaluation']}): " + ", ".join(f"{key} {value:.3f}" for key, value in probe["uas"].items()))
            lines.append(f"{prefix}  " + "; ".join(probe_verdict_line(variant, verdict) for variant, verdict in probe["verdict"].items()))
        return lines

    def claims(self, result):
        """Each tested relation whose best head beats both the best offset baseline and the uniform head after correction,
        and each parsing probe variant whose UAS beats both the best offset baseline and the uniform head's probe of the
        same variant (``verdict``, :func:`~bertology.families.syntax.probes.probe_verdicts`)."""
        from bertology.families.summaries import by_view

        heads = [f"{prefix}{row.relation}: {int(row.layer)}-{int(row.head)} {row.direction} {row.accuracy:.3f} vs offset {row.baseline_accuracy:.3f}, "
                 f"uniform {row.uniform:.3f} (p_adj {row.p_adj:.2g})"
                 for prefix, best in by_view(result.tables["syntax_best"]) for row in best[best.significant.astype(bool)].itertuples()]
        probes = [f"{prefix}{probe_verdict_line(variant, verdict)}" for prefix, probe in probe_documents(result)
                  for variant, verdict in probe["verdict"].items() if verdict["beats_baselines"]]
        return heads + probes

    def overview(self, result):
        return result.tables["syntax_best"].head(10)


def probe_documents(result):
    """``(prefix, document)`` of each parsing probe document (``probe``, or ``probe_<view>`` with its ``weighting``)."""
    from bertology.families.summaries import VIEW_NAMES

    for name, probe in result.documents.items():
        if name == "probe" or name.startswith("probe_"):
            yield (f"[{VIEW_NAMES.get(probe['weighting'], probe['weighting'])}] " if "weighting" in probe else ""), probe


def probe_verdict_line(variant: str, verdict: dict) -> str:
    """One variant's verdict: its UAS against the best of the offset baselines and its uniform probe, and the test's p_adj."""
    p_adj = "untested" if verdict["p_adj"] is None else f"p_adj {verdict['p_adj']:.2g}"
    outcome = "beats" if verdict["beats_baselines"] else "does not beat"
    return (f"parsing probe {variant} {verdict['uas']:.3f} {outcome} the offset baselines and the uniform probe (best: {verdict['reference']} "
            f"{verdict['reference_uas']:.3f}; {p_adj})")


register_family(Syntax())
