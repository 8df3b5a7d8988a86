"""Induction heads' phase change (Olsson et al. 2022), reproduced on this machine's CPUs end to end.

1. a training text where passages recur (:func:`repeated_passages`): each of the Gutenberg books cut into passages of
   ``--passage-words`` words, every passage written twice in a row, so that the second copy rewards copying what followed
   the same token earlier in the context (the induction heads' work);
2. ``bertology pretrain --causal`` of a small decoder (2 layers, 4 heads, hidden 128, context 128, byte-level BPE of 1024
   pieces, learning rate 3e-3, 2400 steps of 16 runs) with 41 evenly spaced (``--linear-checkpoints``) checkpoints;
3. ``bertology track`` over those checkpoints on held-out text with repeats, and on Olsson et al.'s synthetic probe
   (``--synthetic-repeats``): each head's induction score by step, the in-context learning score by step, and the verdict
   whether the two change in the same window.

    .venv/bin/python bench/induction_phase.py [--out /tmp/phase2] [--steps 2400] [--checkpoints 41] [--track-only]

Prints the commands it runs; the numbers land in OUT/run (pretraining) and OUT/track (the series and its report). On this
machine's two shared cores: about 16 minutes of pre-training (974 s) and 8 of track (41 checkpoints, 154 probe lines).

With ``--synthetic`` (issue 52, METHODS.md section 15), the synthetic recipe instead, end to end in minutes:

1. ``bertology pretrain --causal --synthetic repeats --attention-only``: 2 layers x 4 heads, hidden 64, no MLP, on sequences of
   64 random symbols (of 64) in which a segment of 6 to 24 symbols repeats at a random offset, half of each sequence repeated,
   ``--synthetic-steps`` steps of 32 at learning rate ``--synthetic-learning-rate``, 41 evenly spaced checkpoints;
2. ``bertology track`` over them on 200 fresh sequences of the same task (another seed), with its induction probe: the
   phase-change verdict, the induction head and its previous-token head, the in-context learning score and the loss bump;
3. the issue's checks, printed from OUT/track: the strongest head of layer 1 from at most 0.15 to at least 0.5, its 10-90%
   rise within a quarter of training, a previous-token head of layer 0 rising before or with it, the in-context learning
   score dropping in the same window, the verdict "supported", and no layer-0 head called an induction head.

    .venv/bin/python bench/induction_phase.py --synthetic --out DIR [--fixed-period P]

``--fixed-period P`` trains on a fixed period instead (a layer-0 head can then copy by position): the control, on which no
layer-0 head may be called an induction head.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

GUTENBERG = Path(__file__).resolve().parents[2] / "shared" / "data" / "gutenberg"


def _rounded(value, digits: int = 0):
    """A verdict's number as the bench prints it (None and words as they are)."""
    return round(value, digits) if isinstance(value, float) else value


def repeated_passages(book: Path, passage_words: int) -> str:
    """The book's text as paragraphs of one passage of ``passage_words`` words written twice: ``P P``, then the next."""
    words = re.sub(r"\s+", " ", book.read_text(encoding="utf-8", errors="replace")).split(" ")
    passages = [" ".join(words[i : i + passage_words]) for i in range(0, len(words) - passage_words + 1, passage_words)]
    return "\n\n".join(f"{passage} {passage}" for passage in passages) + "\n"


def held_out_lines(book: Path, passage_words: int, share: float, pairs_per_line: int) -> list[str]:
    """The last ``share`` of the book (what pre-training holds out for validation, 2% of its sentences) as lines of
    ``pairs_per_line`` repeated passages (``P P Q Q ...``): long enough for the in-context learning score's late token."""
    words = re.sub(r"\s+", " ", book.read_text(encoding="utf-8", errors="replace")).strip().split(" ")
    tail = words[int(len(words) * (1 - share)) :]
    passages = [" ".join(tail[i : i + passage_words]) for i in range(0, len(tail) - passage_words + 1, passage_words)]
    return [" ".join(f"{p} {p}" for p in passages[i : i + pairs_per_line])
            for i in range(0, len(passages) - pairs_per_line + 1, pairs_per_line)]


