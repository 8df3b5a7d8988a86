"""Both views of attention in one run against one view (issue 17): ``bertology analyze --weighting attention,norm``
against ``--weighting attention`` on the first --sentences (default 1,000) EWT test sentences, as plain text.

Both runs are whole processes of the default families (profile, roles, patterns, rollout, mixing), figures and
report included, timed end to end as a user waits for them, interleaved (order alternating) --repeats times
after an untimed warm-up. Prints best and median of each, the ratio (target: both views at most 1.15x one view),
and, in-process, the pass alone as each manifest records it (``stats.seconds``: the one forward pass per batch,
the norms and the analyzers of every view).

    .venv/bin/python bench/weighting.py [--sentences 1000] [--repeats 3] [--device auto]

Look at the load average printed first: torch's threads slow down many times over when another job shares the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from whole_process import bertology_program, timed, write_sentences  # noqa: E402

TARGET = 1.15
VIEWS = {"one": "attention", "both": "attention,norm"}


def run(view: str, corpus: Path, out: Path, device: str) -> tuple[float, float | None, int]:
    """(whole-process seconds, the pass's seconds from the manifest, exit code) of one analyze run."""
    command = [bertology_program(), "analyze", "--corpus", str(corpus), "--out", str(out), "--quiet", "--device", device, "--weighting", VIEWS[view]]
    seconds, done = timed(command)
    manifest = out / "manifest.json"
    pass_seconds = json.loads(manifest.read_text())["stats"]["seconds"] if manifest.is_file() else None
    if done.returncode != 0:
        print(f"note: {view} exited {done.returncode}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    shutil.rmtree(out, ignore_errors=True)
    return seconds, pass_seconds, done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bertology-weighting-") as scratch:
        scratch = Path(scratch)
        corpus = scratch / "ewt-test.txt"
        count = write_sentences(args.sentences, corpus)
        print(f"{count} EWT test sentences; device {args.device}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
        small = scratch / "warm-up.txt"
        write_sentences(32, small)
        for view in VIEWS:
            run(view, small, scratch / "warm-up", args.device)
        wall = {view: [] for view in VIEWS}
        passes = {view: [] for view in VIEWS}
        for round_ in range(args.repeats):
            for view in (("one", "both") if round_ % 2 == 0 else ("both", "one")):
                seconds, pass_seconds, _ = run(view, corpus, scratch / f"run-{view}-{round_}", args.device)
                wall[view].append(seconds)
                if pass_seconds is not None:
                    passes[view].append(pass_seconds)
            print(f"round {round_ + 1}: one view {wall['one'][-1]:.2f} s, both views {wall['both'][-1]:.2f} s", flush=True)
    for view in VIEWS:
        print(f"--weighting {VIEWS[view]:<15} whole process: best {min(wall[view]):6.2f} s  median {statistics.median(wall[view]):6.2f} s"
              + (f"; the pass: median {statistics.median(passes[view]):6.2f} s" if passes[view] else ""))
    ratio_best = min(wall["both"]) / min(wall["one"])
    ratio_median = statistics.median(wall["both"]) / statistics.median(wall["one"])
    print(f"ratio both/one, whole process: best {ratio_best:.3f}  median {ratio_median:.3f}  (target <= {TARGET})")
    if passes["one"] and passes["both"]:
        print(f"ratio both/one, the pass alone: median {statistics.median(passes['both']) / statistics.median(passes['one']):.3f}")
    print(json.dumps({"sentences": count, "repeats": args.repeats, "ratio_best": round(ratio_best, 3), "ratio_median": round(ratio_median, 3),
                      "one_median_seconds": round(statistics.median(wall["one"]), 3), "both_median_seconds": round(statistics.median(wall["both"]), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
