"""Attention rollout (Abnar & Zuidema 2020; docs/methods.md#rollout).

On a decoder the first token takes [CLS]'s place as a target, and the last token's row, the one that predicts, the [CLS]
row's (docs/methods.md#decoders).

Table: ``rollout`` (``layer, row, target, value, ci_low, ci_high, n``): after each layer, the rolled-out
attention to [CLS], [SEP], punctuation and the token itself, from every query (``row = all``) and from the
[CLS] row (``cls_row``). Figure: both by layer. Under ``weighting="norm"`` it rolls out the norm shares.
"""

from __future__ import annotations

from bertology.families import Family, FamilyResult, register_family


class Rollout(Family):
    name = "rollout"
    title = "Attention rollout: how much each input token reaches each position after every layer (Abnar & Zuidema 2020)."
    outputs = ("rollout",)

    def analyzers(self, settings, kind):
        from bertology.families.rollout.analyzer import AttentionRollout

        return {"rollout": AttentionRollout(kind)}

    def finish(self, analyzers, context):
        return FamilyResult(tables={"rollout": analyzers["rollout"].result()})

    def section(self, folder, result, settings):
        from bertology.core.model.kinds import kind_named
        from bertology.families.rollout.report import rollout_section

        return rollout_section(folder, result.tables["rollout"], kind_named(settings["kind"]))

    def summary(self, result):
        """One line per view: the rolled-out attention of every query to itself, [CLS], [SEP] and punctuation, from the
        first layer to the last (with the highest and lowest layers where they lie between)."""
        from bertology.families.summaries import by_view, trend

        names = {"self": "itself", "cls": "[CLS]", "sep": "[SEP]", "first": "the first token", "punct": "punctuation"}
        lines = []
        for prefix, table in by_view(result.tables["rollout"]):
            rows = table[table.row == "all"]
            if rows.empty:
                continue
            parts = [f"to {name} {trend(rows[rows.target == target].set_index('layer').value)}" for target, name in names.items()
                     if (rows.target == target).any()]
            lines.append(f"{prefix}attention rollout from every query (Abnar & Zuidema 2020): " + "; ".join(parts))
        return lines

    def by_layer(self, result):
        """The one position's row (the [CLS] row, a decoder's last row) to every target but the token itself (the [CLS] row's
        own token is [CLS]), by layer."""
        table = result.tables["rollout"]
        rows = table[(table.row != "all") & (table.target != "self")]
        names = {"cls": "[CLS]", "sep": "[SEP]", "first": "the first token", "punct": "punctuation"}
        return rows.assign(quantity=rows.row.map({"cls_row": "[CLS] row", "last_row": "last row"}) + " rolled out to "
                           + rows.target.map(names))[["quantity", "layer", "value"]]


register_family(Rollout())
