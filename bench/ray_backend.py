"""The Ray backend against the local one (issue 16), and what 1M sentences on 8 GPUs would cost.

Part 1, whole processes as a user waits for them: ``bertology analyze`` on the first --sentences (default 2,000)
sentences of the EWT test set (plain text: profile, roles, patterns, rollout, mixing; figures and report included)
with ``--backend local`` and with ``--backend ray --workers 2`` (a local Ray cluster started and stopped by the run:
its start-up is part of the time), interleaved --repeats times. Prints each median and the ratio ray/local.

Part 2, in-process measurements that feed the estimate:
- ``batch_seconds``: the local pass's seconds per batch (manifest ``stats``);
- ``merge_seconds``: the driver's cost to merge one shard's analyzers into its own (timed over the shards of a run
  of --sentences split in shards of 1,024 sentences, as the Ray backend cuts them);
- ``state_bytes``: the size of one shard's analyzer states as Ray ships them (cloudpickle, what the object store
  holds) and as a resume state (bertology.core.storage.states).

The estimate for N sentences (default 1M) on G GPUs (default 8), one actor per GPU:

    shards   = N / 1024
    compute  = N / batch_size * batch_seconds_gpu / G          (actors work in parallel)
    driver   = shards * (merge_seconds + state_bytes / bandwidth)  (the driver folds shards one at a time)
    total    ~ startup + max(compute, driver) + compute / shards (the last shard's tail)

``batch_seconds_gpu`` is this machine's CPU ``batch_seconds`` divided by --gpu-speedup (default 25, an assumption:
this machine has no GPU; measure it where you have one with ``--device cuda`` and --gpu-speedup 1). ``startup``:
Ray's start and one model load per actor, taken from part 1 (ray's time minus local's, plus the local model load).
``bandwidth``: --bandwidth bytes/s between actors and the driver (default 1e9, a 10 Gb/s network).

    .venv/bin/python bench/ray_backend.py [--sentences 2000] [--repeats 2] [--estimate-sentences 1000000] [--gpus 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from whole_process import bertology_program, timed, write_sentences  # noqa: E402

SHARD = 32 * 32  # batch_size * sort_window at the defaults: the Ray backend's shard


def whole(backend: str, corpus: Path, out: Path, device: str) -> tuple[float, dict]:
    command = [bertology_program(), "analyze", "--corpus", str(corpus), "--out", str(out), "--quiet", "--device", device, "--backend", backend]
    if backend == "ray":
        command += ["--workers", "2"]
    seconds, done = timed(command)
    if done.returncode != 0:
        print(f"note: {backend} exited {done.returncode}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").is_file() else {}
    shutil.rmtree(out, ignore_errors=True)
    return seconds, manifest.get("stats", {})


def in_process(corpus: Path, device: str) -> dict:
    """Per-batch cost, merge cost and state size, measured on shards as the Ray backend cuts them."""
    import cloudpickle

    import bertology
    from bertology.core.engine import Engine
    from bertology.core.model.models import load_model
    from bertology.core.storage import states
    from bertology.core.text.corpora import open_corpus
    from bertology.studies.analyze.choosing import choose_families, family_settings

    texts = corpus.read_text(encoding="utf-8").splitlines()
    started = time.perf_counter()
    loaded = load_model(None, device=device)
    load_seconds = time.perf_counter() - started
    examples, _ = open_corpus(texts, "auto", None)
    families = choose_families(None, (), (), False, False, "bench")
    settings = {"seed": 0, "punct": "upos", "correction": "fdr_bh", **family_settings(families, {})}
    engine = Engine(loaded, progress=False)
    shards, stats = [], []
    for begin in range(0, len(texts), SHARD):
        analyzers = [a for family in families for a in family.analyzers(settings, loaded.kind).values()]
        stats.append(engine.run(list(examples)[begin:begin + SHARD], analyzers, start=begin))
        shards.append(analyzers)
    merged = [a for family in families for a in family.analyzers(settings, loaded.kind).values()]
    started = time.perf_counter()
    for shard in shards:
        for mine, theirs in zip(merged, shard):
            mine.merge(theirs)
    merge_seconds = (time.perf_counter() - started) / len(shards)
    with tempfile.TemporaryDirectory() as scratch:
        states.save(Path(scratch) / "state", {}, {"analyzers": shards[0]})
        resume_bytes = sum(path.stat().st_size for path in (Path(scratch) / "state").iterdir())
    del bertology
    return {"load_seconds": load_seconds, "batch_seconds": sum(s.seconds for s in stats) / sum(s.batches for s in stats),
            "merge_seconds": merge_seconds, "state_bytes": len(cloudpickle.dumps(shards[0])), "resume_state_bytes": resume_bytes,
            "shards": len(shards)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--estimate-sentences", type=int, default=1_000_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-speedup", type=float, default=25.0)
    parser.add_argument("--bandwidth", type=float, default=1e9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bertology-ray-") as scratch:
        scratch = Path(scratch)
        corpus = scratch / "ewt.txt"
        count = write_sentences(args.sentences, corpus)
        print(f"{count} EWT test sentences; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
        small = scratch / "warm-up.txt"
        write_sentences(32, small)
        for backend in ("local", "ray"):
            whole(backend, small, scratch / "warm", args.device)
        times = {"local": [], "ray": []}
        for round_ in range(args.repeats):
            for backend in (("local", "ray") if round_ % 2 == 0 else ("ray", "local")):
                times[backend].append(whole(backend, corpus, scratch / f"run-{backend}", args.device)[0])
            print(f"round {round_ + 1}: local {times['local'][-1]:.2f} s, ray (2 workers) {times['ray'][-1]:.2f} s", flush=True)
        local, ray = statistics.median(times["local"]), statistics.median(times["ray"])
        print(f"whole process, median: local {local:.2f} s, ray with 2 workers {ray:.2f} s; ratio ray/local {ray / local:.3f}")
        measured = in_process(corpus, args.device)
    print("measured in-process: " + json.dumps({key: round(value, 6) if isinstance(value, float) else value for key, value in measured.items()}))

    n, gpus = args.estimate_sentences, args.gpus
    shards = n / SHARD
    batch_gpu = measured["batch_seconds"] / args.gpu_speedup
    compute = n / 32 * batch_gpu / gpus
    driver = shards * (measured["merge_seconds"] + measured["state_bytes"] / args.bandwidth)
    startup = max(0.0, ray - local) + measured["load_seconds"]
    total = startup + max(compute, driver) + compute / shards
    print(f"estimate for {n:,} sentences on {gpus} GPUs (GPU batch = CPU batch / {args.gpu_speedup:g}, an assumption): "
          f"{shards:.0f} shards; compute {compute / 60:.1f} min across the actors; driver merges {driver / 60:.2f} min "
          f"({measured['merge_seconds'] * 1000:.1f} ms and {measured['state_bytes'] / 1e6:.2f} MB a shard); start-up {startup:.0f} s; "
          f"total about {total / 60:.1f} min (one GPU: {(startup + compute * gpus) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
