"""Issue 51's benchmark: exact activation patching of every head against the naive way, and attribution patching against
one forward pass, in one process.

A random GPT-2 (``--layers`` x ``--heads``, ``--hidden``) with a byte-level BPE trained here on Pride and Prejudice
(../shared/data/gutenberg/pg1342.txt), on ``--pairs`` pairs of the built-in ``induction`` set (``bertology patch --task
induction``). Per pair, interleaved, best of ``--repeats``:

(a) naive: the source run (recorded), the target run, then one full forward pass per head with its ``z_h`` patched;
(b) exact (:class:`~bertology.studies.heads.patching.Patcher`): the source run, the target run recorded layer by layer, then
    per layer one stacked pass from that layer on, a copy per head (checked against (a) to 1e-4);
(c) one forward pass of the target prompt;
(d) attribution (AtP): the target run's forward and backward pass (the source run is (b)'s, shared);
(e) attribution* (AtP* GradDrop): as (d), with one more backward pass per layer.

Printed: (d)/(c) (target at most 3) and (e)/(c), then, last, ``exact patching of every head / naive: R`` (R = (b)/(a),
target at most 0.6).

    .venv/bin/python bench/patching.py [--layers 6] [--heads 12] [--hidden 384] [--pairs 8] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "gutenberg" / "pg1342.txt"


def build(args: argparse.Namespace):
    """The random GPT-2 and its tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    paragraphs = [" ".join(p.split()) for p in Path(args.book).read_text(encoding="utf-8").split("\n\n") if p.strip()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(paragraphs, trainers.BpeTrainer(vocab_size=4000, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_head=args.heads, n_embd=args.hidden, vocab_size=len(tokenizer), n_positions=256,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return GPT2LMHeadModel(config).eval().to(args.device), tokenizer


def naive(patcher, pair) -> np.ndarray:
    """(a): one full forward pass per head, ``[layers, heads]``."""
    from bertology.studies.heads.patching import logit_difference

    _, z_source = patcher.source_run(pair)
    _, target = patcher._runs(pair)
    changes = np.empty((patcher.heads.num_layers, patcher.heads.num_heads))
    with torch.inference_mode():
        base = logit_difference(patcher.model(input_ids=target).logits, pair).double()
        for layer in range(patcher.heads.num_layers):
            for head in range(patcher.heads.num_heads):
                def patch(at: int, z: torch.Tensor, head=head, layer=layer) -> torch.Tensor:
                    z = z.clone()
                    z[:, :, head] = z_source[layer][:, :, head]
                    return z

                with patcher.heads.replaced(patch, layers=range(layer, layer + 1)):
                    changes[layer, head] = float(logit_difference(patcher.model(input_ids=target).logits, pair).double() - base)
    return changes


def exact(patcher, pair) -> np.ndarray:
    """(b): the source run, the target run recorded, the stacked passes."""
    _, z_source = patcher.source_run(pair)
    _, target = patcher._runs(pair)
    with torch.inference_mode(), patcher.replay.record() as hidden:
        patcher.model(input_ids=target)
    return patcher.exact(pair, z_source, hidden)


def forward(patcher, pair) -> None:
    """(c): one forward pass of the target prompt."""
    with torch.inference_mode():
        patcher.model(input_ids=patcher._runs(pair)[1])


def timed(work, pairs, arguments) -> tuple[float, list]:
    started = time.perf_counter()
    outputs = [work(pair, *argument) for pair, argument in zip(pairs, arguments)]
    return time.perf_counter() - started, outputs


def main() -> None:
    from bertology.core.model.kinds import DECODER
    from bertology.studies.heads.pair_tasks import task_pairs
    from bertology.studies.heads.patching import Patcher

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 6), ("heads", 12), ("hidden", 384), ("pairs", 8), ("repeats", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--book", default=str(BOOK))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = build(args)
    pairs = task_pairs("induction", tokenizer, DECODER, args.pairs, seed=0)
    patcher = Patcher(model)
    sources = [(patcher.source_run(pair)[1],) for pair in pairs]
    ways = {"naive": lambda pair: naive(patcher, pair), "exact": lambda pair: exact(patcher, pair), "forward": lambda pair: forward(patcher, pair),
            "attribution": lambda pair, z: patcher.target_run(pair, z, drop_gradients=False),
            "attribution*": lambda pair, z: patcher.target_run(pair, z, drop_gradients=True)}
    timed(ways["exact"], pairs[:1], [()])  # warm-up
    times, outputs = {name: [] for name in ways}, {}
    for _ in range(args.repeats):
        for name, work in ways.items():
            seconds, outputs[name] = timed(work, pairs, sources if name.startswith("attribution") else [()] * len(pairs))
            times[name].append(seconds)
    difference = max(float(np.abs(a - b).max()) for a, b in zip(outputs["exact"], outputs["naive"]))
    assert difference < 1e-4, f"exact patching differs from the naive way by {difference}"
    best = {name: min(values) for name, values in times.items()}
    heads = args.layers * args.heads
    print(f"{len(pairs)} induction pairs of {len(pairs[0].clean)} pieces, GPT-2 {args.layers} x {args.heads} heads, hidden {args.hidden}, "
          f"{args.device}, best of {args.repeats}; exact equals naive within {difference:.1e}")
    print(f"(a) naive, one forward per head ({heads} + 2 a pair): {best['naive']:7.2f} s")
    print(f"(b) exact, stacked from each layer on:           {best['exact']:7.2f} s")
    print(f"(c) one forward pass a pair:                      {best['forward']:7.3f} s")
    print(f"(d) attribution (AtP), forward + backward:        {best['attribution']:7.3f} s  (d)/(c) = {best['attribution'] / best['forward']:.2f} "
          "forward passes (target <= 3; the source run is (b)'s)")
    print(f"(e) attribution* (AtP* GradDrop):                 {best['attribution*']:7.3f} s  (e)/(c) = {best['attribution*'] / best['forward']:.2f}")
    print(json.dumps({"pairs": len(pairs), "pieces": len(pairs[0].clean), "heads": heads, **{f"{k}_seconds": round(v, 3) for k, v in best.items()},
                      "attribution_forwards": round(best["attribution"] / best["forward"], 2),
                      "attribution_star_forwards": round(best["attribution*"] / best["forward"], 2),
                      "exact_over_naive": round(best["exact"] / best["naive"], 3)}))
    print(f"exact patching of every head / naive: {best['exact'] / best['naive']:.3f}")


if __name__ == "__main__":
    main()
