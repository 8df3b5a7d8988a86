"""The weightings of a run (``weighting="attention,norm"``): the views of attention every family reads, side by side.

Attention weights beside Kobayashi et al.'s (2020) norm shares, and beside the per-head contribution maps of ALTI
(Ferrando et al. 2022) and value zeroing (Mohebbi et al. 2023). (Not the viewer page: that is
:mod:`bertology.studies.view`.)

:func:`combine_views` folds each view's results of a family into one, whose tables carry a ``weighting`` column;
:func:`views_section` sets every family's headline quantities per layer (:meth:`Family.by_layer`) side by side and says
where the views disagree most. Names no family: it asks the registry.
"""

from __future__ import annotations

import pandas as pd

from bertology.core.measures.norms import WEIGHTING_TITLES
from bertology.core.model.kinds import ENCODER, Kind
from bertology.core.storage.runfolder import RunFolder
from bertology.families import FamilyResult, get_family
from bertology.render.html import Figure, Section

#: How many of the largest disagreements the section lists.
TOP_DISAGREEMENTS = 8


def combine_views(finished: dict[str, FamilyResult]) -> FamilyResult:
    """One family's results under each view (``weighting`` -> result, in the run's order) as one result.

    Tables: every view's rows, with a first column ``weighting``. Documents and in-memory extras: the first
    view's under their own names (a document records its ``weighting``), the others' as ``NAME_<weighting>``.
    """
    views = list(finished)
    combined = FamilyResult()
    for name in finished[views[0]].tables:
        combined.tables[name] = pd.concat([finished[view].tables[name].assign(weighting=view) for view in views], ignore_index=True)
        combined.tables[name].insert(0, "weighting", combined.tables[name].pop("weighting"))
    for view in views:
        suffix = "" if view == views[0] else f"_{view}"
        for name, document in finished[view].documents.items():
            combined.documents[name + suffix] = {"weighting": view, **document}
        for name, extra in finished[view].extras.items():
            combined.extras[name + suffix] = extra
    return combined


def by_layer_across_views(by_view: dict[str, dict[str, FamilyResult]]) -> pd.DataFrame:
    """``weighting, family, quantity, layer, value``: each family's :meth:`~bertology.families.Family.by_layer` under each view."""
    frames = []
    for weighting, results in by_view.items():
        for name, result in results.items():
            family = get_family(name)
            table = family.by_layer(result) if family.weighted else None
            if table is not None and len(table):
                frames.append(table.assign(weighting=weighting, family=name))
    if not frames:
        return pd.DataFrame(columns=["weighting", "family", "quantity", "layer", "value"])
    return pd.concat(frames, ignore_index=True)[["weighting", "family", "quantity", "layer", "value"]]


def disagreements(table: pd.DataFrame, views: list[str] | None = None) -> pd.DataFrame:
    """Per ``family, quantity, layer``: each view's value, largest disagreement first. Two views: ``difference`` (second view
    minus first; ``views`` in the run's order, by default as the table lists them). More: ``spread`` (highest minus lowest)
    and the views that give the ``highest`` and ``lowest`` value."""
    views = views or list(dict.fromkeys(table.weighting))
    wide = table.pivot_table(index=["family", "quantity", "layer"], columns="weighting", values="value", sort=False)[views].reset_index()
    wide.columns.name = None
    if len(views) == 2:
        wide["difference"] = wide[views[1]] - wide[views[0]]
        order = wide["difference"].abs()
    else:
        values = wide[views]
        wide["spread"] = values.max(axis=1) - values.min(axis=1)
        wide["highest"], wide["lowest"] = values.idxmax(axis=1), values.idxmin(axis=1)
        order = wide["spread"]
    return wide.reindex(order.sort_values(ascending=False, kind="stable").index).reset_index(drop=True)


#: The line style of each view in :func:`views_figure`, in the run's order.
VIEW_STYLES = ("-o", "--s", ":^", "-.D")
STYLE_NAMES = ("solid", "dashed", "dotted", "dash-dot")


