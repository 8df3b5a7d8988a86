"""Which heads matter for a task: ``bertology ablate`` (disable each head and layer, Kovaleva et al. 2019), ``bertology
importance`` (Michel et al. 2019's gradient importance) and ``bertology prune`` (their pruning curve), three commands of one
study (:func:`~bertology.studies.heads.importance.study_heads`)."""

from __future__ import annotations

from pathlib import Path

from bertology.core.options import CLASSIFIER, MODEL, RUN, TASK, TASK_BATCHES, TESTS, Option, pick
from bertology.studies import Study, default_out, read_task, register_study

MAX_EXAMPLES = Option("max_examples", None, "Evaluate on a seeded random subset of the dev split of this size.", type=int, minimum=1)
IMPORTANCE = (
    Option("importance_split", "train", "Split the gradient importance is measured on: train or dev."),
    Option("importance_examples", 1000, "Examples (seeded subset of --importance-split; all if it has fewer) for the gradient importance.",
           minimum=1),
    Option("normalise", "layer", "Importance normalisation: layer (l2 per layer, Michel et al.), global (min-max over all heads), "
           "layer+global, none."),
)


def task_options(*own: Option) -> tuple[Option, ...]:
    """A task study's options: the task, the classifier, the study's own, then the run, the task's files and batches."""
    return (*pick(TASK, "task"), CLASSIFIER, *own, *pick(RUN, "out"), *pick(TASK, "train", "dev", "text_column", "text_pair_column", "label_column"),
            *TASK_BATCHES, *pick(RUN, "seed"), *pick(MODEL, "device"), *pick(RUN, "quiet"))


class HeadsCommand(Study):
    """A command of the heads study: ``asks`` switches on its part of :func:`~bertology.studies.heads.importance.study_heads`."""

    asks: dict

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.studies.heads.importance import study_heads

        data = read_task(settings)
        s = {name: value for name, value in settings.items() if name not in {option.name for option in TASK}}
        settings["out"] = s.pop("out") or default_out(self.name, s["model"], data.name)
        quiet = s.pop("quiet")
        return data.name, study_heads(s.pop("model"), data, out=settings["out"], progress=not quiet, command=command, **self.asks, **s)

    def summary(self, result, settings: dict) -> list[str]:
        task, study = result
        scores = ", ".join(f"{k} {v:.4f}" for k, v in study.baseline.items())
        return [f"{task}: {study.examples} dev examples; with no intervention: {scores}", *self.findings(study, settings),
                f"report: {(Path(settings['out']) / 'report.html').resolve()}"]

    def findings(self, study, settings: dict) -> list[str]:
        raise NotImplementedError


class Ablate(HeadsCommand):
    name = "ablate"
    title = "Disable each head, and each layer, on its own and measure the task metric (leave-one-out, with intervals and FDR)."
    asks = {"ablate": True}
    options = task_options(
        Option("intervention", "mask", "mask (zero the head's output) or uniform (Kovaleva et al.'s disabling)."),
        Option("bootstrap", 10000, "Paired bootstrap replicates over examples (p is at least 2/(B+1)).", minimum=100),
        TESTS[0].but(help="Multiple-testing correction across heads and layers (statsmodels)."),
        *pick(TESTS, "min_sample"),
        MAX_EXAMPLES,
    )
    outputs = ("ablation",)

    def findings(self, study, settings: dict) -> list[str]:
        metric = next(iter(study.baseline))
        rows = study.ablation[(study.ablation.metric == metric) & (study.ablation.p_adj < 0.05)]
        lines = []
        for row in rows.sort_values("delta").itertuples():
            where = f"layer {row.layer}" if row.head < 0 else f"head {row.layer}-{row.head}"
            lines.append(f"  {where}: {metric} {row.delta:+.4f} [{row.ci_low:+.4f}, {row.ci_high:+.4f}], p_adj {row.p_adj:.3g}")
        return [*lines, f"{len(rows)} significant changes (p_adj < 0.05)"]


class Importance(HeadsCommand):
    name = "importance"
    title = "Michel et al.'s head importance: E|dL/d xi_h| for a gate on each head, normalised per layer (--normalise)."
    asks = {"importance": True}
    options = task_options(*IMPORTANCE)
    outputs = ("importance",)

    def findings(self, study, settings: dict) -> list[str]:
        top = study.importance.sort_values("importance_normalised", ascending=False).head(5)
        return [f"importance measured on {study.importance_examples} {settings['importance_split']} examples",
                "most important heads: " + ", ".join(f"{r.layer}-{r.head} ({r.importance_normalised:.2f})" for r in top.itertuples())]


class Prune(HeadsCommand):
    name = "prune"
    title = "Michel et al.'s iterative pruning curve; --prune-to K removes heads for real and measures the speed-up."
    asks = {"prune": True}
    options = task_options(
        Option("step", 0.1, "Share of all heads pruned per step.", minimum=0.01, maximum=0.5),
        Option("prune_to", None, "Also remove heads physically down to K heads, save that model and time it.", type=int, minimum=1),
        *IMPORTANCE,
        MAX_EXAMPLES,
    )
    outputs = ("importance", "pruning")

    def findings(self, study, settings: dict) -> list[str]:
        from bertology.studies.heads.report import heads_within

        metric, unpruned = next(iter(study.baseline.items()))
        lines = [f"{heads_within(study.pruning, metric, unpruned)} heads can be pruned before {metric} drops by more than 1 point"]
        if study.pruned is not None:
            p = study.pruned
            lines.append(f"pruned to {p['heads_kept']} heads: {metric} {p['metric_pruned'][metric]:.4f}, {p['speedup']:.2f}x as fast; model: {p['model']}")
        return lines


register_study(Ablate())
register_study(Importance())
register_study(Prune())
