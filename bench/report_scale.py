"""The report and the viewer at many heads (issue 40): ``analyze``'s ``report`` and ``viewer`` phases (manifest.json) for
random Llama-shaped decoders built here (no download), by default 8 x 32 = 256 and 32 x 32 = 1,024 heads, on a short
corpus (--sentences lines of the Gutenberg book in ../shared/data, or a made-up text without it, cut to --max-length
tokens). Each shape runs the default families (profile, roles, patterns, rollout, mixing) with their figures, report and
viewer, --repeats times; printed per shape: the median of each phase, and the report's largest figures.

    .venv/bin/python bench/report_scale.py [--shapes 8x32 32x32] [--sentences 40] [--max-length 32] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

SHARED_BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "gutenberg" / "pg1342.txt"


def corpus_lines(count: int) -> list[str]:
    """``count`` lines of the book (those of 8 to 40 words), or made-up sentences without it."""
    if SHARED_BOOK.is_file():
        text = " ".join(SHARED_BOOK.read_text(encoding="utf-8")[:300_000].split())
        lines = [line.strip() + "." for line in text.split(".") if 8 <= len(line.split()) <= 40]
        return lines[:count]
    return [f"the cat number {k} sat on the mat while the dog watched it from the door." for k in range(count)]


def random_llama(folder: Path, layers: int, heads: int, lines: list[str], head_dim: int = 8) -> Path:
    """A random Llama-shaped causal LM (``layers`` x ``heads``, every head its own keys and values) with a byte-level BPE
    trained on ``lines``, saved in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bertology.studies.pretrain.objectives import train_byte_level_bpe

    tokenizer = train_byte_level_bpe(lines * 4, vocab_size=1000, max_length=512)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    hidden = heads * head_dim
    config = LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, hidden_size=hidden,
                         intermediate_size=2 * hidden, max_position_embeddings=512, vocab_size=len(tokenizer),
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8x32", "32x32"], help="layers x heads of each model")
    parser.add_argument("--sentences", type=int, default=40)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    from bertology import analyze
    from bertology.core.model.models import load_model

    lines = corpus_lines(args.sentences)
    root = Path(tempfile.mkdtemp(prefix="bertology-report-scale-"))
    print(f"{len(lines)} sentences, at most {args.max_length} tokens each; phases in seconds (median of {args.repeats})")
    figures = {}
    for shape in args.shapes:
        layers, heads = (int(part) for part in shape.split("x"))
        loaded = load_model(random_llama(root / f"model-{shape}", layers, heads, lines), device="cpu")
        phases = []
        for repeat in range(args.repeats):
            out = root / f"run-{shape}-{repeat}"
            analyze(loaded, lines, out=out, max_length=args.max_length, progress=False)
            phases.append(json.loads((out / "manifest.json").read_text())["phases"])
        median = {name: statistics.median(run[name] for run in phases) for name in ("pass", "viewer", "report")}
        pngs = sorted(out.glob("*.png"), key=lambda path: path.stat().st_size, reverse=True)[:3]
        figures[shape] = {"heads": layers * heads, **median, "viewer_kib": round((out / "viewer.html").stat().st_size / 1024),
                          "report_kib": round((out / "report.html").stat().st_size / 1024)}
        print(f"{shape:>6} ({layers * heads:5d} heads): pass {median['pass']:6.2f}, viewer {median['viewer']:6.2f}, report {median['report']:6.2f}; "
              f"report.html {figures[shape]['report_kib']} KiB, viewer.html {figures[shape]['viewer_kib']} KiB; largest figures: "
              + ", ".join(f"{path.name} {path.stat().st_size // 1024} KiB" for path in pngs) + f"  ({out})", flush=True)
    print("JSON " + json.dumps(figures))


if __name__ == "__main__":
    main()
