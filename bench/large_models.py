"""Issue 40's benchmark: ``analyze`` on today's model shapes against the bare forward pass, whole processes.

A random Llama-shaped decoder (``--layers`` x ``--heads`` query heads, ``--kv-heads`` key-value heads, ``--hidden``; issue 40
names 32 x 32, 8, 1024 and a smaller 8 x 16, 4, 512) with a byte-level BPE trained here on Pride and Prejudice
(../shared/data/gutenberg/pg1342.txt), saved as a model folder; the corpus: ``--passages`` passages of the book, each
cut at ``--tokens`` pieces. Three processes, each timed end to end with its peak RSS (``os.wait4``), batch 1:

(a) ``bertology analyze --model M --corpus PASSAGES --max-length T --batch-size 1 --device D`` (default families);
(b) a bare eager forward that keeps no maps (``attn_implementation="eager"``, no ``output_attentions``);
(c) a bare SDPA forward.

Printed: analyze's pass (manifest ``phases.pass``) against (b)'s forward (target at most 1.5) and analyze's peak RSS
against (c)'s (target at most 1.3; 1.5 at 8,192 tokens), the phases analyze records, and a JSON line with every figure.
On a CUDA ``--device`` also each process's peak GPU memory (torch's allocator: the manifest's ``peak_device_memory`` for
analyze's pass), and analyze's against (c)'s: on a GPU the maps live in GPU memory, so that is the ratio the RSS one stands
for. ``--dtype`` loads the weights of all three in that precision (issue 40: ``--device cuda --dtype bfloat16``).

    .venv/bin/python bench/large_models.py [--layers 8] [--heads 16] [--kv-heads 4] [--hidden 512] [--tokens 1024]
                                           [--passages 4] [--threads 2] [--device cpu] [--dtype float32] [--book PATH]
                                           [--analyze-args "..."]

analyze runs with its default ``--attention-budget auto`` (issue 49: the smaller of 64 MiB and a sixteenth of the free
memory), so each layer's maps past it are computed by blocks of query rows; a family that needs whole maps is left out of the
run, and the benchmark names it (``--analyze-args "--attention-budget none"``: whole maps; ``BYTES``: another budget).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from whole_process import PYTHON, bertology_program, last_line, measured  # noqa: E402

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "gutenberg" / "pg1342.txt"
TARGETS = {"pass_ratio": 1.5, "rss_ratio": 1.3}


def mib(count: int | None) -> float | None:
    return None if count is None else round(count / 2**20, 1)


def build(args: argparse.Namespace, folder: Path) -> None:
    """The random model and its tokenizer in ``folder``, and the passages in ``folder / passages.txt``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    text = Path(args.book).read_text(encoding="utf-8")
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) > 20]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(paragraphs, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<s>", "</s>", "<pad>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         hidden_size=args.hidden, intermediate_size=2 * args.hidden, max_position_embeddings=max(4096, 2 * args.tokens),
                         vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    passages, current = [], []
    for paragraph in paragraphs[10:]:
        current.append(paragraph)
        joined = " ".join(current)
        if len(tokenizer(joined)["input_ids"]) >= args.tokens:
            passages.append(joined)
            current = []
            if len(passages) == args.passages:
                break
    (folder / "passages.txt").write_text("\n".join(passages) + "\n", encoding="utf-8")


def bare(args: argparse.Namespace) -> None:
    """(b) or (c): load, tokenize, one passage at a time, forward with no maps kept; prints its phases as JSON."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(args.threads)
    folder = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, attn_implementation=args.attention, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(args.device)
    texts = [line for line in (folder / "passages.txt").read_text(encoding="utf-8").splitlines() if line]
    started = time.perf_counter()
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, truncation=True, max_length=args.tokens, return_tensors="pt")["input_ids"].to(args.device)
            model(input_ids=ids)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(args.device) if args.device.startswith("cuda") else None
    print("BARE " + json.dumps({"forward_seconds": round(time.perf_counter() - started, 3), "passages": len(texts), "peak_device_bytes": peak}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--passages", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--book", default=str(BOOK), help="the text the tokenizer is trained on and the passages are cut from")
    parser.add_argument("--analyze-args", default="", help="extra options for bertology analyze, as one string")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "eager"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        bare(args)
        return 0
    if not Path(args.book).is_file():
        sys.exit(f"{args.book} is not there: this benchmark reads its passages from it")
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    os.environ.update(environment)
    figures: dict = {"shape": f"{args.layers} x {args.heads} heads ({args.kv_heads} kv), hidden {args.hidden}", "tokens": args.tokens,
                     "passages": args.passages, "device": args.device, "dtype": args.dtype, "threads": args.threads}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        build(args, folder)
        for attention in ("sdpa", "eager"):
            seconds, rss, done = measured([PYTHON, str(Path(__file__).resolve()), "--bare", "--model", str(folder), "--attention", attention,
                                           "--tokens", str(args.tokens), "--device", args.device, "--threads", str(args.threads), "--dtype", args.dtype])
            if done.returncode != 0:
                sys.exit(f"bare {attention} failed: {last_line(done.stderr)}")
            bare_figures = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("BARE "))[5:])
            figures[attention] = {"process_seconds": round(seconds, 1), "forward_seconds": bare_figures["forward_seconds"], "peak_rss_mib": round(rss),
                                  "peak_device_mib": mib(bare_figures["peak_device_bytes"])}
        out = Path(scratch) / "run"
        command = [bertology_program(), "analyze", "--model", str(folder), "--corpus", str(folder / "passages.txt"), "--out", str(out), "--quiet",
                   "--device", args.device, "--dtype", args.dtype, "--max-length", str(args.tokens), "--batch-size", "1", *shlex.split(args.analyze_args)]
        seconds, rss, done = measured(command)
        if not (out / "manifest.json").is_file():  # a family left out (past the attention budget) still writes the run folder
            sys.exit(f"analyze failed: {last_line(done.stderr)}")
        manifest = json.loads((out / "manifest.json").read_text())
        phases = manifest["phases"]
        device_peak = sum(manifest.get("peak_device_memory", {}).values()) or None
        figures["analyze"] = {"process_seconds": round(seconds, 1), "peak_rss_mib": round(rss), "peak_device_mib": mib(device_peak),
                              "phases": phases, "attention_budget": manifest["settings"].get("attention_budget"),
                              "left_out": manifest.get("left_out", {}), "failed": manifest.get("failures", {})}
    figures["pass_ratio"] = round(phases["pass"] / figures["eager"]["forward_seconds"], 2)
    figures["rss_ratio"] = round(figures["analyze"]["peak_rss_mib"] / figures["sdpa"]["peak_rss_mib"], 2)
    print(f"{figures['shape']}, {args.passages} passages of {args.tokens} tokens, {args.device}, {args.threads} threads")
    print(f"bare SDPA: forward {figures['sdpa']['forward_seconds']} s, process {figures['sdpa']['process_seconds']} s, "
          f"peak RSS {figures['sdpa']['peak_rss_mib']} MiB")
    print(f"bare eager (no maps kept): forward {figures['eager']['forward_seconds']} s, peak RSS {figures['eager']['peak_rss_mib']} MiB")
    print(f"analyze: pass {phases['pass']} s, process {figures['analyze']['process_seconds']} s, peak RSS {figures['analyze']['peak_rss_mib']} MiB, "
          f"attention budget {figures['analyze']['attention_budget']} bytes")
    if figures["analyze"]["peak_device_mib"] is not None:
        figures["device_memory_ratio"] = round(figures["analyze"]["peak_device_mib"] / figures["sdpa"]["peak_device_mib"], 2)
        print(f"peak GPU memory: SDPA {figures['sdpa']['peak_device_mib']} MiB, eager {figures['eager']['peak_device_mib']} MiB, "
              f"analyze's pass {figures['analyze']['peak_device_mib']} MiB: {figures['device_memory_ratio']} x SDPA's "
              f"(target {TARGETS['rss_ratio']})")
    print(f"pass / eager forward: {figures['pass_ratio']} (target {TARGETS['pass_ratio']}); "
          f"peak RSS / SDPA's: {figures['rss_ratio']} (target {TARGETS['rss_ratio']})")
    print("phases: " + ", ".join(f"{name} {value}" for name, value in phases.items()))
    for family, why in figures["analyze"]["left_out"].items():
        print(f"left out: {family}: {why}")
    for family, why in figures["analyze"]["failed"].items():
        print(f"failed: {family}: {why}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
