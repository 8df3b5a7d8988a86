"""Which heads matter: ``bertology ablate``, ``importance`` and ``prune`` for a task, and ``patch`` on prompt pairs.

``ablate``: zero, mean, resample or uniform ablation of each head and layer (Kovaleva et al. 2019, Wang et al. 2022);
``importance``: Michel et al. 2019's gradient importance; ``prune``: their pruning curve; the three are one study
(:func:`~bertology.studies.heads.study.study_heads`), whose task is a fine-tuned classifier's, or a decoder's next-token
prediction on a text corpus (``--corpus``, the causal LM loss). ``patch``: activation and attribution patching of every
head on prompt pairs (docs/methods.md#which-heads-matter-causally).
"""

from __future__ import annotations

from pathlib import Path

from bertology.core.errors import BertologyError
from bertology.core.options import CLASSIFIER, CORPUS, MODEL, RAY, RUN, TASK, TASK_BATCHES, TESTS, Option, pick
from bertology.studies import Study, default_out, read_task, register_study

#: The split a task's gradient importance is measured on unless ``--importance-split`` says otherwise.
DEFAULT_IMPORTANCE_SPLIT = "train"
MAX_EXAMPLES = Option("max_examples", None, "Evaluate on a seeded random subset of the dev split of this size.", type=int, minimum=1)
IMPORTANCE = (
    Option("importance_split", None, f"Split of the task the gradient importance is measured on: train or dev [default: {DEFAULT_IMPORTANCE_SPLIT}].",
           type=str),
    Option("importance_examples", 1000, "Examples (seeded subset of --importance-split, or texts of the --corpus; all if it has fewer) for the "
           "gradient importance.", minimum=1),
    Option("normalise", "layer", "Importance normalisation: layer (l2 per layer, Michel et al.), global (min-max over all heads), "
           "layer+global, none."),
)


#: A decoder's next-token task instead of a classifier's (``ablate``, ``importance`` and ``prune``).
LM_MODEL = CLASSIFIER.but(help="A fine-tuned sequence classifier (with TASK), or a causal language model, a decoder (with --corpus).")
LM_CORPUS = (CORPUS[0].but(help="Text corpus instead of TASK: score a decoder's heads by its causal LM loss (next-token cross-entropy) on it."),
             *pick(CORPUS, "format"))


def task_options(*own: Option, model: Option = CLASSIFIER, corpus: tuple[Option, ...] = ()) -> tuple[Option, ...]:
    """A task study's options: the task (or ``corpus``), the classifier (``model``), the study's own, then the run, the task's files and batches."""
    return (*pick(TASK, "task"), *corpus, model, *own, *pick(RUN, "out"), *pick(TASK, "train", "dev", "text_column", "text_pair_column", "label_column"),
            *TASK_BATCHES, *pick(RUN, "seed"), *pick(MODEL, "device"), *pick(RUN, "quiet"))


class HeadsCommand(Study):
    """A command of the heads study: ``asks`` switches on its part of :func:`~bertology.studies.heads.study.study_heads`."""

    asks: dict
    libraries = ("bertology.studies.heads.study", "transformers.modeling_utils")

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.core.storage.runfolder import check_out
        from bertology.studies.heads.study import study_heads

        corpus = settings.get("corpus")
        task_files = [settings[name] for name in ("task", "train", "dev") if settings[name] is not None]
        if corpus is None:
            if not task_files and "corpus" in settings:
                raise BertologyError("give a TASK folder (or --train and --dev) for a classifier, or --corpus for a causal language model")
            data = read_task(settings)
        else:
            if task_files:
                raise BertologyError("give a TASK (for a classifier) or --corpus (for a causal language model), not both")
            if settings["out"] is not None:
                check_out(settings["out"], inputs=(corpus, settings["model"]))
            data = None
        s = {name: value for name, value in settings.items() if name not in {option.name for option in TASK}}
        settings["out"] = s.pop("out") or default_out(self.name, s["model"], data.name if data is not None else corpus)
        quiet = s.pop("quiet")
        return study_heads(s.pop("model"), data, out=settings["out"], progress=not quiet, command=command, **self.asks, **s)

    def summary(self, study, settings: dict) -> list[str]:
        scores = ", ".join(f"{k} {v:.4f}" for k, v in study.baseline.items())
        return [f"{study.task}: {study.examples} {study.unit}; with no intervention: {scores}", *self.findings(study, settings),
                f"report: {(Path(settings['out']) / 'report.html').resolve()}"]

    def findings(self, study, settings: dict) -> list[str]:
        raise NotImplementedError


