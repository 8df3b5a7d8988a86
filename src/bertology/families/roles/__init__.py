"""Head roles: the heads hypothesis (Pande et al. 2021, docs/methods.md#roles-and-the-sieve-score).

Tables: ``roles`` (``layer, head, role, mean, ci_low, ci_high, uniform, excess, t, p, t_excess, p_excess, p_adj, has_role, n``:
``uniform`` the uniform head's mean score on the same sequences, ``excess`` the mean paired excess over it; a head holds a
role when its mean is significantly above tau and its excess significantly above 0) and
``role_shares`` (the share of heads holding each role at tau = 1, 2, 3 and the run's tau), plus, from
the report section, ``role_shares_by_layer`` and ``role_colocation``. In memory, ``role_tau``: the run's tau.
"""

from __future__ import annotations

from bertology.families import Family, FamilyResult, Option, register_family

#: Role shares are always reported at these tau values too (Pande et al. discuss 1 to 3).
REPORTED_TAUS = (1.0, 2.0, 3.0)


class Roles(Family):
    name = "roles"
    title = "Which heads hold which roles: sieve scores and corrected t-tests (Pande et al. 2021)."
    options = (
        Option("tau", 3.0, "Role test threshold: a head holds a role if its mean sieve score is significantly above tau and above "
                          "the uniform head's score on the same sequences."),
        Option("role_window", 2, "Half-width of the local role's window.", minimum=1),
    )
    outputs = ("roles", "role_shares", "role_shares_by_layer", "role_colocation")
    in_memory = ("role_tau",)

    def analyzers(self, settings, kind):
        from bertology.families.roles.analyzer import HeadRoles

        return {"roles": HeadRoles(kind, tau=settings["tau"], window=settings["role_window"], correction=settings["correction"])}

    def finish(self, analyzers, context):
        import pandas as pd

        from bertology.families.roles.analyzer import role_shares

        roles = analyzers["roles"]
        taus = sorted(set(REPORTED_TAUS) | {context.settings["tau"]})
        least = context.settings["min_sample"]
        shares = pd.concat([role_shares(roles.test(tau=value, min_sample=least)).assign(tau=value) for value in taus], ignore_index=True)
        return FamilyResult(tables={"roles": roles.test(min_sample=least), "role_shares": shares}, extras={"role_tau": context.settings["tau"]})

    def section(self, folder, result, settings):
        from bertology.families.roles.report import roles_section

        return roles_section(folder, result.tables["roles"], result.tables["role_shares"], settings["tau"], settings["correction"],
                             settings["min_sample"])

    def summary(self, result):
        """Per summary role: how many of the tested heads hold it at the run's tau, and the tested head with the largest mean
        sieve score. A head seen in fewer than ``--min-sample`` sequences is not tested (``p`` is NaN) and counts nowhere."""
        from bertology.families.roles.analyzer import SUMMARY_ROLES
        from bertology.families.summaries import by_view

        tau = result.extras.get("role_tau")
        at = f" at tau {tau:g}" if tau is not None else ""
        lines = []
        for prefix, roles in by_view(result.tables["roles"]):
            for role in SUMMARY_ROLES:
                rows = roles[roles.role == role]
                if rows.empty or not (rows.n > 0).any():  # nothing to score (block without pairs, syntactic without trees)
                    continue
                tested = rows[rows.p.notna()]
                if tested.empty:
                    lines.append(f"{prefix}role {role}{at}: not tested (every head seen in at most {int(rows.n.max())} sequences, "
                                 "fewer than --min-sample)")
                    continue
                held = int(tested.has_role.sum())
                top = tested.loc[tested["mean"].idxmax()]
                untested = f", {len(rows) - len(tested)} not tested" if len(tested) < len(rows) else ""
                uniform = top.get("uniform")  # the uniform head's mean score on the same sequences (a table that has it)
                beside = f", uniform head {uniform:.2f}" if uniform is not None and uniform == uniform else ""
                lines.append(f"{prefix}role {role}{at}: {held} of {len(tested)} tested heads ({held / len(tested):.0%}){untested}; "
                             f"strongest {int(top.layer)}-{int(top['head'])} (mean score {top['mean']:.2f}, 95% CI {top.ci_low:.2f}-{top.ci_high:.2f}"
                             f"{beside}, p_adj {top.p_adj:.2g}, {'holds it' if top.has_role else 'does not pass the test'})")
        return lines

    def claims(self, result):
        """Each role a head holds: its mean past tau and its excess over the uniform head on the same sequences significant
        (corrected within the role)."""
        from bertology.families.summaries import by_view

        return [f"{prefix}{int(row.layer)}-{int(row.head)} {row.role}: mean {row.mean:.3f} vs uniform {row.uniform:.3f} (p_adj {row.p_adj:.2g})"
                for prefix, roles in by_view(result.tables["roles"]) for row in roles[roles.has_role.astype(bool)].itertuples()]

    def by_layer(self, result):
        roles = result.tables["roles"]
        shares = roles.groupby(["role", "layer"], sort=False).has_role.mean().reset_index(name="value")
        return shares.assign(quantity="share of heads: " + shares.role)[["quantity", "layer", "value"]]


register_family(Roles())
