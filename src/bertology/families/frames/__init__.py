"""Frame-semantic heads (Kovaleva et al. 2019, section 4.3; docs/methods.md#frame-heads).

Reads a frame-annotated corpus (the ``frames`` format: JSON lines ``{"text", "frame", "target": [start, end],
"elements": {"Name": [start, end], ...}}``; ``bertology frames --frames FILE.jsonl``). Table: ``frames`` (``layer,
head, score, ci_low, ci_high, baseline, difference, uniform, excess, t, p, p_adj, significant, n, pairs``; the test is on
``excess``, the difference less the uniform head's). Figure: score and score minus baseline per head, and the top heads.
"""

from __future__ import annotations

from bertology.families import Family, FamilyResult, Option, register_family


def corrected(table, correction: str, alpha: float = 0.05):
    """``p_adj`` and ``significant`` for the heads that could be tested, corrected over them (:func:`bertology.core.statistics.stats.corrected`)."""
    from bertology.core.statistics.stats import corrected as correct

    p_adj, significant = correct(table.p, correction, alpha)
    table = table.assign(p_adj=p_adj, significant=significant)
    columns = ["layer", "head", "score", "ci_low", "ci_high", "baseline", "difference", "uniform", "excess", "t", "p", "p_adj", "significant",
               "n", "pairs"]
    return table[columns]


class Frames(Family):
    name = "frames"
    title = "Frame-semantic heads: the strongest attention between a frame's target and its core elements, against random pairs (Kovaleva et al. 2019)."
    needs_frames = True
    corpus_flag = "--frames"
    options = (Option("frame_top", 10, "Heads listed in the report, by score.", minimum=1),)
    outputs = ("frames",)

    def analyzers(self, settings, kind):
        from bertology.families.frames.analyzer import FrameHeads

        return {"frames": FrameHeads(seed=settings["seed"])}

    def finish(self, analyzers, context):
        analyzer = analyzers["frames"]
        if analyzer.pairs == 0:
            context.warnings.append(f"no (target, element) pair of {context.corpus['name']} kept its pieces: the frames table is empty")
        elif analyzer.matched < analyzer.pairs:
            context.warnings.append(f"{analyzer.pairs - analyzer.matched} of {analyzer.pairs} frame pairs have no random baseline "
                                    "(no shift keeps them inside their sentence)")
        return FamilyResult(tables={"frames": corrected(analyzer.result(context.settings["min_sample"]), context.settings["correction"])})

    def section(self, folder, result, settings):
        from bertology.families.frames.report import frames_section

        return frames_section(folder, result.tables["frames"], settings["frame_top"], settings["min_sample"])

    def summary(self, result):
        table = result.tables["frames"]
        if table.empty:
            return []
        def heads(rows):
            return ", ".join(f"{int(r.layer)}-{int(r.head)} ({r.score:.2f} vs {r.baseline:.2f})" for r in rows.itertuples())

        by_score = table.sort_values("score", ascending=False, kind="stable").head(3)
        by_excess = table.sort_values("difference", ascending=False, kind="stable").head(3)
        tested = int(table.p.notna().sum())
        if not tested:
            return [f"frame scores not tested (matched pairs in {int(table.n.max())} sentences, fewer than --min-sample): no frame head is named"]
        return [f"frame heads by score (vs random pairs): {heads(by_score)}; by excess over random pairs: {heads(by_excess)}; "
                f"{int(table.significant.sum())} of {tested} tested heads above random pairs, beyond what a uniform head gets, after correction"]

    def claims(self, result):
        """The frame heads: above position-matched random pairs beyond the uniform head's difference, after correction."""
        table = result.tables["frames"]
        return [f"{int(r.layer)}-{int(r.head)} frame head: score {r.score:.3f} vs random pairs {r.baseline:.3f} (uniform head {r.uniform:.3f}), "
                f"p_adj {r.p_adj:.2g}" for r in table[table.significant.astype(bool)].itertuples()]

    def overview(self, result):
        return result.tables["frames"].sort_values("score", ascending=False, kind="stable").head(10)

    def by_layer(self, result):
        table = result.tables["frames"]
        rows = table.groupby("layer", sort=True).score.max().reset_index()
        return rows.assign(quantity="best frame score of the layer")[["quantity", "layer", "score"]].rename(columns={"score": "value"})


register_family(Frames())
