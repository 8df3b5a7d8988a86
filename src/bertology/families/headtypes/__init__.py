"""Decoder head types: previous-token, duplicate-token and induction heads (Elhage et al. 2021; Olsson et al. 2022;
docs/methods.md#decoder-head-types).

Tables: ``head_types`` (``layer, head, role, value, ci_low, ci_high, n, uniform, excess, t_excess, p_excess, p_adj, holds``: per
head and role the mean attention mass on the role's targets over the rows that have one, the uniform head's on the same
sequences, the paired excess and its one-sided t-test, corrected within the role; a head holds the role where the corrected
test rejects and the mean is at least ``--head-type-mass``) and ``head_type_heads`` (the heads that hold a role, strongest
first). On an encoder, duplicate-token alone. Olsson et al.'s prefix-matching score is the induction score of a run on
``--synthetic-repeats``, over each sequence's second copy.
"""

from __future__ import annotations

from bertology.families import Family, FamilyResult, Option, register_family

#: A head holds a role when its mean attention mass on the role's targets is at least this (``--head-type-mass``).
HEAD_TYPE_MASS = 0.3


class HeadTypes(Family):
    name = "headtypes"
    title = ("Previous-token, duplicate-token and induction heads: attention on each role's targets against the uniform head's "
             "(Elhage et al. 2021; Olsson et al. 2022; encoders: duplicate-token).")
    outputs = ("head_types", "head_type_heads")
    optional_outputs = ("copying_scores",)
    default_kinds = frozenset({"decoder"})  # on an encoder (duplicate-token alone) where asked for
    options = (
        Option("head_type_mass", HEAD_TYPE_MASS, "A head holds a role when its mean attention mass on the role's targets is at least this (as a sink "
               "head's eps) and, significantly, more than the uniform head's on the same sequences.", minimum=0.0, maximum=1.0),
    )

    def analyzers(self, settings, kind):
        from bertology.families.headtypes.analyzer import HeadTypes as Analyzer

        return {"headtypes": Analyzer(kind, correction=settings["correction"])}

    def finish(self, analyzers, context):
        from bertology.families.headtypes.copying import copying_scores

        table = analyzers["headtypes"].test(min_sample=context.settings["min_sample"], min_mass=context.settings["head_type_mass"])
        tables = {"head_types": table, "head_type_heads": held_heads(table)}
        copying, reason = copying_scores(context.engine.model)  # from the weights alone (Elhage et al. 2021)
        if copying is None:
            context.warnings.append(reason)
        else:
            tables["copying_scores"] = copying
        return FamilyResult(tables=tables)

    def section(self, folder, result, settings):
        from bertology.families.headtypes.report import headtypes_section

        return headtypes_section(folder, result.tables["head_types"], settings.get("correction", "fdr_bh"), settings["min_sample"],
                                 result.tables.get("copying_scores"))

    def summary(self, result):
        """Per role: how many of the tested heads hold it, and the tested head with the largest mean score."""
        from bertology.families.summaries import by_view

        lines = []
        for prefix, table in by_view(result.tables["head_types"]):
            for role, rows in table.groupby("role", sort=False):
                if not (rows.n > 0).any():
                    lines.append(f"{prefix}{role} heads: no sequence has a row with a target (no repeated token)")
                    continue
                tested = rows[rows.p_excess.notna()]
                if tested.empty:
                    lines.append(f"{prefix}{role} heads: not tested (every head seen in at most {int(rows.n.max())} sequences, fewer than "
                                 "--min-sample)")
                    continue
                top = tested.loc[tested.value.idxmax()]
                held = int(tested.holds.sum())
                lines.append(f"{prefix}{role} heads: {held} of {len(tested)} tested heads; strongest {int(top.layer)}-{int(top['head'])} "
                             f"(mass {top.value:.2f}, 95% CI {top.ci_low:.2f}-{top.ci_high:.2f}, uniform head {top.uniform:.2f}, "
                             f"p_adj {top.p_adj:.2g}, {'holds it' if top.holds else 'does not hold it'})")
        return lines

    def claims(self, result):
        """Each role a head holds: its excess over the uniform head on the same sequences significant, corrected within the role."""
        from bertology.families.summaries import by_view

        return [f"{prefix}{int(row.layer)}-{int(row.head)} {row.role} head: {row.value:.3f} vs uniform {row.uniform:.3f} (p_adj {row.p_adj:.2g})"
                for prefix, table in by_view(result.tables["head_types"]) for row in table[table.holds.astype(bool)].itertuples()]

    def overview(self, result):
        return result.tables["head_type_heads"]

    def by_layer(self, result):
        table = result.tables["head_types"]
        means = table.groupby(["role", "layer"], sort=False).value.mean().reset_index()
        return means.assign(quantity="mass on the targets (head mean): " + means.role)[["quantity", "layer", "value"]]


def held_heads(table):
    """The rows of ``head_types`` whose head holds the role, strongest first: ``role, layer, head, value, uniform, excess,
    p_adj, n``."""
    held = table[table.holds.astype(bool)][["role", "layer", "head", "value", "uniform", "excess", "p_adj", "n"]]
    return held.sort_values(["role", "value"], ascending=[True, False]).reset_index(drop=True)


register_family(HeadTypes())
