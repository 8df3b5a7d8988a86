"""Cost of the syntax analysis against the general profile alone, on the whole EWT test set.

Runs the engine over ../shared/data/ud_english_ewt/en_ewt-ud-test.conllu with the default model,
(a) with the general profile alone and (b) with the syntax analyzers (relation heads with the
sentence bootstrap, and the probe's data collection), interleaved in one process, best of
--repeats, and prints (b)/(a). Target: at most 1.5. The probe's training is timed separately.

    .venv/bin/python bench/syntax.py [--repeats 2] [--device auto]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bertology.core.engine import Engine
from bertology.core.model.models import load_model
from bertology.core.text.corpora import Corpus
from bertology.families.profile.analyzer import GeneralProfile
from bertology.families.syntax.analyzer import RelationHeads
from bertology.families.syntax.probes import ProbeData, cross_validate

EWT = Path(__file__).resolve().parents[2] / "shared" / "data" / "ud_english_ewt" / "en_ewt-ud-test.conllu"


def timed(engine: Engine, examples, analyzers) -> float:
    started = time.perf_counter()
    engine.run(examples, analyzers)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--probe-epochs", type=int, default=20)
    args = parser.parse_args()

    examples = list(Corpus(EWT))
    loaded = load_model(None, device=args.device)
    engine, kind = Engine(loaded, progress=False), loaded.kind
    timed(engine, examples[:64], [GeneralProfile(kind), RelationHeads(kind), ProbeData()])  # warm-up
    profile, syntax = [], []
    for _ in range(args.repeats):
        profile.append(timed(engine, examples, [GeneralProfile(kind)]))
        probe_data = ProbeData()
        syntax.append(timed(engine, examples, [RelationHeads(kind), probe_data]))
    a, b = min(profile), min(syntax)
    started = time.perf_counter()
    cross_validate(probe_data.ordered(), folds=5, epochs=args.probe_epochs)
    probe_seconds = time.perf_counter() - started
    print(f"(a) engine + general profile:           {a:7.2f} s  ({len(examples)} sentences)")
    print(f"(b) engine + relation heads + probe data: {b:7.2f} s  ratio (b)/(a) = {b / a:.3f}  (target <= 1.5)")
    print(f"probe training and evaluation, 5 folds x 2 variants: {probe_seconds:.1f} s")
    print(json.dumps({"sentences": len(examples), "profile_seconds": round(a, 3), "syntax_seconds": round(b, 3),
                      "ratio": round(b / a, 3), "probe_seconds": round(probe_seconds, 1)}))


if __name__ == "__main__":
    main()
