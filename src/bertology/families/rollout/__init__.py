"""Attention rollout (Abnar & Zuidema 2020; METHODS.md section 7).

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

    def analyzers(self, settings):
        from bertology.families.rollout.analyzer import AttentionRollout

        return {"rollout": AttentionRollout()}

    def finish(self, analyzers, context):
        return FamilyResult(tables={"rollout": analyzers["rollout"].result()})

    def section(self, folder, result, settings):
        from bertology.families.rollout.report import rollout_section

        return rollout_section(folder, result.tables["rollout"])

    def by_layer(self, result):
        table = result.tables["rollout"]
        rows = table[(table.row == "cls_row") & (table.target != "self")]  # the [CLS] row's own token is [CLS]
        names = {"cls": "[CLS]", "sep": "[SEP]", "punct": "punctuation"}
        return rows.assign(quantity="[CLS] row rolled out to " + rows.target.map(names))[["quantity", "layer", "value"]]


register_family(Rollout())
