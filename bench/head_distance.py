"""The head distance past its budget: the approximation over sampled rows against the exact distance (issue 40).

Clark et al. 2019, section 6: ``d(A, B) = sum_i JS(A_i, B_i)`` over the rows of the sampled sequences, per row. A random
BERT-shaped model of --layers x --heads (hidden 16 per head, weights drawn wider than BERT's 0.02 so that heads differ),
--sequences passages of Pride and Prejudice (../shared/data/gutenberg/pg1342.txt) cut at --tokens tokens, every sequence
sampled. In one pass, two head-distance analyzers read the same maps: the exact one (a budget no sequence exceeds) and
the default one (``--budget``, default ``HEAD_DISTANCE_BUDGET``), each timed inside its own ``update_layer`` and
``finish_batch``. Printed: both times and their ratio, the rows each kind of pair ran over, the largest number of values
the approximation held for the last layer against the exact one's, and the approximation's error against the exact
matrix over the pairs it approximates (the cross-layer pairs, and the within-layer ones where those too ran on
sampled rows): mean absolute error, that as a share of the mean distance, the
largest relative error and the correlation; over all pairs, the correlation of the two matrices and of the distances
between heads in the two MDS maps. The JSON line at the end has every figure.

    .venv/bin/python bench/head_distance.py [--layers 8] [--heads 16] [--tokens 512] [--sequences 1] [--budget 268435456] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy.spatial.distance import pdist
from transformers import AutoTokenizer, BertConfig, BertModel

from bertology.core.engine import Engine
from bertology.core.model.models import default_model_path, load_model
from bertology.core.text.corpora import Example
from bertology.families.profile import HEAD_DISTANCE_BUDGET
from bertology.families.profile.analyzer import SAMPLED_ROWS, HeadDistance

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "gutenberg" / "pg1342.txt"
FRONT_MATTER = 10  # paragraphs of front matter left out


class TimedHeadDistance(HeadDistance):
    """A head distance that counts its own seconds and the most values it holds for the last layer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds, self.held = 0.0, 0

    def update_layer(self, batch, maps):
        started = time.perf_counter()
        super().update_layer(batch, maps)
        self.seconds += time.perf_counter() - started

    def finish_batch(self, batch):
        self.held = max(self.held, sum(part.numel() for part in self._pending))
        started = time.perf_counter()
        super().finish_batch(batch)
        self.seconds += time.perf_counter() - started


def random_model(folder: Path, layers: int, heads: int, tokens: int):
    """A random BERT of ``layers`` x ``heads`` (16 dimensions per head) with the default model's tokenizer, loaded."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16 * heads, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=32 * heads, max_position_embeddings=tokens, initializer_range=0.2)
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_model(folder, device="cpu")


def passages(count: int, words: int) -> list[Example]:
    """The first ``count`` passages of at least ``words`` words after the front matter, paragraphs joined."""
    paragraphs = [" ".join(block.split()) for block in re.split(r"\n\s*\n", BOOK.read_text(encoding="utf-8")) if block.strip()]
    chosen, current = [], []
    for paragraph in paragraphs[FRONT_MATTER:]:
        current.append(paragraph)
        if sum(len(part.split()) for part in current) >= words:
            chosen.append(Example(" ".join(current), source=f"pg1342:{len(chosen) + 1}"))
            current = []
        if len(chosen) == count:
            break
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=1)
    parser.add_argument("--budget", type=int, default=HEAD_DISTANCE_BUDGET)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (one: timings that a loaded machine disturbs least)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        model = random_model(Path(scratch), args.layers, args.heads, args.tokens)
        exact = TimedHeadDistance(sample=1.0, budget=2**62)
        approximate = TimedHeadDistance(sample=1.0, budget=args.budget)
        started = time.perf_counter()
        Engine(model, batch_size=1, progress=False).run(passages(args.sequences, args.tokens), [exact, approximate])
        wall = time.perf_counter() - started
    truth, estimate = exact.matrix(), approximate.matrix()
    table = approximate.result()
    sampled = (table.method == SAMPLED_ROWS).to_numpy().reshape(truth.shape) & ~np.eye(len(truth), dtype=bool)
    upper = np.triu(np.ones_like(sampled), k=1)
    error = np.abs(estimate - truth)
    maps = [np.asarray(analyzer.embedding()[["x", "y"]]) for analyzer in (exact, approximate)]
    figures = {
        "shape": f"{args.layers}x{args.heads}", "tokens": args.tokens, "sequences": args.sequences, "budget": args.budget,
        "pass_s": round(wall, 1), "exact_s": round(exact.seconds, 1), "approximate_s": round(approximate.seconds, 1),
        "speedup": round(exact.seconds / approximate.seconds, 2),
        "rows": exact._rows, "within_layer_rows": approximate._within_rows, "cross_layer_rows": approximate._cross_rows,
        "held_values_exact": exact.held, "held_values_approximate": approximate.held,
        "approximated_pairs": int(sampled[upper].sum()),
        "mean_abs_error": float(error[sampled].mean()) if sampled.any() else 0.0,
        "mean_abs_error_share": float(error[sampled].mean() / truth[sampled].mean()) if sampled.any() else 0.0,
        "max_rel_error": float((error[sampled] / truth[sampled]).max()) if sampled.any() else 0.0,
        "correlation_approximated": float(np.corrcoef(estimate[sampled], truth[sampled])[0, 1]) if sampled.any() else 1.0,
        "correlation_all": float(np.corrcoef(estimate[upper], truth[upper])[0, 1]),
        "mds_distance_correlation": float(np.corrcoef(pdist(maps[0]), pdist(maps[1]))[0, 1]),
    }
    print(f"{figures['shape']} heads, {args.sequences} x {args.tokens} tokens, budget {args.budget:,} JS terms per sequence")
    print(f"time in the head distance: exact {figures['exact_s']} s, approximate {figures['approximate_s']} s: {figures['speedup']}x "
          f"(the whole pass with both: {figures['pass_s']} s)")
    print(f"rows: {figures['rows']} in all; the approximation ran {figures['within_layer_rows']} for the within-layer pairs, "
          f"{figures['cross_layer_rows']} for the cross-layer ones; values held for the last layer {figures['held_values_approximate']:,} "
          f"against {figures['held_values_exact']:,}")
    print(f"error over the {figures['approximated_pairs']} approximated pairs: mean absolute {figures['mean_abs_error']:.2e} nats "
          f"({figures['mean_abs_error_share']:.1%} of their mean), largest relative {figures['max_rel_error']:.1%}, "
          f"correlation {figures['correlation_approximated']:.4f}; all pairs: correlation {figures['correlation_all']:.4f}, "
          f"MDS map distances {figures['mds_distance_correlation']:.4f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