def write_corpus(folder: Path, passage_words: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for book in sorted(GUTENBERG.glob("*.txt")):
        (folder / book.name).write_text(repeated_passages(book, passage_words), encoding="utf-8")
    return folder


def run(command: list[str], env: dict | None = None) -> None:
    print("$", shlex.join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def synthetic_track_corpus(run_folder: Path, path: Path, count: int = 200) -> Path:
    """``count`` fresh sequences of the run's synthetic task (its settings, the next seed: none is a training or validation
    sequence's draw) as text, one a line, for ``track``'s corpus: its loss bump is measured on them."""
    from bertology.studies.pretrain.objectives import CAUSAL_LM
    from bertology.studies.pretrain.settings import PretrainSettings
    from bertology.studies.pretrain.symbols import synthetic_corpus

    recorded = json.loads((run_folder / "pretraining.json").read_text())["settings"]
    corpus = synthetic_corpus(PretrainSettings(**{**recorded, "seed": recorded["seed"] + 1}), CAUSAL_LM)
    path.write_text("\n".join(corpus.tokenizer.decode(ids) for ids in corpus.validation_ids[0][:count]) + "\n", encoding="utf-8")
    return path


def synthetic_checks(track: Path) -> list[str]:
    """The issue's checks on the synthetic run, from ``track``'s verdict and its heads named on the probe."""
    verdict = json.loads((track / "verdict.json").read_text())["induction"]
    named = pd.read_csv(track / "induction_probe.csv")
    layer1 = named[named.layer == 1].pivot_table(index="step", columns="head", values="induction")
    strongest = layer1.iloc[-1].idxmax()
    head, previous, drop = verdict.get("induction_head", {}), verdict.get("previous_token_head", {}), verdict.get("icl_drop", {})
    shallow = named[(named.layer == 0) & (named.role == "induction")]
    return [f"strongest layer-1 head 1-{strongest}: {layer1[strongest].iloc[0]:.3f} -> {layer1[strongest].iloc[-1]:.3f} (want <= 0.15 -> >= 0.5)",
            f"its 10-90% rise: steps {_rounded(head.get('window_start'))} to {_rounded(head.get('window_end'))}, bracketed "
            f"{_rounded(head.get('window_bracket_low'))}-{_rounded(head.get('window_bracket_high'))}, at most "
            f"{_rounded(head.get('window_span_share'), 3)} of training (want <= 0.25)",
            f"previous-token head {previous.get('layer')}-{previous.get('head')}: rises {previous.get('rises')}",
            f"in-context learning drop: changes {drop.get('changes')}, window {drop.get('window_low')}-{drop.get('window_high')} against the "
            f"head's {head.get('window_low')}-{head.get('window_high')}",
            f"loss bump: { {key: _rounded(value, 3) for key, value in (verdict.get('loss_bump') or {}).items()} }",
            f"layer-0 heads called induction heads at any checkpoint: {len(shallow)} (want 0); named at the last: "
            f"{[(h['layer'], h['head'], h['role']) for h in verdict.get('named_heads', [])]}",
            f"verdict: {verdict['verdict']}"]


def run_synthetic(args, bertology: str) -> None:
    """The synthetic recipe (the module's docstring): pre-training, track, and the issue's checks."""
    started = time.perf_counter()
    # one torch thread: a model this small gains nothing from a second, and on cores shared with other work a thread that
    # waits for its partner's time slice cost 36 times over (track of two checkpoints: 57 s with two threads, 1.6 s with one)
    single = {**os.environ, "OMP_NUM_THREADS": "1"}
    period = [] if args.fixed_period is None else ["--min-period", str(args.fixed_period), "--max-period", str(args.fixed_period)]
    if not args.track_only:
        run([bertology, "pretrain", "--causal", "--synthetic", "repeats", "--attention-only", "--out", str(args.out / "run"), "--layers", "2",
             "--heads", "4", "--hidden", "64", "--vocab-size", "64", "--max-length", "64", "--batch-size", "32", *period,
             "--learning-rate", str(args.synthetic_learning_rate), "--steps", str(args.synthetic_steps), "--checkpoints", "41",
             "--linear-checkpoints", "--quiet"], env=single)
    trained = time.perf_counter()
    corpus = synthetic_track_corpus(args.out / "run", args.out / "track_corpus.txt")
    run([bertology, "track", "--checkpoints", str(args.out / "run"), "--corpus", str(corpus), "--bootstrap", str(args.bootstrap),
         "--out", str(args.out / "track"), "--device", "cpu", "--quiet"], env=single)
    done = time.perf_counter()
    print(f"pre-training {trained - started:.0f} s, track {done - trained:.0f} s, in all {done - started:.0f} s", flush=True)
    print("\n".join(synthetic_checks(args.out / "track")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/phase2"))
    parser.add_argument("--passage-words", type=int, default=20)
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--checkpoints", type=int, default=41)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--corpus-only", action="store_true", help="Write the training text and stop.")
    parser.add_argument("--track-only", action="store_true", help="Skip pre-training: track the checkpoints already in OUT/run.")
    parser.add_argument("--synthetic", action="store_true", help="The synthetic recipe (issue 52) instead of the natural-text one.")
    parser.add_argument("--synthetic-steps", type=int, default=1500)
    parser.add_argument("--synthetic-learning-rate", type=float, default=3e-3)
    parser.add_argument("--fixed-period", type=int, default=None, help="With --synthetic: train on this period alone (the control).")
    parser.add_argument("--bootstrap", type=int, default=1000)
    args = parser.parse_args()
    bertology = str(Path(sys.executable).with_name("bertology"))
    if args.synthetic:
        run_synthetic(args, bertology)
        return
    corpus = write_corpus(args.out / "corpus", args.passage_words)
    probe = args.out / "track_corpus.txt"  # held-out text with repeats: the last 2% of each book, lines of 4 repeated passages
    probe.write_text("\n".join(line for book in sorted(GUTENBERG.glob("*.txt")) for line in held_out_lines(book, args.passage_words, 0.02, 4)) + "\n",
                     encoding="utf-8")
    if args.corpus_only:
        return
    if not args.track_only:
        run([bertology, "pretrain", str(corpus), "--causal", "--out", str(args.out / "run"), "--layers", "2", "--heads", "4", "--hidden", "128",
             "--vocab-size", str(args.vocab_size), "--max-length", str(args.max_length), "--batch-size", str(args.batch_size),
             "--learning-rate", str(args.learning_rate), "--steps", str(args.steps),
             "--checkpoints", str(args.checkpoints), "--linear-checkpoints", "--quiet"])
    # pre-training packs whole sentences into runs of at most --max-length pieces, so the last positions are seldom trained:
    # track reads 3/4 of the context, and the in-context learning score's late token is one the model has learnt to place
    run([bertology, "track", "--checkpoints", str(args.out / "run"), "--corpus", str(probe), "--max-length", str(args.max_length * 3 // 4),
         "--batch-size", "16",
         "--bootstrap", "1000", "--out", str(args.out / "track"), "--device", "cpu", "--quiet"])
    # Olsson et al.'s probe: 200 sequences of 50 random whole-word pieces repeated twice; the in-context score's late token (the
    # 100th) is in the repeat, its early one (the 10th) in the random first half
    run([bertology, "track", "--checkpoints", str(args.out / "run"), "--synthetic-repeats", "200", "--synthetic-length", "50",
         "--max-length", "100", "--batch-size", "16", "--bootstrap", "1000", "--out", str(args.out / "track-synthetic"), "--device", "cpu",
         "--quiet"])


if __name__ == "__main__":
    main()
