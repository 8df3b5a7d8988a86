"""Attention sinks of decoders (Xiao et al. 2024; Gu et al. 2025; Sun et al. 2024; docs/methods.md#decoders).

Tables: ``sinks`` (``layer, head, quantity, value, ci_low, ci_high, n, uniform, excess, t_excess, p_excess``: per head the mean
attention to the first token with its interval, its norm-based share, and its key and value norms against the others'; beside
the first two, the uniform head's mean on the same sequences and the paired excess over it with its one-sided t-test),
``sink_heads`` (the heads past eps whose excess over the uniform head is significant, corrected over the heads),
``sink_rates`` (``Sink_eps`` per layer and overall), ``secondary_sinks`` (pieces at later positions that take more than eps)
and ``massive_activations`` (the largest hidden-state magnitude at position 0 against elsewhere, per layer). Figures: the
heads' attention to the first token (sinks marked), ``Sink_eps`` by layer, weight against norm share, massive activations.
"""

from __future__ import annotations

from bertology.families import Family, FamilyResult, Option, register_family


class Sinks(Family):
    name = "sinks"
    title = "Attention sinks: which heads of a decoder put their weight on the first token, in which layers, and what it gives (Gu et al. 2025)."
    options = (
        Option("sink_eps", 0.3, "A head is a sink head when its mean attention to the first token exceeds this (Gu et al. 2025: 0.3) and, "
               "significantly, the uniform head's on the same sequences.",
               minimum=0.0, maximum=1.0),
    )
    outputs = ("sinks", "sink_heads", "sink_rates", "secondary_sinks", "massive_activations")
    weighted = False
    kinds = frozenset({"decoder"})
    unfit = "it measures attention sinks, a decoder's (an encoder's [CLS] and [SEP] are in the profile)"

    def analyzers(self, settings, kind):
        from bertology.families.sinks.analyzer import AttentionSinks

        return {"sinks": AttentionSinks(kind)}

    def finish(self, analyzers, context):
        from bertology.families.sinks.analyzer import sink_mask, sink_rates

        sinks, eps, min_sample = analyzers["sinks"], context.settings["sink_eps"], context.settings["min_sample"]
        correction = context.settings.get("correction", "fdr_bh")
        table = sinks.result(min_sample)
        attention = table[table.quantity == "attention"]
        heads = attention[sink_mask(attention, eps, min_sample, correction)][["layer", "head", "value", "ci_low", "ci_high", "uniform", "excess",
                                                                              "p_excess", "n"]]
        return FamilyResult(tables={
            "sinks": table,
            "sink_heads": heads.rename(columns={"value": "attention"}).sort_values("attention", ascending=False).reset_index(drop=True),
            "sink_rates": sink_rates(table, eps, min_sample, correction),
            "secondary_sinks": sinks.secondary(context.engine.model.tokenizer, eps, min_sample),
            "massive_activations": sinks.activations(),
        })

    def section(self, folder, result, settings):
        from bertology.families.sinks.report import sinks_section

        tables = result.tables
        return sinks_section(folder, tables["sinks"], tables["sink_rates"], tables["secondary_sinks"], tables["massive_activations"],
                             settings["sink_eps"], settings["min_sample"], settings.get("correction", "fdr_bh"))

    def summary(self, result):
        rates = result.tables["sink_rates"]
        if rates.empty:
            return ["attention sinks: no sequence with a query after the first token, nothing to measure"]
        overall = rates[rates.layer == "all"].iloc[0]
        per_layer = ", ".join(f"{row.layer}: {row.rate:.0%}" for row in rates[rates.layer != "all"].itertuples())
        lines = [f"attention sinks (Gu et al. 2025): Sink_{overall.eps:g} = {overall.rate:.0%} of heads ({overall.sink_heads} of {overall.heads}); "
                 f"by layer {per_layer}"]
        secondary = result.tables["secondary_sinks"]
        if len(secondary):
            pieces = ", ".join(f"{piece!r}" for piece in list(dict.fromkeys(secondary.piece))[:5])
            lines.append(f"secondary sinks (pieces after the first that take more than {overall.eps:g}): {pieces}")
        return lines

    def claims(self, result):
        """Each sink head (mean attention to the first token past eps and significantly past the uniform head's) and each
        secondary sink (a later piece past eps and the uniform head's)."""
        heads, secondary = result.tables["sink_heads"], result.tables["secondary_sinks"]
        return ([f"{int(row.layer)}-{int(row.head)} sink head: {row.attention:.3f} vs uniform {row.uniform:.3f}" for row in heads.itertuples()]
                + [f"{int(row.layer)}-{int(row.head)} secondary sink {row.piece!r}: {row.attention:.3f}" for row in secondary.itertuples()])

    def overview(self, result):
        return result.tables["sink_rates"]

    def by_layer(self, result):
        rows = result.tables["sinks"]
        rows = rows[rows.quantity.isin(("attention", "norm_share"))].groupby(["quantity", "layer"], as_index=False).value.mean()
        names = {"attention": "attention to the first token (head mean)", "norm_share": "norm share of the first token (head mean)"}
        return rows.assign(quantity=rows.quantity.map(names))[["quantity", "layer", "value"]]


register_family(Sinks())
