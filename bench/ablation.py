"""Full leave-one-out (every head and every layer) with reuse against the naive way, in one process.

On 200 SST-2 dev examples with the default model fine-tuned on SST-2, times
(a) the naive way: one full forward pass per variant (78 for 6 x 12 heads), batch by batch;
(b) reuse of the layers below: the hidden state entering layer l is computed once per batch, and the
    13 variants of layer l run from there, stacked into one batch;
(c) as (b), with the last layer computed for the first token only (all the classifier reads).
(b) and (c) are checked against (a) to 1e-4. Interleaved, best of --repeats. Target: (c)/(a) <= 0.6.

    .venv/bin/python bench/ablation.py [--model runs/finetune-all-MiniLM-L6-v2-sst2] [--examples 200] [--repeats 2]

The fine-tuned model comes from
    bertology finetune ../shared/data/glue/SST-2 --max-train-examples 40000 --learning-rate 1e-4 --max-length 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bertology.core.learning.tasks import load_task, load_task_model
from bertology.studies.heads.ablation import LeaveOneOut

SST2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue" / "SST-2"


def timed(loo: LeaveOneOut, rows) -> tuple[float, np.ndarray]:
    started = time.perf_counter()
    _, variants = loo.predict(rows)
    return time.perf_counter() - started, variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/finetune-all-MiniLM-L6-v2-sst2")
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    if not Path(args.model).is_dir():
        raise SystemExit(f"{args.model}: no such model folder; fine-tune one first (see this file's docstring)")

    task_model = load_task_model(args.model, device=args.device, max_length=64)
    rows, _ = task_model.encode(load_task(SST2).dev[: args.examples], "dev.tsv")
    ways = {
        "naive": LeaveOneOut(task_model, batch_size=args.batch_size, reuse=False, progress=False),
        "reuse": LeaveOneOut(task_model, batch_size=args.batch_size, reuse=True, first_token_only=False, progress=False),
        "reuse+first": LeaveOneOut(task_model, batch_size=args.batch_size, reuse=True, progress=False),
    }
    timed(ways["reuse+first"], rows[:32])  # warm-up
    times, outputs = {name: [] for name in ways}, {}
    for _ in range(args.repeats):
        for name, way in ways.items():
            seconds, outputs[name] = timed(way, rows)
            times[name].append(seconds)
    for name in ("reuse", "reuse+first"):
        difference = float(np.abs(outputs[name] - outputs["naive"]).max())
        assert difference < 1e-4, f"{name} differs from the naive way by {difference}"
    best = {k: min(v) for k, v in times.items()}
    naive = ways["naive"]
    variants = len(naive.variants())
    print(f"{len(rows)} examples, {variants} variants ({task_model.num_layers} layers x ({task_model.num_heads} heads + whole layer)), best of {args.repeats}")
    print(f"(a) naive, one forward pass per variant:        {best['naive']:7.2f} s")
    print(f"(b) reuse of the layers below:                  {best['reuse']:7.2f} s  ratio (b)/(a) = {best['reuse'] / best['naive']:.3f}")
    print(f"(c) reuse + first token only in the last layer: {best['reuse+first']:7.2f} s  "
          f"ratio (c)/(a) = {best['reuse+first'] / best['naive']:.3f}  (target <= 0.6)")
    print(json.dumps({"examples": len(rows), "variants": variants, **{f"{k}_seconds": round(v, 2) for k, v in best.items()},
                      "ratio_reuse": round(best["reuse"] / best["naive"], 3), "ratio_reuse_first_token": round(best["reuse+first"] / best["naive"], 3)}))


if __name__ == "__main__":
    main()
