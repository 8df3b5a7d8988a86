"""``bertology gradients``: [SEP] as a no-op, each layer's attention beside the loss's gradient on it.

Clark et al. 2019: attention to [SEP], [CLS] and punctuation beside the gradient of the loss with respect to it
(:func:`~bertology.studies.gradients.gradients.attention_gradients`); on a decoder, attention to the first token and
punctuation beside the gradient of the causal LM loss.
"""

from __future__ import annotations

from pathlib import Path

from bertology.core.options import CORPUS, MODEL, RUN, TASK_BATCHES, Option, pick
from bertology.studies import Study, default_out, register_study


class Gradients(Study):
    name = "gradients"
    libraries = ("bertology.studies.gradients.gradients", "transformers.modeling_utils")
    title = "[SEP] as a no-op (Clark et al. 2019): attention to [SEP], [CLS] and punctuation per layer beside the gradient of the loss w.r.t. it."
    options = (
        MODEL[0].but(help="A model with a masked-LM head, or a decoder (causal LM loss), by hub name or folder; or with --task a fine-tuned classifier."),
        CORPUS[0].but(help="Corpus file for the masked-LM or causal LM loss [default: the bundled sample corpus]."),
        Option("task", None, "GLUE task folder: use the classifier's loss on its dev split instead of the language-model loss.", type=Path),
        *pick(CORPUS, "format"),
        Option("mask_share", None, "Share of each sequence's pieces masked for the masked-LM loss (encoders only) [default: 0.15].", type=float,
               minimum=0.01, maximum=1.0),
        *pick(RUN, "out"), *pick(TASK_BATCHES, "batch_size"), *pick(CORPUS, "max_length", "limit", "punct"), *pick(RUN, "seed"),
        *pick(MODEL, "device", "trust_remote_code", "dtype"), *pick(RUN, "quiet"),
    )
    outputs = ("gradients",)

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.core.learning.tasks import load_task
        from bertology.core.storage.runfolder import check_out
        from bertology.studies.gradients.gradients import attention_gradients

        s = settings
        if s["out"] is not None:
            check_out(s["out"], inputs=(s["task"], s["corpus"], s["model"]))
        data = load_task(s["task"]) if s["task"] is not None else None
        s["out"] = s["out"] or default_out(self.name, s["model"], s["corpus"] or (data.name if data else None))
        return attention_gradients(s["model"], s["corpus"], task=data, format=s["format"], out=s["out"], batch_size=s["batch_size"],
                                   max_length=s["max_length"], limit=s["limit"], mask_share=s["mask_share"], punct=s["punct"], seed=s["seed"],
                                   device=s["device"], trust_remote_code=s["trust_remote_code"], dtype=s["dtype"], progress=not s["quiet"],
                                   command=command)

    def summary(self, study, settings: dict) -> list[str]:
        from bertology.core.engine import MIN_PIECES
        from bertology.studies.gradients.gradients import NO_OP_ANCHOR
        from bertology.studies.gradients.report import TARGET_TITLES

        table = study.gradients.set_index(["target", "layer"])
        target = NO_OP_ANCHOR[study.model["kind"]]  # the kind the run recorded: a decoder has no [SEP], its first token instead
        title, lines = TARGET_TITLES[target], []
        for layer in sorted(study.gradients.layer.unique()):
            row, every = table.loc[(target, layer)], table.loc[("all", layer)]
            lines.append(f"layer {layer}: attention to {title} {row.attention:.3f}, |dL/da| to {title} {row.gradient:.2e} (every token {every.gradient:.2e})")
        stats = study.stats
        lines.append(f"{stats.sequences} sequences ({stats.truncated} truncated, {stats.degenerate} of fewer than {MIN_PIECES} pieces skipped) "
                     f"in {stats.seconds:.1f} s")
        return [*lines, f"report: {(Path(settings['out']) / 'report.html').resolve()}"]


register_study(Gradients())
