"""Layer-wise probes: how well each layer's word vectors predict a word's UPOS tag and dependency relation.

The Primer, sections 4-5; Hewitt & Liang 2019; Tenney et al. 2019; docs/methods.md#layer-probes.

Needs trees (CoNLL-U, or ``--parser spacy``). The word vectors of every layer come from the same forward pass as every
other analysis. Tables: ``layer_probes`` (``layer, task, accuracy, ci_low, ci_high, control_accuracy, selectivity,
majority, n_train, n_test``) and ``layer_probe_summary`` (per task: the best layer, the most selective one, and
``expected_layer_running_max``: Tenney et al.'s expected layer computed from one probe per layer, with the gains of the
running maximum of their accuracies in place of the gains of Tenney's cumulative probes; see
:mod:`bertology.families.layers.probes`). The control task keeps the case of word forms, as Hewitt & Liang's does
(``control_casefold=True`` merges ``The`` and ``the``). Figure: accuracy, control accuracy and selectivity by layer.
"""

from __future__ import annotations

from bertology.core.errors import BertologyError
from bertology.families import Family, FamilyResult, Option, register_family


def parse_tasks(text) -> tuple[str, ...]:
    from bertology.families.layers.probes import PROBE_TASKS

    tasks = tuple(part.strip() for part in (text.split(",") if isinstance(text, str) else text) if part.strip())
    unknown = [task for task in tasks if task not in PROBE_TASKS]
    if unknown or not tasks:
        raise BertologyError(f"--probe-tasks: unknown task {unknown[0] if unknown else text!r}; choose from {', '.join(PROBE_TASKS)}")
    return tasks


def kept_sentences(vectors, warnings: list[str], cap_flag: str) -> list:
    """The sentences a :class:`~bertology.families.layers.analyzer.WordVectors` kept, in order; a one-line error where too
    few (or too few labels) remain to probe, a warning where the cap ``cap_flag`` left some out."""
    sentences = vectors.ordered()
    if len(sentences) < 10:
        raise BertologyError(f"layer probes need at least 10 sentences whose words all kept their pieces, not {len(sentences)}")
    if vectors.capped:
        warnings.append(f"layer probes: kept the first {len(sentences)} of {vectors.seen} sentences ({cap_flag})")
    return sentences


class Layers(Family):
    name = "layers"
    title = "Linear probes of every layer's word vectors for UPOS and dependency labels, with control tasks (the Primer; Hewitt & Liang 2019)."
    needs_trees = True
    default = False
    weighted = False
    options = (
        Option("probe_tasks", "upos,deprel", "Probing tasks, comma-separated: upos (the word's tag), deprel (its relation to its head).",
               parse=parse_tasks),
        Option("layer_pooling", "first", "A word's vector: its first piece's (first) or the mean of its pieces (mean)."),
        Option("probe_sentences", 3000, "Most sentences whose vectors are kept (the first in the corpus); a message says when the cap is hit.",
               minimum=10),
        Option("probe_test_share", 0.2, "Share of the sentences held out to test the probes.", minimum=0.05, maximum=0.5),
        Option("probe_bootstrap", 1000, "Bootstrap replicates over test sentences for the accuracy's interval.", minimum=100),
        Option("control_casefold", False, "Control task: casefold word forms, so that 'The' and 'the' are one word type with one random label "
               "[default: forms as written, two types, as in Hewitt & Liang 2019].", flag="--control-casefold/--no-control-casefold"),
    )
    outputs = ("layer_probes", "layer_probe_summary")

    def prepare(self, settings):
        from bertology.families.layers.analyzer import POOLINGS

        settings["probe_tasks"] = parse_tasks(settings["probe_tasks"])
        if settings["layer_pooling"] not in POOLINGS:
            raise BertologyError(f"--layer-pooling must be first or mean, not {settings['layer_pooling']!r}")

    def analyzers(self, settings, kind):
        from bertology.families.layers.analyzer import WordVectors

        return {"vectors": WordVectors(settings["layer_pooling"], settings["probe_sentences"])}

    def finish(self, analyzers, context):
        from bertology.families.layers.probes import probe_layers, probe_summary

        settings = context.settings
        table = probe_layers(kept_sentences(analyzers["vectors"], context.warnings, "--probe-sentences"), settings["probe_tasks"],
                             test_share=settings["probe_test_share"], bootstrap=settings["probe_bootstrap"],
                             seed=settings["seed"], control_casefold=settings["control_casefold"], progress=context.progress)
        return FamilyResult(tables={"layer_probes": table, "layer_probe_summary": probe_summary(table)})

    def section(self, folder, result, settings):
        from bertology.families.layers.report import layers_section

        return layers_section(folder, result.tables["layer_probes"], result.tables["layer_probe_summary"])

    def summary(self, result):
        return [f"{row.task} probe: best layer {row.best_layer} (accuracy {row.best_accuracy:.3f}, selectivity {row.its_selectivity:.3f}); "
                f"most selective layer {row.most_selective_layer} ({row.selectivity:.3f}); "
                f"expected layer (running-max gains of one probe per layer) {row.expected_layer_running_max:.2f} "
                "(layers are hidden states: 0 the embeddings, l block l - 1's output)"
                for row in result.tables["layer_probe_summary"].itertuples()]

    def overview(self, result):
        return result.tables["layer_probe_summary"]

    def by_layer(self, result):
        table = result.tables["layer_probes"]
        return table.assign(quantity=table.task + " probe accuracy", value=table.accuracy)[["quantity", "layer", "value"]]


register_family(Layers())
