"""``bertology restore``: put layers of a fine-tuned model back to their pre-trained weights and evaluate the task.

Each layer alone, and the first k layers for every k (the Primer, section 6.3;
:func:`~bertology.studies.restore.restore.restore_layers`).
"""

from __future__ import annotations

from pathlib import Path

from bertology.core.options import CLASSIFIER, MODEL, RUN, TASK, TASK_BATCHES, TESTS, Option, pick
from bertology.studies import Study, default_out, read_task, register_study


class Restore(Study):
    name = "restore"
    libraries = ("bertology.studies.restore.restore", "transformers.modeling_utils")
    title = ("Put each layer of a fine-tuned model, and the first k layers, back to pre-trained weights and evaluate the task "
             "(the Primer, section 6.3).")
    options = (
        *pick(TASK, "task"), CLASSIFIER,
        Option("base", None, "The pre-trained model [default: the one `bertology finetune` recorded in the model folder].", type=str, reads_files=True),
        Option("max_dev_examples", None, "Evaluate on a seeded random subset of the dev split of this size.", type=int, minimum=1),
        Option("bootstrap", 10000, "Paired bootstrap replicates over dev examples.", minimum=100),
        TESTS[0].but(help="Multiple-testing correction within each kind of restoration (statsmodels)."),
        *pick(TESTS, "min_sample"), *pick(RUN, "out"), *pick(TASK, "train", "dev", "text_column", "text_pair_column", "label_column"),
        *TASK_BATCHES, *pick(RUN, "seed"), *pick(MODEL, "device", "trust_remote_code"), *pick(RUN, "quiet"),
    )
    outputs = ("restore",)

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.studies.restore.restore import restore_layers

        s = settings
        data = read_task(s, also=(s["base"],))
        s["out"] = s["out"] or default_out(self.name, s["model"], data.name)
        return data.name, restore_layers(s["model"], data, base=s["base"], max_dev_examples=s["max_dev_examples"], bootstrap=s["bootstrap"],
                                         correction=s["correction"], min_sample=s["min_sample"], batch_size=s["batch_size"],
                                         max_length=s["max_length"], seed=s["seed"], device=s["device"],
                                         trust_remote_code=s["trust_remote_code"], out=s["out"], progress=not s["quiet"], command=command)

    def summary(self, result, settings: dict) -> list[str]:
        task, study = result
        metric, fine_tuned = next(iter(study.fine_tuned.items()))
        lines = [f"warning: {warning}" for warning in study.warnings]
        lines.append(f"{task}: {study.examples} dev examples; fine-tuned {metric} {fine_tuned:.4f}")
        for kind, title in (("layer", "restored alone"), ("first_k", "restored with all below")):
            rows = study.restore[(study.restore.kind == kind) & (study.restore.metric == metric)]
            lines.append(f"{title}: " + ", ".join(f"{int(r.layer)}: {r.delta:+.3f}{'*' if r.p_adj < 0.05 else ''}" for r in rows.itertuples()))
        return [*lines, f"(* p_adj < 0.05; layer 0 = embeddings) report: {(Path(settings['out']) / 'report.html').resolve()}"]


register_study(Restore())
