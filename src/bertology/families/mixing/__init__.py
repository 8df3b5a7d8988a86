"""Context mixing with the residual and the layer norm (Kobayashi et al. 2021; docs/methods.md#norms-and-mixing).

Table: ``mixing`` (``layer, ratio, value, ci_low, ci_high, n``): per layer, the mean share of each token's new
vector that comes from the other tokens, by the attention alone (``attn``), with the residual
(``attn_res``) and with the residual and the layer norm (``attn_res_ln``). Figure: the three by layer.
"""

from __future__ import annotations

from bertology.families import Family, FamilyResult, register_family


class Mixing(Family):
    name = "mixing"
    title = "How much each token mixes in from the others, with the residual and the layer norm (Kobayashi et al. 2021)."
    outputs = ("mixing",)
    weighted = False
    needs_blocks = True
    not_on_decoders = ("its ratios take the residual and the layer norm after attention (a post-norm block); a decoder normalises "
                       "before attention (pre-norm), where they have no such meaning")

    def analyzers(self, settings):
        from bertology.families.mixing.analyzer import ContextMixing

        return {"mixing": ContextMixing()}

    def finish(self, analyzers, context):
        return FamilyResult(tables={"mixing": analyzers["mixing"].result()})

    def section(self, folder, result, settings):
        from bertology.families.mixing.report import mixing_section

        return mixing_section(folder, result.tables["mixing"])

    def summary(self, result):
        """One line: each mixing ratio from the first layer to the last (with the highest and lowest layers between)."""
        from bertology.families.summaries import by_view, trend

        names = {"attn": "by attention alone", "attn_res": "with the residual", "attn_res_ln": "with the residual and layer norm"}
        lines = []
        for prefix, table in by_view(result.tables["mixing"]):
            if table.empty:
                continue
            parts = [f"{name} {trend(table[table.ratio == ratio].set_index('layer').value)}" for ratio, name in names.items()]
            lines.append(f"{prefix}context mixing, the share of a token's new vector from the other tokens (Kobayashi et al. 2021): " + "; ".join(parts))
        return lines


register_family(Mixing())
