"""The general head profile (Clark et al. 2019, "What Does BERT Look At?"; docs/methods.md#head-profile).

On a decoder the first token takes [CLS]'s place, and the metrics a causal map cannot have ([SEP], ``next``) are left
out (docs/methods.md#decoders).

Tables: ``heads`` (``layer, head, metric, value, ci_low, ci_high, n, uniform, excess, excess_ci_low, excess_ci_high``:
``uniform`` the layer's uniform head on the same sequences), ``layers`` (with ``uniform``), ``head_labels`` (heads past
Clark's thresholds and, but for ``broad``, above the uniform head), ``clark_thresholds`` (each threshold beside the largest value the corpus allows: the
mean entropy can be at most the mean of ln n), ``head_distance`` and ``head_map`` (Jensen-Shannon distances between
heads and their 2-D MDS map). Figures: attention to special tokens by layer, a heatmap per metric, the
head map.
"""

from __future__ import annotations

from bertology.core.errors import BertologyError
from bertology.families import Family, FamilyResult, Option, register_family

#: The most Jensen-Shannon terms (head pairs x rows x keys) the head distance computes on one sequence: a sequence whose
#: every pair of heads over every row fits it is compared exactly (Clark et al.'s distance); a longer one by the
#: approximation over sampled rows (:class:`~bertology.families.profile.analyzer.HeadDistance`). 2**28: every sequence of
#: up to 161 tokens on bert-base (144 heads), 324 on MiniLM (72 heads); about 1.5 s per sequence at one core's 200 M terms/s.
HEAD_DISTANCE_BUDGET = 2**28


class Profile(Family):
    name = "profile"
    title = "The general head profile: attention to [CLS], [SEP], punctuation and neighbours, entropy, distance (Clark et al. 2019)."
    options = (
        Option("head_distance_sample", 0.1, "Share of sequences used for the head-to-head JS distance.", minimum=0.0, maximum=1.0),
        Option("head_distance_budget", HEAD_DISTANCE_BUDGET, "Most JS terms (head pairs x rows x keys) the head distance computes exactly "
               "on one sequence; past it, an approximation over a keyed sample of the sequence's rows, named in head_distance.csv's "
               "method column (docs/methods.md#head-profile).", minimum=1),
    )
    outputs = ("heads", "layers", "head_labels", "clark_thresholds", "head_distance", "head_map")

    def prepare(self, settings):
        share = settings["head_distance_sample"]
        if not 0 < share <= 1:
            raise BertologyError(f"--head-distance-sample is the share of sequences the head distance reads: give more than 0 and at most 1, not {share}")

    def analyzers(self, settings, kind):
        from bertology.families.profile.analyzer import GeneralProfile, HeadDistance

        return {"profile": GeneralProfile(kind), "distance": HeadDistance(sample=settings["head_distance_sample"], seed=settings["seed"],
                                                                          budget=settings["head_distance_budget"])}

    def finish(self, analyzers, context):
        from bertology.families.profile.analyzer import clark_labels, clark_threshold_values, clark_thresholds

        profile = analyzers["profile"]
        heads = profile.result()
        thresholds = clark_threshold_values(profile.kind)
        result = FamilyResult(tables={"heads": heads, "layers": profile.layers(), "head_labels": clark_labels(heads, thresholds),
                                      "clark_thresholds": clark_thresholds(profile.entropy_ceiling(), thresholds)})
        try:
            result.tables.update(head_distance=analyzers["distance"].result(), head_map=analyzers["distance"].embedding())
        except ValueError as exc:  # no sequence was sampled
            context.warnings.append(str(exc))
        return result

    def section(self, folder, result, settings):
        from bertology.core.model.kinds import kind_named
        from bertology.families.profile.report import profile_section

        tables = result.tables
        return profile_section(folder, tables["heads"], tables["layers"], tables["head_labels"], tables["clark_thresholds"], tables.get("head_map"),
                               kind_named(settings["kind"]), settings["punct"], tables.get("head_distance"))

    def summary(self, result):
        from bertology.families.profile.analyzer import EXACT
        from bertology.families.profile.report import head_distance_approximation_note
        from bertology.families.summaries import by_view

        labels, thresholds = result.tables["head_labels"], result.tables["clark_thresholds"]
        lines = []
        groups = list(by_view(labels))
        if "weighting" in labels and "weighting" in thresholds:  # every view, also one without a labelled head
            groups = [(prefix, labels[labels.weighting == view]) for (prefix, _), view in zip(by_view(thresholds), dict.fromkeys(thresholds.weighting))]
        for prefix, rows in groups or [("", labels)]:
            counts = rows.label.value_counts()
            passed = ", ".join(f"{label} {counts[label]}" for label in counts.index) if len(counts) else "none"
            lines.append(f"{prefix}heads past Clark's thresholds: {passed}")
        # the corpus's ceiling is the same under every view: one line per label, not one per view
        for row in thresholds[~thresholds.reachable].drop_duplicates("label").itertuples():
            lines.append(f"no head can be '{row.label}' on this corpus: {row.metric} > {row.threshold:g} needs more than its largest "
                         f"possible mean, {row.corpus_max:.2f} (the mean of ln n over its sequences)")
        distance = result.tables.get("head_distance")
        if distance is not None and "method" in distance and (distance.method != EXACT).any():  # a run folder's table from before it had one
            lines.append(head_distance_approximation_note(distance))
        return lines

    def claims(self, result):
        """Clark's labels but ``broad`` (a uniform head's own mark): each one a head past its threshold and above the uniform head."""
        from bertology.families.summaries import by_view

        return [f"{prefix}{int(row.layer)}-{int(row.head)} {row.label}: {row.value:.3f} vs uniform {row.uniform:.3f}"
                for prefix, labels in by_view(result.tables["head_labels"]) for row in labels[labels.label != "broad"].itertuples()]

    def overview(self, result):
        return result.tables["layers"].pivot(index="layer", columns="metric", values="value")

    def by_layer(self, result):
        layers = result.tables["layers"]
        names = {"cls": "[CLS]", "sep": "[SEP]", "first": "the first token", "punct": "punctuation"}
        rows = layers[layers.metric.isin(names)]
        return rows.assign(quantity="attention to " + rows.metric.map(names))[["quantity", "layer", "value"]]


register_family(Profile())
