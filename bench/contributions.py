"""The cost of each view of attention against the attention-only pass, in one process (issue 30): the default families'
analyzers that read the maps (profile, roles, patterns, rollout) over the first --sentences EWT test sentences, once per
view: ``attention`` (the baseline, run before and after the others, its mean the reference), ``norm`` (Kobayashi et al.
2020), ``alti`` (ALTI per head, Ferrando et al. 2022) and ``value-zeroing`` (per head, Mohebbi et al. 2023: the layer's
feed-forward rerun once per head and token). Then the mixing family's per-layer measures: the Kobayashi ratios alone
against the same with ALTI and with value zeroing (``--contributions``).

Value zeroing per head costs about ``heads x n`` reruns of each layer's feed-forward: --vz-sentences (default 100)
bounds its run, and its time is printed per sentence beside the others' so the ratio stands on the same footing.

--model takes another model, a decoder too (e.g. a ``bertology pretrain --causal`` checkpoint): there the mixing family
has no Kobayashi ratios, so the four families with its ALTI (or value zeroing) are set against the four families alone.

    .venv/bin/python bench/contributions.py [--model DIR] [--sentences 1000] [--vz-sentences 100] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

EWT = Path(__file__).resolve().parents[2] / "shared" / "data" / "ud_english_ewt" / "en_ewt-ud-test.conllu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder or hub name (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--vz-sentences", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    import torch

    from bertology.core.engine import Engine
    from bertology.core.model.kinds import DECODER
    from bertology.core.model.models import load_model
    from bertology.core.text.corpora import open_corpus
    from bertology.families import get_family
    from bertology.families.mixing.analyzer import ContextMixing

    examples, _ = open_corpus(EWT, "auto", args.sentences)
    examples = [example for example in examples]
    loaded = load_model(args.model, device=args.device)
    engine = Engine(loaded, progress=False)
    families = [get_family(name) for name in ("profile", "roles", "patterns", "rollout")]

    def analyzers():
        settings = {"seed": 0, "head_distance_sample": 0.1, "tau": 3.0, "role_window": 2, "correction": "fdr_bh", "alpha": 0.05,
                    "pattern_thresholds": None, "classifier": None}
        built = []
        for family in families:
            options = {option.name: option.default for option in family.options}
            built += list(family.analyzers({**options, **settings}, loaded.kind).values())
        return built

    def timed(view: str, corpus, extra=()) -> float:
        made = analyzers()
        started = time.perf_counter()
        engine.run(corpus, [*made, *extra], weightings=[view] * len(made) + ["attention"] * len(extra))
        return time.perf_counter() - started

    print(f"load average {os.getloadavg()[0]:.2f}; {loaded.name} on {args.device}, {len(examples)} EWT sentences; torch threads {torch.get_num_threads()}")
    timed("attention", examples[:32])  # warm-up
    first = timed("attention", examples)
    seconds = {view: timed(view, examples) for view in ("norm", "alti")}
    last = timed("attention", examples)
    baseline = (first + last) / 2
    print(f"attention (baseline): {first:.1f} s and {last:.1f} s, {baseline / len(examples) * 1000:.1f} ms a sentence")
    for view, value in seconds.items():
        print(f"{view:>14}: {value:7.1f} s  {value / len(examples) * 1000:8.1f} ms a sentence  ratio {value / baseline:6.2f}")
    few = examples[: args.vz_sentences]
    reference = timed("attention", few)
    zeroing = timed("value-zeroing", few)
    print(f"{'value-zeroing':>14}: {zeroing:7.1f} s on {len(few)} sentences, {zeroing / len(few) * 1000:8.1f} ms a sentence  "
          f"ratio {zeroing / reference:6.2f} (against attention on the same {len(few)}: {reference:.1f} s)")

    if loaded.kind is DECODER:  # no Kobayashi ratios on a decoder: the four families with the mixing family's measure against them alone
        alti = timed("attention", examples, [ContextMixing(loaded.kind, ("alti",))])
        print(f"mixing: the four families {baseline:.1f} s; with the mixing family's ALTI {alti:.1f} s (ratio {alti / baseline:.2f})")
        zeroing_few = timed("attention", few, [ContextMixing(loaded.kind, ("value_zeroing",))])
        print(f"mixing on {len(few)} sentences: the four families {reference:.1f} s; with the mixing family's value zeroing {zeroing_few:.1f} s "
              f"(ratio {zeroing_few / reference:.2f})")
        return

    def mixing(measures, corpus) -> float:
        started = time.perf_counter()
        engine.run(corpus, [ContextMixing(loaded.kind, measures)])
        return time.perf_counter() - started

    kobayashi = mixing((), examples)
    alti = mixing(("alti",), examples)
    print(f"mixing: Kobayashi ratios {kobayashi:.1f} s; with ALTI {alti:.1f} s (ratio {alti / kobayashi:.2f})")
    kobayashi_few = mixing((), few)
    zeroing_few = mixing(("value_zeroing",), few)
    print(f"mixing on {len(few)} sentences: Kobayashi ratios {kobayashi_few:.1f} s; with value zeroing {zeroing_few:.1f} s "
          f"(ratio {zeroing_few / kobayashi_few:.2f})")


if __name__ == "__main__":
    main()
