"""The report's section on a decoder's induction heads (:func:`induction_section`): the phase-change verdict
(:mod:`~bertology.studies.track.phase`), its three curves on one step axis with the window shaded (:func:`phase_curves`), the
induction head's and its previous-token head's maps on one probe sequence before and after the window (:func:`phase_maps`),
the heads named on the probe, and the corpus's induction and in-context learning scores."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import plt
from bertology.render.html import Figure, Section
from bertology.studies.track.phase import ABRUPT_SHARE, BUMP_SHARE

#: Heads drawn in the corpus's induction figure: the strongest at the final checkpoint.
TOP_HEADS = 4

INTRO = ("Claim (Olsson et al. 2022, METHODS.md section 15): induction heads form in a short window of training (a phase change) in "
         "which the in-context learning score (the loss of a late token less an early one's) drops and the loss shows a bump. Read "
         "on the induction probe, random whole-word pieces in which a segment repeats at a random period and offset, so that only "
         "content predicts the repeat: a head's induction score is its attention mass on the keys after earlier occurrences of the "
         "query's token, over the repeat. An induction head is in layer 1 or deeper (a layer-0 head has no head below it to compose "
         "with), scores at least --head-type-mass at most periods, beyond the uniform head on the same sequences; a head that does so "
         "at some period but not at most is positional. The strongest head of layer 1 or deeper at the last checkpoint is followed, "
         "with the strongest previous-token head below it (the pair that composes). Its rise is abrupt where the checkpoints around "
         f"its 10% and 90% crossings span at most {ABRUPT_SHARE:.0%} of training in 97.5% of the bootstrap replicates over sequences "
         "(paired across checkpoints), smooth otherwise; a loss bump is where the loss on the track corpus stands above its lower "
         f"convex hull by at least {BUMP_SHARE:.0%} of its whole fall (and in the 2.5th percentile of the replicates). Supported: an "
         "abrupt rise whose window's interval overlaps the in-context learning drop's and the loss bump's; else abrupt, smooth, or "
         "no evidence (no change beyond the uniform head, or no induction head).")


def induction_section(folder: RunFolder, track) -> Section:
    """A decoder's induction heads over training and the phase-change verdict (see the module docstring)."""
    verdict = track.verdict["induction"]
    section = Section(title="Induction heads over training: the phase change", intro=INTRO)
    section.notes.append(f"Verdict: {verdict['verdict']}: {verdict['statement']}")
    if "induction_head" in verdict:
        probes = [r.probe for r in track.results]
        losses = np.stack([r.loss_replicates for r in track.results]) if "loss_bump" in verdict else None
        section.figures.append(Figure(folder.write_figure("phase_change", phase_curves(track.steps, probes, losses, verdict)),
                                      "One step axis. Top: the followed induction head's and its previous-token head's scores on the probe; "
                                      "middle: the in-context learning score on the probe; bottom: the loss on the track corpus (bands: 95% "
                                      "bootstrap intervals). Shaded: the head's 10%-90% window between its bracketing checkpoints (dark) and "
                                      "its 95% interval (light); hatched: the drop's and the bump's windows."))
        section.figures.append(Figure(folder.write_figure("phase_maps", phase_maps(track, verdict)),
                                      "The induction head's and its previous-token head's attention on the probe's first sequence, before and "
                                      "after the window; the dotted lines mark where the second copy of its segment begins."))
        named = track.induction_probe
        section.tables.append(("Heads named on the induction probe at the last checkpoint (induction_probe.csv has every head at every "
                               "checkpoint)", named[(named.step == track.steps[-1]) & (named.role != "")].round(4)))
    induction, in_context = track.induction, track.in_context
    if induction is not None and in_context is not None and len(track.results) > 1:
        section.figures.append(Figure(folder.write_figure("induction_by_step", induction_by_step(induction, in_context)),
                                      f"On the track corpus. Left: the induction score of the {TOP_HEADS} strongest heads at the final "
                                      "checkpoint (band: 95% bootstrap interval). Right: the in-context learning score."))
    if in_context is not None:
        section.tables.append(("The in-context learning score on the track corpus by checkpoint (in_context.csv)", in_context.drop(columns="checkpoint")))
    if induction is not None:
        final = induction[induction.checkpoint == track.results[-1].checkpoint].nlargest(TOP_HEADS, "value")
        wide = induction.merge(final[["layer", "head"]]).pivot_table(index=["layer", "head"], columns="step", values="value", dropna=False)
        wide.columns = ["step unknown" if pd.isna(step) else f"step {step}" for step in wide.columns]
        section.tables.append((f"Induction score on the track corpus of the {TOP_HEADS} strongest heads by checkpoint (induction.csv has every head)",
                               wide.round(4).reset_index()))
    return section


def _shade(axis, verdict: dict) -> None:
    """The followed head's window (dark: its bracketing checkpoints; light: its 95% interval) and the drop's and bump's (hatched)."""
    head = verdict["induction_head"]
    if head["window_start"] is not None:
        axis.axvspan(head["window_low"], head["window_high"], color="tab:orange", alpha=0.12)
        axis.axvspan(head["window_bracket_low"], head["window_bracket_high"], color="tab:orange", alpha=0.25)
    for key, hatch in (("icl_drop", "//"), ("loss_bump", "\\\\")):
        window = verdict.get(key)
        if window is not None and window.get("window_low") is not None and (window.get("changes") or window.get("bump")):
            axis.axvspan(window["window_low"], window["window_high"], fill=False, hatch=hatch, edgecolor="grey", linewidth=0)