def views_figure(table: pd.DataFrame, views: list[str]):
    """One panel per family: each headline quantity by layer, a colour per quantity, a line style per view (:data:`VIEW_STYLES`).
    Each panel's title is its family's name; the line styles are said once, above the panels; layers are whole numbers."""
    from bertology.render.figures import plt

    families = list(dict.fromkeys(table.family))
    figure, axes = plt.subplots(1, len(families), figsize=(4.4 * len(families), 4.4), squeeze=False)
    styles = dict(zip(views, VIEW_STYLES))
    short = [WEIGHTING_TITLES[view].split(" (")[0] for view in views]
    for axis, family in zip(axes[0], families):
        rows = table[table.family == family]
        for colour, (quantity, lines) in enumerate(rows.groupby("quantity", sort=False)):
            for weighting, line in lines.groupby("weighting", sort=False):
                axis.plot(line.layer, line.value, styles[weighting], color=f"C{colour % 10}", markersize=3,
                          label=quantity if weighting == views[0] else None)
        axis.set_title(family, fontsize=9)
        axis.set_xticks(sorted(int(layer) for layer in rows.layer.unique()))
        axis.set_xlabel("layer (0-based)", fontsize=8)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6)
    figure.suptitle("; ".join(f"{style}: {name}" for style, name in zip(STYLE_NAMES, short)), fontsize=8)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def anchor_phrase(kind: Kind) -> str:
    """How the section names the tokens a head parks its weight on: the ``kind``'s anchors (:attr:`Kind.anchor_words`)."""
    return "[CLS] or [SEP]" if kind is ENCODER else kind.anchor_words


def views_section(folder: RunFolder, by_view: dict[str, dict[str, FamilyResult]], views: list[str], kind: Kind) -> Section:
    """Write ``views_by_layer`` and its figure; return the report section that compares the ``views`` (in the run's order),
    in the words of the run's ``kind`` of model (:func:`anchor_phrase`)."""
    table = by_layer_across_views(by_view)
    if views == ["attention", "norm"]:
        title = "Attention weights beside norm shares"
    else:
        title = "Views of attention side by side"
    section = Section(
        title=title,
        intro=(f"Kobayashi et al. (2020): a head adds a[i, j] f(x_j) to token i, and heads that put their weight on {anchor_phrase(kind)} "
               "often mix in little, because f of those tokens is small. Norm shares w[i, j] = ||a[i, j] f(x_j)|| / "
               "sum_k ||a[i, k] f(x_k)|| are a distribution like the weights"
               + ("; so are the per-head contribution maps of ALTI (Ferrando et al. 2022, each head's own output decomposed, "
                  "through the layer norm's linear part in a post-norm block) and of value zeroing (Mohebbi et al. 2023, the layer "
                  "rerun with one token's values zeroed in one head)" if set(views) & {"alti", "value-zeroing"} else "")
               + "; every analysis above ran on each (every table has a weighting column). Per layer, each family's headline "
               f"quantities under {' and '.join(WEIGHTING_TITLES[view] for view in views)} (views_by_layer.csv)."),
    )
    if table.empty or len(views) < 2:
        section.notes.append("No family reported per-layer quantities under more than one view.")
        return section
    folder.write_table("views_by_layer", table)
    from bertology.render.figures import all_zero

    styles = "; ".join(f"{style}, {WEIGHTING_TITLES[view]}" for style, view in zip(STYLE_NAMES, views))
    zero = [family for family, rows in table.groupby("family", sort=False) if all_zero(rows.value)]
    for family in zero:
        section.notes.append(f"{family}: nothing to show: every value is 0 under every view (views_by_layer.csv).")
    shown = table[~table.family.isin(zero)]
    if len(shown):
        section.figures.append(Figure(folder.write_figure("views_by_layer", views_figure(shown, views)),
                                      f"Each family's headline quantities by layer (0-based): {styles}."))
    ranked = disagreements(table, views)
    top = ranked.iloc[0]
    if len(views) == 2:
        first, second = views
        section.notes.append(
            f"The views disagree most on {top.quantity} ({top.family}) in layer {int(top.layer)}: {top[first]:.3f} under "
            f"{WEIGHTING_TITLES[first]}, {top[second]:.3f} under {WEIGHTING_TITLES[second]}.")
        section.tables.append((f"The {TOP_DISAGREEMENTS} largest differences ({second} minus {first})", ranked.head(TOP_DISAGREEMENTS)))
        return section
    section.notes.append(
        f"The views disagree most on {top.quantity} ({top.family}) in layer {int(top.layer)}: "
        + ", ".join(f"{top[view]:.3f} under {WEIGHTING_TITLES[view]}" for view in views) + ".")
    section.tables.append((f"The {TOP_DISAGREEMENTS} largest disagreements (spread: the highest view's value minus the lowest's)",
                           ranked.head(TOP_DISAGREEMENTS)))
    return section
