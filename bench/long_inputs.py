"""The pass on long inputs against the bare forward pass, whole processes (issue 28).

The corpus: --passages (default 256) passages of about 300 words or more from ../shared/data/gutenberg/pg1342.txt
(Pride and Prejudice): paragraphs joined, in book order, until a passage has at least 300 words; the first ten
passages (front matter) are left out. Many exceed the model's 512 tokens and are truncated, as analyze does.
Three processes, run interleaved (order alternating) --repeats times, each timed end to end with its peak RSS
(``os.wait4``'s ``ru_maxrss``, the process alone):

(a) ``bertology analyze --corpus PASSAGES.txt --out TMP --quiet --device D`` with the default families;
(b) ``bench/whole_process.py --bare --attention eager``: the default model with eager attention and
    ``output_attentions=True``, the same batches as the engine makes, under ``torch.inference_mode()``;
(c) the same with SDPA attention and no maps (the model alone).

Printed: the pass (analyze's manifest ``phases.pass``) against (b)'s forward time, in the same round (target at
most 1.3, moonshot 1.1); analyze's peak RSS against (c)'s (target at most 1.3, moonshot 1.1); and (b)'s peak
against (c)'s, for scale. Best and median over rounds; the JSON line at the end has every figure.

    .venv/bin/python bench/long_inputs.py [--passages 256] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from whole_process import PYTHON, bertology_program, default_model, last_line, measured  # noqa: E402

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "gutenberg" / "pg1342.txt"
WORDS = 300
FRONT_MATTER = 10
TARGETS = {"pass_ratio": 1.3, "rss_ratio": 1.3}


def write_passages(count: int, path: Path) -> int:
    """The first ``count`` passages after the front matter (see the module docstring), one per line; returns how many."""
    paragraphs = [" ".join(block.split()) for block in re.split(r"\n\s*\n", BOOK.read_text(encoding="utf-8")) if block.strip()]
    passages, current = [], []
    for paragraph in paragraphs:
        current.append(paragraph)
        if sum(len(part.split()) for part in current) >= WORDS:
            passages.append(" ".join(current))
            current = []
    chosen = passages[FRONT_MATTER : FRONT_MATTER + count]
    path.write_text("\n".join(chosen) + "\n", encoding="utf-8")
    return len(chosen)


def run_analyze(args, corpus: Path, out: Path) -> dict:
    command = [bertology_program(), "analyze", "--corpus", str(corpus), "--out", str(out), "--quiet", "--device", args.device,
               *shlex.split(args.analyze_args)]
    seconds, rss, done = measured(command)
    manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").is_file() else {}
    subprocess.run(["rm", "-rf", str(out)], check=False)
    return {"exit": done.returncode, "error": last_line(done.stderr) if done.returncode else None, "seconds": seconds, "rss_mib": rss,
            "pass_seconds": manifest.get("phases", {}).get("pass"), "stats": manifest.get("stats", {})}


def run_bare(args, corpus: Path, model: str, attention: str) -> dict:
    command = [PYTHON, str(Path(__file__).resolve().parent / "whole_process.py"), "--bare", "--corpus", str(corpus), "--model", model,
               "--device", args.device, "--batch-size", "32", "--attention", attention]
    seconds, rss, done = measured(command)
    lines = [line for line in done.stdout.splitlines() if line.startswith("BARE ")]
    phases = json.loads(lines[-1][5:]) if lines else {}
    return {"exit": done.returncode, "error": last_line(done.stderr) if done.returncode else None, "seconds": seconds, "rss_mib": rss,
            "forward_seconds": phases.get("forward_seconds"), "phases": phases}


def spread(values: list[float]) -> str:
    return f"best {min(values):.3f}  median {statistics.median(values):.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--analyze-args", default="", help="extra options for bertology analyze, as one string")
    args = parser.parse_args()

    model = default_model()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bertology-long-") as scratch:
        scratch = Path(scratch)
        corpus = scratch / "passages.txt"
        count = write_passages(args.passages, corpus)
        words = len(corpus.read_text(encoding="utf-8").split())
        print(f"{count} passages of pg1342 ({words / count:.0f} words on average) -> {corpus.name}; device {args.device}; "
              f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}", flush=True)
        for round_ in range(args.repeats):
            steps = ("analyze", "eager", "sdpa") if round_ % 2 == 0 else ("sdpa", "eager", "analyze")
            runs = {}
            for step in steps:
                runs[step] = run_analyze(args, corpus, scratch / f"run-{round_}") if step == "analyze" else run_bare(args, corpus, model, step)
                if runs[step]["exit"]:
                    print(f"  {step} exited {runs[step]['exit']}: {runs[step]['error']}")
                    return 1
            analyze, eager, sdpa = runs["analyze"], runs["eager"], runs["sdpa"]
            ratios = {"pass_ratio": analyze["pass_seconds"] / eager["forward_seconds"], "rss_ratio": analyze["rss_mib"] / sdpa["rss_mib"],
                      "eager_rss_ratio": eager["rss_mib"] / sdpa["rss_mib"]}
            rounds.append({"runs": runs, "ratios": ratios})
            print(f"round {round_ + 1}: analyze pass {analyze['pass_seconds']:.1f} s (whole {analyze['seconds']:.1f} s, peak {analyze['rss_mib']:.0f} MiB); "
                  f"eager forward {eager['forward_seconds']:.1f} s (peak {eager['rss_mib']:.0f} MiB); "
                  f"SDPA forward {sdpa['phases'].get('forward_seconds', float('nan')):.1f} s (peak {sdpa['rss_mib']:.0f} MiB); "
                  f"pass/eager {ratios['pass_ratio']:.3f}, RSS analyze/SDPA {ratios['rss_ratio']:.3f}", flush=True)

    stats = rounds[-1]["runs"]["analyze"]["stats"]
    print(f"\n{stats.get('sequences')} sequences, {stats.get('tokens')} tokens, {stats.get('batches')} batches, {stats.get('truncated')} truncated")
    for key, label in (("pass_ratio", "analyze pass / bare eager forward"), ("rss_ratio", "analyze peak RSS / bare SDPA peak RSS"),
                       ("eager_rss_ratio", "bare eager peak RSS / bare SDPA peak RSS")):
        values = [r["ratios"][key] for r in rounds]
        target = f"  (target <= {TARGETS[key]})" if key in TARGETS else ""
        print(f"{label:45s} {spread(values)}{target}")
    figures = {"passages": count, "device": args.device, "repeats": args.repeats,
               **{f"{key}_{how}": round(fn([r["ratios"][key] for r in rounds]), 3)
                  for key in ("pass_ratio", "rss_ratio", "eager_rss_ratio") for how, fn in (("best", min), ("median", statistics.median))},
               "analyze_pass_seconds": [r["runs"]["analyze"]["pass_seconds"] for r in rounds],
               "eager_forward_seconds": [r["runs"]["eager"]["forward_seconds"] for r in rounds],
               "analyze_rss_mib": [round(r["runs"]["analyze"]["rss_mib"]) for r in rounds],
               "sdpa_rss_mib": [round(r["runs"]["sdpa"]["rss_mib"]) for r in rounds],
               "eager_rss_mib": [round(r["runs"]["eager"]["rss_mib"]) for r in rounds]}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