def ablated(settings: dict) -> str:
    """How a run's intervention is worded: ``zero ablation``, ``mean ablation (z_h's mean over every position of the examples
    evaluated)``..."""
    source = Path(settings["reference"]).name if settings.get("reference") else "the examples evaluated"
    over = "every position" if settings.get("mean_over") == "positions" else "the examples at each piece index"
    return {"mask": "zero ablation (mask)", "zero": "zero ablation", "uniform": "uniform attention",
            "mean": f"mean ablation (z_h's mean over {over} of {source})",
            "resample": f"resample ablation (z_h of {settings.get('resamples')} donors per example among {source}, the change averaged over them)",
            }[settings["intervention"]]


class Ablate(HeadsCommand):
    name = "ablate"
    title = ("Ablate each head, and each layer, on its own (zero, mean, resample or uniform) and measure the task metric or a decoder's "
             "causal LM loss (leave-one-out, with intervals and FDR).")
    asks = {"ablate": True}
    options = task_options(
        Option("intervention", "zero", "zero (the head's output z_h set to 0; mask is its old name), mean (z_h's mean over --reference), "
               "resample (z_h from other examples, --resamples draws) or uniform (its attention made uniform, Kovaleva et al.)."),
        Option("reference", None, "Text file (read as --format says) whose z_h mean and resample ablation take [default: the examples "
               "evaluated].", type=Path),
        Option("mean_over", None, "Mean ablation's mean: positions (one mean per head over every piece of the reference) or examples "
               "(a mean per piece index over the reference's examples) [default: positions].", type=str),
        Option("resamples", None, "Resample ablation's draws per example (donors seeded by --seed); the change is averaged over them "
               "[default: 5].", type=int),
        Option("bootstrap", 10000, "Paired bootstrap replicates over examples (p is at least 2/(B+1)).", minimum=100),
        TESTS[0].but(help="Multiple-testing correction across heads and layers (statsmodels)."),
        *pick(TESTS, "min_sample"),
        MAX_EXAMPLES.but(help="Evaluate on a seeded random subset of this size of the dev split, or of the --corpus's texts."),
        model=LM_MODEL,
        corpus=LM_CORPUS,
    )
    outputs = ("ablation",)

    def findings(self, study, settings: dict) -> list[str]:
        metric = next(iter(study.baseline))
        rows = study.ablation[(study.ablation.metric == metric) & study.ablation.matters]
        lines = [f"{ablated(study.settings)} of each head and layer on {study.examples} {study.unit}"]
        for row in rows.sort_values("delta").itertuples():
            where = f"layer {row.layer}" if row.head < 0 else f"head {row.layer}-{row.head}"
            lines.append(f"  {where}: {metric} {row.delta:+.4g} [{row.ci_low:+.4g}, {row.ci_high:+.4g}], p_adj {row.p_adj:.3g}")
        return [*lines, f"{len(rows)} heads and layers matter (interval excludes 0, p_adj < 0.05)"]


class Importance(HeadsCommand):
    name = "importance"
    title = "Michel et al.'s head importance: E|dL/d xi_h| for a gate on each head, normalised per layer (--normalise)."
    asks = {"importance": True}
    options = task_options(*IMPORTANCE, model=LM_MODEL, corpus=LM_CORPUS)
    outputs = ("importance",)

    def findings(self, study, settings: dict) -> list[str]:
        top = study.importance.sort_values("importance_normalised", ascending=False).head(5)
        where = f"{study.settings['importance_split']} examples" if study.corpus is None else "texts of the corpus"
        return [f"importance measured on {study.importance_examples} {where} ({study.loss})",
                "most important heads: " + ", ".join(f"{r.layer}-{r.head} ({r.importance_normalised:.2f})" for r in top.itertuples())]


class Prune(HeadsCommand):
    name = "prune"
    title = "Michel et al.'s iterative pruning curve; --prune-to K removes heads for real and measures the speed-up."
    asks = {"prune": True}
    options = task_options(
        Option("step", 0.1, "Share of all heads pruned per step.", minimum=0.01, maximum=0.5),
        Option("prune_to", None, "Also remove heads physically down to K heads, save that model and time it (encoders only).", type=int, minimum=1),
        *IMPORTANCE,
        MAX_EXAMPLES.but(help="Evaluate on a seeded random subset of this size of the dev split, or of the --corpus's texts."),
        model=LM_MODEL,
        corpus=LM_CORPUS,
    )
    outputs = ("importance", "pruning")

    def findings(self, study, settings: dict) -> list[str]:
        from bertology.studies.heads.report import heads_within, worse_by

        metric, unpruned = next(iter(study.baseline.items()))
        lines = [f"{heads_within(study.pruning, metric, unpruned)} heads can be pruned before {metric} {worse_by(metric)}"]
        if study.pruned is not None:
            p = study.pruned
            lines.append(f"pruned to {p['heads_kept']} heads: {metric} {p['metric_pruned'][metric]:.4f}, {p['speedup']:.2f}x as fast; model: {p['model']}")
        return lines


class Patch(Study):
    name = "patch"
    title = ("Activation patching (denoising or noising) and attribution patching of every head on prompt pairs, each head's "
             "effect with a bootstrap interval and FDR (Wang et al. 2022; Nanda 2023).")
    libraries = ("bertology.studies.heads.patch_study", "transformers.modeling_utils")
    options = (
        MODEL[0].but(help="A causal language model, an encoder with its masked-LM head, or a sequence classifier (the bundled model has "
                          "no such head: give one)."),
        Option("pairs", None, 'JSON lines {"clean", "corrupt", "answer", "wrong"}: prompts of the same length, one-piece answers '
               "(a classifier's: two of its labels).", type=Path),
        Option("task", None, "A built-in pair set instead of --pairs: ioi, induction or agreement.", type=str),
        Option("n", None, "Distinct pairs of the built-in --task, drawn with --seed [default: 100].", type=int, minimum=1),
        Option("direction", "denoise", "denoise (clean z_h into the corrupted run) or noise (corrupted z_h into the clean run)."),
        Option("positions", "all", "all (z_h patched at every position at once) or each (also at each position alone; pairs of one length)."),
        Option("ablations", True, "Also zero and mean ablation and Michel's gradient importance on the clean prompts, and every method's "
               "rank agreement.", flag="--ablations/--no-ablations"),
        Option("bootstrap", 10000, "Bootstrap replicates over pairs (p is at least 2/(B+1)).", minimum=100),
        TESTS[0].but(help="Multiple-testing correction over heads (statsmodels)."),
        TESTS[1].but(help="Fewest distinct pairs a test needs: below it no p-value, no head that matters and no agreement are reported."),
        *pick(RUN, "out", "seed"), *pick(MODEL, "device"), *RAY, *pick(RUN, "quiet"),
    )
    outputs = ("patching", "patching_pairs", "rank_agreement", "pair_prompts")

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.core.storage.runfolder import check_out
        from bertology.studies.heads.patch_study import patch_heads

        s = dict(settings)
        if s["out"] is not None:
            check_out(s["out"], inputs=(s["pairs"], s["model"]))
        settings["out"] = s["out"] = s["out"] or default_out(self.name, s["model"], s["pairs"] or s["task"])
        return patch_heads(s["model"], s["pairs"], task=s["task"], n=s["n"], direction=s["direction"], positions=s["positions"], ablations=s["ablations"],
                           bootstrap=s["bootstrap"],
                           correction=s["correction"], min_sample=s["min_sample"], seed=s["seed"], device=s["device"], backend=s["backend"],
                           workers=s["workers"], address=s["address"], out=s["out"], progress=not s["quiet"], command=command)

    def summary(self, study, settings: dict) -> list[str]:
        lines = [f"{study.settings['n']} pairs of {study.source}: mean LD {study.ld_clean:.4f} clean, {study.ld_corrupt:.4f} corrupted "
                 f"({study.settings['direction']})"]
        for row in study.mattering().itertuples():
            lines.append(f"  head {row.layer}-{row.head} matters: effect {row.effect:+.3g} [{row.ci_low:+.3g}, {row.ci_high:+.3g}], "
                         f"change of LD {row.logit_diff_change:+.3g}, p_adj {row.p_adj:.3g}")
        agree = [f"{method} against exact patching: Spearman {a['spearman']:.3f}, top-{a['top_k']} recall {a['top_k_recall']:.2f}"
                 for method, a in study.agreement.items()]
        if len(study.rankings) > 1:
            low = study.rankings.sort_values("spearman").iloc[0]
            agree.append(f"least alike rankings: {low.method_a} and {low.method_b}, Spearman {low.spearman:.3f} (rank_agreement.csv)")
        return [*lines, f"{len(study.mattering())} heads matter (interval excludes 0, p_adj < 0.05)", *agree,
                f"report: {(Path(settings['out']) / 'report.html').resolve()}"]


register_study(Ablate())
register_study(Importance())
register_study(Prune())
register_study(Patch())
