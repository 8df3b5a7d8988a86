"""Context mixing with the residual and the layer norm (Kobayashi et al. 2021; docs/methods.md#norms-and-mixing).

Table: ``mixing`` (``layer, ratio, value, ci_low, ci_high, n``): per layer, the mean share of each token's new
vector that comes from the other tokens, by the attention alone (``attn``), with the residual
(``attn_res``) and with the residual and the layer norm (``attn_res_ln``), and with ``--contributions`` by ALTI and value
zeroing (and their rollouts). Figure: each by layer. On a decoder (pre-norm) only the contribution measures have a meaning:
the family runs there with ``--contributions`` alone.
"""

from __future__ import annotations

from bertology.families import Family, FamilyResult, Option, register_family

#: The kinds of model whose blocks take the residual and the layer norm after attention (post-norm), where Kobayashi et
#: al.'s ratios have their meaning; a decoder normalises before attention (pre-norm): there only the contribution measures.
RATIO_KINDS = frozenset({"encoder"})


def parse_measures(text: str | None) -> tuple[str, ...]:
    """``--contributions``: :func:`bertology.core.measures.contributions.parse_measures`, imported when called (``--help`` loads no torch)."""
    from bertology.core.measures.contributions import parse_measures as parse

    return parse(text)


class Mixing(Family):
    name = "mixing"
    title = "How much each token mixes in from the others, with the residual and the layer norm (Kobayashi et al. 2021)."
    outputs = ("mixing",)
    weighted = False
    needs_blocks = True
    options = (
        Option("contributions", None, "Also the share of each token's representation from the other tokens by alti (Ferrando et al. 2022) "
               "and value-zeroing (Mohebbi et al. 2023), comma-separated; value zeroing reruns each layer once per token.", parse=parse_measures),
    )
    unfit = ("its ratios take the residual and the layer norm after attention (a post-norm block); a decoder normalises "
             "before attention (pre-norm), where they have no such meaning; with --contributions it reports ALTI's and value "
             "zeroing's shares alone")

    def fits(self, kind, settings=None):
        """Wherever Kobayashi's ratios have a meaning (:data:`RATIO_KINDS`: an encoder); elsewhere (a decoder) only with
        ``contributions``, ALTI's and value zeroing's shares alone."""
        return None if kind.name in RATIO_KINDS or (settings or {}).get("contributions") else self.unfit

    def analyzers(self, settings, kind):
        from bertology.families.mixing.analyzer import ContextMixing

        measures = settings["contributions"]
        measures = parse_measures(measures) if isinstance(measures, str) or measures is None else tuple(measures)
        return {"mixing": ContextMixing(kind, measures)}

    def finish(self, analyzers, context):
        return FamilyResult(tables={"mixing": analyzers["mixing"].result()})

    def section(self, folder, result, settings):
        from bertology.core.model.kinds import kind_named
        from bertology.families.mixing.report import mixing_section

        return mixing_section(folder, result.tables["mixing"], kind_named(settings["kind"]))

    def summary(self, result):
        """One line: each mixing ratio from the first layer to the last (with the highest and lowest layers between)."""
        from bertology.families.summaries import by_view, trend

        names = {"attn": "by attention alone", "attn_res": "with the residual", "attn_res_ln": "with the residual and layer norm",
                 "alti": "by ALTI", "value_zeroing": "by value zeroing", "alti_rollout": "by ALTI rolled out",
                 "value_zeroing_rollout": "by value zeroing rolled out"}
        lines = []
        for prefix, table in by_view(result.tables["mixing"]):
            if table.empty:
                continue
            parts = [f"{name} {trend(table[table.ratio == ratio].set_index('layer').value)}" for ratio, name in names.items() if (table.ratio == ratio).any()]
            source = "Kobayashi et al. 2021" if (table.ratio == "attn").any() else "a decoder: ALTI and value zeroing alone"
            lines.append(f"{prefix}context mixing, the share of a token's new vector from the other tokens ({source}): " + "; ".join(parts))
        return lines


register_family(Mixing())
