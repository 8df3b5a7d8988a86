"""Throughput and memory of the engine with the general profile, against a bare forward pass.

On the default model and the first 1,000 sentences of ../shared/data/ud_english_ewt/en_ewt-ud-test.conllu:
(a) a bare forward pass with SDPA attention and no attention returned, over the same batches;
(b) the engine with the general profile (and the head-distance analyzer at its default sample,
as ``bertology analyze`` runs them). Timed in one process, interleaved, best of --repeats.
Prints (b)/(a) (target: at most 1.3). Then peak memory (max RSS) of the engine for 250 and for
1,000 sentences, each in a fresh process (target: within 10% of each other).

    .venv/bin/python bench/throughput.py [--sentences 1000] [--repeats 3] [--device auto]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModel

from bertology.core.engine import Engine, RunStats
from bertology.core.model.models import default_model_path, load_model
from bertology.core.text.corpora import Corpus
from bertology.families.profile.analyzer import GeneralProfile, HeadDistance

EWT = Path(__file__).resolve().parents[2] / "shared" / "data" / "ud_english_ewt" / "en_ewt-ud-test.conllu"


def sentences(count: int):
    return list(itertools.islice(Corpus(EWT), count))


def bare_forward(sdpa_model, engine: Engine, batches) -> float:
    started = time.perf_counter()
    with torch.inference_mode():
        for items in batches:
            tensors = engine.collate(items)
            sdpa_model(input_ids=tensors["input_ids"], attention_mask=tensors["mask"].long(), token_type_ids=tensors["token_type_ids"])
    return time.perf_counter() - started


def engine_run(engine: Engine, examples, with_distance: bool) -> float:
    analyzers = [GeneralProfile(engine.model.kind)] + ([HeadDistance()] if with_distance else [])
    started = time.perf_counter()
    engine.run(examples, analyzers)
    return time.perf_counter() - started


def peak_memory(count: int, device: str) -> float:
    """Max RSS (MiB) of a fresh process that runs the engine with the general profile over ``count`` sentences."""
    code = (
        "import resource, sys; sys.path.insert(0, %r);"
        "from throughput import sentences; from bertology.core.model.models import load_model; from bertology.core.engine import Engine;"
        "from bertology.families.profile.analyzer import GeneralProfile, HeadDistance;"
        "examples = sentences(%d); model = load_model(None, device=%r);"
        "Engine(model, progress=False).run(examples, [GeneralProfile(model.kind), HeadDistance()]);"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    ) % (str(Path(__file__).parent), count, device)
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(output.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()

    examples = sentences(args.sentences)
    model = load_model(None, device=args.device)
    sdpa = AutoModel.from_pretrained(str(default_model_path()), attn_implementation="sdpa").to(model.device).eval()
    engine = Engine(model, batch_size=args.batch_size, progress=False)
    batches = list(engine.batches(engine.encode(enumerate(examples), RunStats())))
    tokens = sum(len(item) for batch in batches for item in batch)

    # warm-up
    bare_forward(sdpa, engine, batches[:2])
    engine_run(engine, examples[:64], with_distance=True)
    bare, profile, full = [], [], []
    for _ in range(args.repeats):
        bare.append(bare_forward(sdpa, engine, batches))
        profile.append(engine_run(engine, examples, with_distance=False))
        full.append(engine_run(engine, examples, with_distance=True))
    a, b_profile, b_full = min(bare), min(profile), min(full)
    figures = {
        "device": str(model.device),
        "sentences": len(examples),
        "tokens": tokens,
        "batches": len(batches),
        "bare_sdpa_seconds": round(a, 3),
        "engine_profile_seconds": round(b_profile, 3),
        "engine_profile_and_distance_seconds": round(b_full, 3),
        "ratio_profile_over_bare": round(b_profile / a, 3),
        "ratio_profile_and_distance_over_bare": round(b_full / a, 3),
    }
    print(f"(a) bare SDPA forward:                   {a:7.2f} s  ({len(examples) / a:6.1f} sentences/s)")
    print(f"(b) engine + general profile:            {b_profile:7.2f} s  ratio (b)/(a) = {b_profile / a:.3f}  (target <= 1.3)")
    print(f"(b') engine + profile + head distance:   {b_full:7.2f} s  ratio (b')/(a) = {b_full / a:.3f}")
    if not args.skip_memory:
        small, large = peak_memory(args.sentences // 4, args.device), peak_memory(args.sentences, args.device)
        figures.update(peak_rss_mib_quarter=round(small, 1), peak_rss_mib_full=round(large, 1), memory_ratio=round(large / small, 3))
        print(f"peak RSS, {args.sentences // 4} sentences: {small:7.1f} MiB; {args.sentences} sentences: {large:7.1f} MiB; "
              f"ratio {large / small:.3f} (target <= 1.10)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
