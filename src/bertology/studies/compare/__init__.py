"""``bertology compare``: two models' attention on the same inputs, head by head, and what changed between them.

Kovaleva et al. 2019's per-head similarity, the change in profile and roles, and with trees layer by layer
(:func:`~bertology.studies.compare.comparison.compare`).
"""

from __future__ import annotations

from pathlib import Path

from bertology.core.options import CORPUS, MODEL, PASS_SETTINGS, RAY, RUN, Option, pick
from bertology.families import family_option
from bertology.studies import Study, default_out, model_label, register_study


class Compare(Study):
    name = "compare"
    libraries = ("bertology.studies.compare.comparison", "transformers.modeling_utils")
    title = ("Per-head similarity of two models' attention on the same inputs, what changed in profile and roles (Kovaleva et al.), "
             "and with trees layer by layer.")
    options = (
        Option("model_a", None, "Model A (hub name or folder; 'default' for the bundled all-MiniLM-L6-v2).", type=str, argument=True,
               required=True, reads_files=True),
        Option("model_b", None, "Model B, e.g. a folder written by `bertology finetune`.", type=str, argument=True, required=True, reads_files=True),
        CORPUS[0].but(help="Inputs both models see [default: the bundled sample corpus]."),
        *pick(CORPUS, "format"),
        RUN[0].but(help="Run folder [default: runs/compare-A-B-CORPUS-TIME]."),
        *pick(PASS_SETTINGS, "batch_size", "max_length"), *pick(CORPUS, "limit"), *pick(PASS_SETTINGS, "skip_long"),
        family_option("roles", "tau"),
        *pick(PASS_SETTINGS, "punct", "attention_budget"), *pick(RUN, "seed"), *pick(MODEL, "device", "trust_remote_code", "dtype"), *pick(RUN, "quiet"), *RAY,
        Option("layer_probes", None, "Probe every layer of both models for UPOS and relations [default: when the corpus is CoNLL-U].", type=bool,
               flag="--layer-probes/--no-layer-probes"),
        Option("probe_sentences", 1000, "Sentences the layer probes use (the first in the corpus).", minimum=10),
    )
    outputs = ("similarity", "similarity_by_layer", "profile_delta", "roles_delta")
    optional_outputs = ("layer_probes", "layer_comparison")

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.studies.compare.comparison import compare

        s = settings
        models = [None if m == "default" else m for m in (s["model_a"], s["model_b"])]
        s["out"] = s["out"] or default_out(self.name, "-".join(model_label(m) for m in models), s["corpus"])
        return compare(*models, s["corpus"], format=s["format"], out=s["out"], batch_size=s["batch_size"], max_length=s["max_length"],
                       limit=s["limit"], overflow="skip" if s["skip_long"] else "truncate", tau=s["tau"], punct=s["punct"], device=s["device"],
                       seed=s["seed"], trust_remote_code=s["trust_remote_code"], dtype=s["dtype"], attention_budget=s["attention_budget"],
                       progress=not s["quiet"], command=command,
                       backend=s["backend"], workers=s["workers"], address=s["address"], layer_probes=s["layer_probes"], probe_sentences=s["probe_sentences"])

    def summary(self, result, settings: dict) -> list[str]:
        layers = ", ".join(f"{int(r.layer)}: {r.cosine:.3f}" for r in result.similarity_layers.itertuples())
        lines = [f"{result.stats.sequences} sequences; mean cosine similarity per layer: {layers}"]
        lines += [f"warning: {warning}" for warning in result.warnings]
        if result.layer_comparison is not None:
            for task, rows in result.layer_comparison.groupby("task", sort=False):
                lines.append(f"{task} probe accuracy A -> B by layer: "
                             + ", ".join(f"{int(r.layer)}: {r.accuracy_a:.3f} -> {r.accuracy_b:.3f}" for r in rows.itertuples()))
        return [*lines, f"report: {(Path(settings['out']) / 'report.html').resolve()}"]


register_study(Compare())