def _band(axis, steps, replicates: np.ndarray, color: str, label: str) -> None:
    """A series ``[checkpoint, 1 + B]``: its data as a line, the 2.5th-97.5th percentiles of its replicates as a band."""
    if replicates.shape[1] > 1:
        low, high = np.nanpercentile(replicates[:, 1:], [2.5, 97.5], axis=1)
        axis.fill_between(steps, low, high, color=color, alpha=0.2)
    axis.plot(steps, replicates[:, 0], "o-", color=color, markersize=3, label=label)


def phase_curves(steps: list[int], probes: list, losses: np.ndarray | None, verdict: dict):
    """The three curves of the phase change on one step axis (see :func:`induction_section`)."""
    figure, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    head, previous = verdict["induction_head"], verdict["previous_token_head"]
    for followed, member, color in ((head, "induction", "tab:red"), (previous, "previous", "tab:blue")):
        series = np.stack([getattr(probe, member)[:, followed["layer"], followed["head"]] for probe in probes])
        _band(axes[0], steps, series, color, f"head {followed['layer']}-{followed['head']}: {member.replace('previous', 'previous-token')} score")
    axes[0].set_ylim(0, 1)
    axes[0].set_ylabel("attention mass (probe)")
    if all(probe.icl is not None for probe in probes):
        early, late = probes[0].icl_positions
        _band(axes[1], steps, np.stack([probe.icl for probe in probes]), "black", f"loss of token {late} - token {early}")
        axes[1].axhline(0, color="black", linewidth=0.6)
    axes[1].set_ylabel("in-context learning score (nats)")
    if losses is not None:
        _band(axes[2], steps, losses, "tab:green", "loss on the track corpus")
    axes[2].set_ylabel("loss (nats)")
    axes[2].set_xlabel("training step")
    for axis in axes:
        _shade(axis, verdict)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    axes[0].set_title(f"phase change: {verdict['verdict']}")
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def _before_after(track, head: dict) -> tuple[int, int]:
    """The checkpoints (indices) before and after the followed head's window: its bracketing checkpoints, else the first and the last."""
    steps = track.steps
    if head["window_start"] is None:
        return 0, len(steps) - 1
    return steps.index(int(head["window_bracket_low"])), steps.index(int(head["window_bracket_high"]))


def phase_maps(track, verdict: dict):
    """The followed induction head's and previous-token head's maps on the probe's first sequence, before and after its window."""
    head, previous = verdict["induction_head"], verdict["previous_token_head"]
    chosen = _before_after(track, head)
    figure, axes = plt.subplots(2, 2, figsize=(8.5, 8))
    start = track.results[0].probe.second_copy
    for row, followed in enumerate((head, previous)):
        for column, index in enumerate(chosen):
            result = track.results[index]
            axis = axes[row, column]
            axis.imshow(result.probe.maps[followed["layer"], followed["head"]], cmap="viridis", vmin=0, vmax=1)
            axis.axvline(start - 0.5, color="white", linestyle=":", linewidth=0.8)
            axis.axhline(start - 0.5, color="white", linestyle=":", linewidth=0.8)
            kind = "induction" if row == 0 else "previous-token"
            axis.set_title(f"{kind} head {followed['layer']}-{followed['head']}, step {result.step} ({'before' if column == 0 else 'after'})",
                           fontsize=9)
            axis.set_xlabel("key position")
            axis.set_ylabel("query position")
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def induction_by_step(induction: pd.DataFrame, in_context: pd.DataFrame):
    """On the track corpus. Left: the strongest heads' induction scores against step; right: the in-context learning score."""
    figure, (heads, icl) = plt.subplots(1, 2, figsize=(12, 4.0))
    final = induction[induction.step == induction.step.max()].nlargest(TOP_HEADS, "value")
    for k, row in enumerate(final.itertuples()):
        rows = induction[(induction.layer == row.layer) & (induction["head"] == row.head)].sort_values("step")
        heads.fill_between(rows.step, rows.ci_low, rows.ci_high, color=f"C{k}", alpha=0.15)
        heads.plot(rows.step, rows.value, "o-", color=f"C{k}", markersize=3, label=f"head {row.layer}-{row.head}")
    icl.fill_between(in_context.step, in_context.ci_low, in_context.ci_high, color="black", alpha=0.15)
    icl.plot(in_context.step, in_context.value, "o-", color="black", markersize=3,
             label=f"loss of token {in_context.late.iloc[0]} - token {in_context.early.iloc[0]}")
    for axis in (heads, icl):
        axis.set_xlabel("training step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    heads.set_ylabel("induction score (attention mass)")
    heads.set_title("induction heads (track corpus)")
    icl.axhline(0, color="black", linewidth=0.6)
    icl.set_ylabel("in-context learning score (nats)")
    icl.set_title("in-context learning score (track corpus)")
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure
