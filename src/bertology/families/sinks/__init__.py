"""Attention sinks of decoders (Xiao et al. 2024; Gu et al. 2025; Sun et al. 2024; docs/methods.md#decoders).

Tables: ``sinks`` (``layer, head, quantity, value, ci_low, ci_high, n``: per head the mean attention to the first token with
its interval, its norm-based share, and its key and value norms against the others'), ``sink_heads`` (the heads past eps),
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
        Option("sink_eps", 0.3, "A head is a sink head when its mean attention to the first token exceeds this (Gu et al. 2025: 0.3).",
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
        from bertology.families.sinks.analyzer import sink_rates

        sinks, eps, min_sample = analyzers["sinks"], context.settings["sink_eps"], context.settings["min_sample"]
        table = sinks.result()
        attention = table[table.quantity == "attention"]
        heads = attention[(attention.value > eps) & (attention.n >= min_sample)][["layer", "head", "value", "ci_low", "ci_high", "n"]]
        return FamilyResult(tables={
            "sinks": table,
            "sink_heads": heads.rename(columns={"value": "attention"}).sort_values("attention", ascending=False).reset_index(drop=True),
            "sink_rates": sink_rates(table, eps, min_sample),
            "secondary_sinks": sinks.secondary(context.engine.model.tokenizer, eps, min_sample),
            "massive_activations": sinks.activations(),
        })

    def section(self, folder, result, settings):
        from bertology.families.sinks.report import sinks_section

        tables = result.tables
        return sinks_section(folder, tables["sinks"], tables["sink_rates"], tables["secondary_sinks"], tables["massive_activations"],
                             settings["sink_eps"], settings["min_sample"])

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

    def overview(self, result):
        return result.tables["sink_rates"]

    def by_layer(self, result):
        rows = result.tables["sinks"]
        rows = rows[rows.quantity.isin(("attention", "norm_share"))].groupby(["quantity", "layer"], as_index=False).value.mean()
        names = {"attention": "attention to the first token (head mean)", "norm_share": "norm share of the first token (head mean)"}
        return rows.assign(quantity=rows.quantity.map(names))[["quantity", "layer", "value"]]


register_family(Sinks())
