"""Head roles: the heads hypothesis (Pande et al. 2021, METHODS.md section 5).

Tables: ``roles`` (``layer, head, role, mean, ci_low, ci_high, t, p, p_adj, has_role, n``) and
``role_shares`` (the share of heads holding each role at tau = 1, 2, 3 and the run's tau), plus, from
the report section, ``role_shares_by_layer`` and ``role_colocation``.
"""

from __future__ import annotations

from bertology.families import Family, FamilyResult, Option, register_family

#: Role shares are always reported at these tau values too (Pande et al. discuss 1 to 3).
REPORTED_TAUS = (1.0, 2.0, 3.0)


class Roles(Family):
    name = "roles"
    title = "Which heads hold which roles: sieve scores and corrected t-tests (Pande et al. 2021)."
    options = (
        Option("tau", 3.0, "Role test threshold: a head holds a role if its mean sieve score is significantly above tau."),
        Option("role_window", 2, "Half-width of the local role's window.", minimum=1),
    )
    outputs = ("roles", "role_shares")

    def analyzers(self, settings):
        from bertology.families.roles.analyzer import HeadRoles

        return {"roles": HeadRoles(tau=settings["tau"], window=settings["role_window"], correction=settings["correction"])}

    def finish(self, analyzers, context):
        import pandas as pd

        from bertology.families.roles.analyzer import role_shares

        roles = analyzers["roles"]
        taus = sorted(set(REPORTED_TAUS) | {context.settings["tau"]})
        least = context.settings["min_sample"]
        shares = pd.concat([role_shares(roles.test(tau=value, min_sample=least)).assign(tau=value) for value in taus], ignore_index=True)
        return FamilyResult(tables={"roles": roles.test(min_sample=least), "role_shares": shares})

    def section(self, folder, result, settings):
        from bertology.families.roles.report import roles_section

        return roles_section(folder, result.tables["roles"], result.tables["role_shares"], settings["tau"], settings["correction"],
                             settings["min_sample"])

    def by_layer(self, result):
        roles = result.tables["roles"]
        shares = roles.groupby(["role", "layer"], sort=False).has_role.mean().reset_index(name="value")
        return shares.assign(quantity="share of heads: " + shares.role)[["quantity", "layer", "value"]]


register_family(Roles())
