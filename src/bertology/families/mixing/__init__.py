"""Context mixing with the residual and the layer norm (Kobayashi et al. 2021; METHODS.md section 7).

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

    def analyzers(self, settings):
        from bertology.families.mixing.analyzer import ContextMixing

        return {"mixing": ContextMixing()}

    def finish(self, analyzers, context):
        return FamilyResult(tables={"mixing": analyzers["mixing"].result()})

    def section(self, folder, result, settings):
        from bertology.families.mixing.report import mixing_section

        return mixing_section(folder, result.tables["mixing"])

    def summary(self, result):
        table = result.tables["mixing"]
        final = table[table.ratio == "attn_res_ln"].set_index("layer").value
        return [f"context mixing with residual and layer norm: {final.min():.2f}-{final.max():.2f} by layer (Kobayashi et al. 2021)"]


register_family(Mixing())
