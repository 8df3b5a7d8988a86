"""The ``bertology`` command line. Every user error is printed as one line (``error: ...``), exit 2."""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
from pathlib import Path
from typing import Optional

import typer

from bertology.errors import BertologyError

app = typer.Typer(
    help="What every attention head of a BERT-like encoder does, and how sure we can be of it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ModelOption = typer.Option(None, "--model", "-m", help="Hub name or local folder [default: the bundled all-MiniLM-L6-v2].")
DeviceOption = typer.Option("auto", "--device", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps.")
TrustOption = typer.Option(False, "--trust-remote-code", help="Allow models that need their own code from the hub.")


def _default_out(model: str | None, corpus: Path | None) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model).name if model else "all-MiniLM-L6-v2")
    corpus_name = corpus.stem if corpus else "sample"
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"analyze-{name}-{corpus_name}-{stamp}"


@app.command()
def analyze(
    model: Optional[str] = ModelOption,
    corpus: Optional[Path] = typer.Option(None, "--corpus", "-c", help="Corpus file [default: the bundled sample corpus]."),
    format: str = typer.Option("auto", "--format", "-f", help="auto, text, pairs, glue or conllu."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run folder [default: runs/analyze-MODEL-CORPUS-TIME]."),
    batch_size: int = typer.Option(32, "--batch-size", min=1),
    max_length: Optional[int] = typer.Option(None, "--max-length", min=3, help="Most pieces per sequence [default: the model's]."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Use only the first N examples."),
    skip_long: bool = typer.Option(False, "--skip-long", help="Skip sequences over --max-length instead of truncating them."),
    head_distance_sample: float = typer.Option(0.1, "--head-distance-sample", min=0.0, max=1.0, help="Share of sequences used for the head-to-head JS distance."),
    seed: int = typer.Option(0, "--seed"),
    device: str = DeviceOption,
    trust_remote_code: bool = TrustOption,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Profile every head (Clark et al. 2019) and write a run folder with tables, figures and report.html."""
    from bertology.api import analyze as run_analysis

    out = out or _default_out(model, corpus)
    result = run_analysis(
        model,
        corpus,
        format=format,
        out=out,
        batch_size=batch_size,
        max_length=max_length,
        limit=limit,
        overflow="skip" if skip_long else "truncate",
        device=device,
        seed=seed,
        head_distance_sample=head_distance_sample,
        trust_remote_code=trust_remote_code,
        progress=not quiet,
        command=sys.argv,
    )
    stats = result.stats
    typer.echo(
        f"{stats.sequences} sequences ({stats.truncated} truncated, {stats.skipped} skipped as too long) "
        f"in {stats.seconds:.1f} s"
    )
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"report: {(result.out / 'report.html').resolve()}")


@app.command()
def info(
    model: Optional[str] = ModelOption,
    device: str = DeviceOption,
    trust_remote_code: bool = TrustOption,
) -> None:
    """Print the model's facts: architecture, layers, heads, special tokens, maximum length."""
    from bertology.models import load_model

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
