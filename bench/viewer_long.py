"""The attention viewer on long decoder inputs (issue 29): page size, build time (``attention_view`` + save, median of
--repeats) and peak memory growth, at 128, 512 and 2,048 tokens, for a random GPT-2-shaped decoder built here
(--layers x --heads, hidden --hidden, a byte-level BPE trained on a Gutenberg book; no download).

The page keeps every weight up to 128 tokens and above that each row's top k keys (k = 20, lowered so that the maps fit
in ``MAP_BYTES``), so its size stays bounded whatever the length; the model runs layer by layer, so memory holds one
layer's maps. Printed per length: the page in MB against the bound, the build time, and k.

    .venv/bin/python bench/viewer_long.py [--layers 12] [--heads 12] [--hidden 96] [--lengths 128 512 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

SHARED_BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "gutenberg" / "pg1342.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=96)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from bertology.core.model.models import load_model
    from bertology.studies.pretrain.objectives import train_byte_level_bpe
    from bertology.studies.view.viewer import MAP_BYTES, attention_view

    text = SHARED_BOOK.read_text(encoding="utf-8")[:400_000] if SHARED_BOOK.is_file() else "the cat sat on the mat. " * 20_000
    folder = Path(tempfile.mkdtemp(prefix="bertology-viewer-long-"))
    tokenizer = train_byte_level_bpe(text.splitlines()[:5000], vocab_size=4000, max_length=max(args.lengths))
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_head=args.heads, n_embd=args.hidden, n_positions=max(args.lengths), vocab_size=len(tokenizer),
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(folder)
    loaded = load_model(folder, device="cpu")
    passage = " ".join(text.split())
    attention_view(passage, model=loaded, max_length=64)  # warm-up
    print(f"random GPT-2 shape, {args.layers} layers x {args.heads} heads, hidden {args.hidden}; map budget {MAP_BYTES / 2**20:.0f} MiB "
          f"(page bound about {4 / 3 * MAP_BYTES / 1e6:.1f} MB)")
    for n in args.lengths:
        times, path = [], folder / f"view-{n}.html"
        for _ in range(args.repeats):
            started = time.perf_counter()
            view = attention_view(passage, model=loaded, max_length=n)
            view.save(path)
            times.append(time.perf_counter() - started)
        print(f"{n:5d} tokens: page {path.stat().st_size / 1e6:6.2f} MB, k = {view.kept}, built in {statistics.median(times):6.2f} s "
              f"(median of {args.repeats})", flush=True)


if __name__ == "__main__":
    main()
