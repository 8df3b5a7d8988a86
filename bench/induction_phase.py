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
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

GUTENBERG = Path(__file__).resolve().parents[2] / "shared" / "data" / "gutenberg"


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


def run(command: list[str]) -> None:
    print("$", shlex.join(command), flush=True)
    subprocess.run(command, check=True)


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
    args = parser.parse_args()
    corpus = write_corpus(args.out / "corpus", args.passage_words)
    probe = args.out / "track_corpus.txt"  # held-out text with repeats: the last 2% of each book, lines of 4 repeated passages
    probe.write_text("\n".join(line for book in sorted(GUTENBERG.glob("*.txt")) for line in held_out_lines(book, args.passage_words, 0.02, 4)) + "\n",
                     encoding="utf-8")
    if args.corpus_only:
        return
    bertology = str(Path(sys.executable).with_name("bertology"))
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
