"""Where the engine's one pass runs: here (``local``) or across a Ray cluster (``ray``), and how a long pass resumes.

A study asks :func:`backend_named` for ``--backend``'s object, :class:`LocalBackend` or :class:`RayBackend`, and uses its
one interface: ``run_pass`` (the engine's pass, as below) and ``map`` (independent jobs: track's checkpoints, patch's
shards of pairs).

``local``: :meth:`Engine.run` over the corpus in this process. ``ray``: the corpus is cut into shards of
``batch_size * sort_window`` examples (the engine's own windows, so that a shard forms the same batches as a local
run, unless ``overflow="skip"`` leaves examples out of a window); an :class:`ray.util.ActorPool` of :class:`PassWorker`
actors (one model each, loaded once, on its own
GPU where the cluster has GPUs) runs each shard through the engine with fresh analyzers and sends them back;
the driver folds them in with the analyzers' own ``merge``. Either way the run folder is written the same way,
and the tables agree to float rounding: analyzers pass the contract of :mod:`bertology.testing.analyzers`, and every
random draw is keyed by the sequence, never by the shard.

Resuming (:class:`Resume`): the merged analyzer states are saved into ``OUT/resume/`` (:mod:`bertology.core.storage.states`,
no pickle) at least every ``every_seconds`` or every ``every_batches`` batches: locally after a batch (the resumed
run forms the same windows and batches again, so its numbers are the uninterrupted run's to the bit), on Ray
whenever a shard has been merged. Started again with the same command, the run checks a fingerprint of the
model, corpus and settings, says it resumes, and skips what was counted.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import torch
from tqdm.auto import tqdm

from bertology.core.engine import Engine, PassSettings, RunStats
from bertology.core.errors import BertologyError, StateError, one_line_error
from bertology.core.model.finite import NonFiniteError
from bertology.core.storage import states
from bertology.core.storage.safeload import field, whole_number

BACKENDS = ("local", "ray")
#: Actors on a cluster without GPUs when --workers is not given (each loads its own model).
DEFAULT_CPU_ACTORS = 4
#: How often a resumable pass saves its states at the least.
CHECKPOINT_SECONDS = 30.0
#: How long the address of a cluster to join may take to answer (a silent one would otherwise hang for minutes).
CONNECT_SECONDS = 5.0
#: The port of a ``ray://host`` address that names none (Ray Client's).
RAY_CLIENT_PORT = 10001


def fingerprint(**facts) -> str:
    """sha256 of the facts (JSON, keys sorted) that must match for a run to resume another's states."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode("utf-8")).hexdigest()


class Resume:
    """An analysis's progress in ``out/resume/``: what it has counted (``progress``), its stats and its analyzers' states."""

    def __init__(self, out: str | Path, fingerprint: str, *, every_seconds: float = CHECKPOINT_SECONDS, every_batches: int | None = None):
        self.folder = Path(out) / "resume"
        self.fingerprint = fingerprint
        self.every_seconds = every_seconds
        self.every_batches = every_batches
        self._saved_at = time.monotonic()
        self._saved_batches = 0
        self._save_seconds = 0.0

    def load(self, analyzers: Sequence) -> tuple[dict, RunStats] | None:
        """Put the saved states into ``analyzers`` (in place, exactly) and return ``(progress, stats)``; None where nothing is saved."""
        if not self.folder.exists() and not self.folder.with_name("resume.old").exists():
            return None
        document, saved = states.load(self.folder)
        if document.get("fingerprint") != self.fingerprint:
            raise BertologyError(f"{self.folder}: an unfinished analysis with another model, corpus or settings (weights included) is saved "
                                 "there; run that command again to finish it, or give another --out (or delete that folder)")
        where = self.folder / "state.json"
        field(document, "progress", dict, where)
        stats, saved_analyzers = field(saved, "stats", RunStats, where), field(saved, "analyzers", list, where)
        try:
            states.check_like(stats, RunStats(), "the saved stats")
        except BertologyError as exc:
            raise StateError(where, str(exc)) from None
        for name in ("sequences", "tokens", "truncated", "skipped", "batches"):
            whole_number(getattr(stats, name), f"stats.{name}", where)
        if stats.seconds < 0 or not all(isinstance(s, str) for s in stats.skipped_sources):  # seconds: a finite number (check_like)
            raise StateError(where, "the saved stats are damaged (time or skipped sources)")
        if not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < len(analyzers) and isinstance(message, str)
                   for k, message in (*stats.failed.items(), *stats.left_out.items())):
            raise StateError(where, f"the saved stats name failed analyzers that are none of this run's {len(analyzers)}")
        if len(saved_analyzers) != len(analyzers) or any(type(a) is not type(b) for a, b in zip(saved_analyzers, analyzers)):
            raise BertologyError(f"{self.folder}: the saved analyzers do not match this run's; delete that folder to start over")
        try:
            for position, (analyzer, state) in enumerate(zip(analyzers, saved_analyzers)):
                states.check_like(state, analyzer, f"saved analyzer {position} ({type(analyzer).__name__})")
        except BertologyError as exc:
            raise StateError(where, f"{exc}; delete {self.folder} to start over") from None
        for analyzer, state in zip(analyzers, saved_analyzers):
            analyzer.__dict__.update(state.__dict__)
        self._saved_batches = stats.batches
        return document["progress"], stats

    def checked_local_progress(self, progress: dict, stats: RunStats, total: int | None, window_size: int) -> dict:
        """The saved position of a local pass, refused in one line unless every number is a whole number in its range
        (``window_size``: the examples of a window, ``batch_size * sort_window``; a window has at most that many batches, as
        the engine splits batches that would hold too many attention weights)."""
        where = self.folder / "state.json"
        window_start = whole_number(field(progress, "window_start", int, where), "window_start", where, high=total)
        whole_number(field(progress, "batches_done", int, where), "batches_done", where, high=window_size)
        whole_number(field(progress, "truncated_before", int, where), "truncated_before", where, high=stats.truncated)
        whole_number(field(progress, "skipped_before", int, where), "skipped_before", where, high=min(stats.skipped, window_start))
        whole_number(field(progress, "sources_before", int, where), "sources_before", where, high=len(stats.skipped_sources))
        whole_number(field(progress, "degenerate_before", int, where), "degenerate_before", where, high=min(stats.degenerate, window_start))
        if stats.seen > (total if total is not None else stats.seen):
            raise StateError(where, f"counts {stats.seen} examples, more than the corpus's {total}")
        return progress

    def checked_shards(self, progress: dict, shards: int | None) -> set[int]:
        """The shards a Ray pass had counted, refused in one line unless they are distinct whole numbers below ``shards``."""
        where = self.folder / "state.json"
        done = field(progress, "done", list, where)
        high = shards - 1 if shards is not None else None
        found = {whole_number(shard, "a shard number", where, high=high) for shard in done}
        if len(found) != len(done):
            raise StateError(where, "a shard is counted twice")
        return found

    def due(self, stats: RunStats) -> bool:
        if self.every_batches is not None:
            return stats.batches - self._saved_batches >= self.every_batches
        # At least every_seconds, and never more than a tenth of the time on saving (large states, such as a probe's).
        return time.monotonic() - self._saved_at >= max(self.every_seconds, 10 * self._save_seconds)

    def drop(self) -> None:
        """Delete the saved progress (and its previous copy): a pass that cannot finish with these settings leaves nothing to resume."""
        for folder in (self.folder, self.folder.with_name(self.folder.name + ".old")):
            shutil.rmtree(folder, ignore_errors=True)

    def save(self, progress: dict, stats: RunStats, analyzers: Sequence) -> None:
        began = time.monotonic()
        states.save(self.folder, {"fingerprint": self.fingerprint, "progress": progress}, {"stats": stats, "analyzers": list(analyzers)})
        self._saved_at, self._saved_batches = time.monotonic(), stats.batches
        self._save_seconds = self._saved_at - began


@dataclass
class PassPlan:
    """One pass: ``make_analyzers()`` builds a fresh list of the run's analyzers (each shard gets its own), ``weightings``
    the view each reads; ``spacy_pipeline`` parses plain text where the run wants spaCy trees (None: the examples have them)."""

    make_analyzers: Callable[[], list]
    weightings: list[str]
    spacy_pipeline: str | None = None
    parse: bool = False


def _stream(examples: Iterable, plan: PassPlan):
    if not plan.parse:
        return examples
    from bertology.core.text.parsing import spacy_trees

    return spacy_trees(examples, plan.spacy_pipeline)


def run_local(engine: Engine, examples: Iterable, plan: PassPlan, analyzers: list, *, total: int | None = None,
              resume: Resume | None = None) -> RunStats:
    """The pass in this process; with ``resume``, it goes on from saved states and saves its own after a batch whenever a save is due."""
    start, skip, stats = 0, 0, None
    if resume is not None and (loaded := resume.load(analyzers)) is not None:
        progress, stats = loaded
        if progress.get("backend") != "local":
            raise BertologyError(f"{resume.folder}: saved by a run on Ray: resume it with --backend ray, or delete that folder")
        progress = resume.checked_local_progress(progress, stats, total, engine.settings.window_size)
        print(f"resuming: {stats.seen} of {total if total is not None else '?'} examples were counted before "
              f"({resume.folder})", file=sys.stderr)
        # The current window is formed again from its first example: its truncations and skips are counted again.
        start, skip = progress["window_start"], progress["batches_done"]
        stats.truncated, stats.skipped, stats.degenerate = progress["truncated_before"], progress["skipped_before"], progress["degenerate_before"]
        stats.skipped_sources = stats.skipped_sources[: progress["sources_before"]]

    def checkpoint(stats: RunStats, position: dict) -> None:
        if resume.due(stats):
            resume.save({"backend": "local", **position}, stats, analyzers)

    stream = _stream(itertools.islice(examples, start, None), plan)
    try:
        return engine.run(stream, analyzers, total=total, isolate=True, weightings=plan.weightings, start=start, stats=stats, skip_batches=skip,
                          on_batch=checkpoint if resume is not None else None)
    except NonFiniteError:  # the same batch overflows again on resuming, and a run with another --dtype is refused its state
        if resume is not None:
            resume.drop()
        raise


class PassWorker:
    """A Ray actor: one model, loaded once, and an engine that runs shards of the corpus through fresh analyzers; ``settings``:
    the driver's engine's, whole (:class:`~bertology.core.engine.settings.PassSettings`, resolved there: the same cuts and
    attention budget), with the device as this actor sees it."""

    def __init__(self, model, settings: PassSettings, threads: int, compare_with=None):
        from bertology.core.model.hooks import register_attention
        from bertology.core.model.models import LoadedModel, load_model, resolve_device

        torch.set_num_threads(max(1, threads))
        register_attention()

        def engine(source) -> Engine:
            if isinstance(source, LoadedModel):  # shipped from the driver: onto this actor's device
                source.device = resolve_device(settings.device)
                source.model.to(source.device)
                loaded = source
            else:
                loaded = load_model(source, device=settings.device, trust_remote_code=settings.trust_remote_code)
            return Engine(loaded, settings, progress=False)

        self.engine = engine(model)
        if compare_with is not None:  # `compare`: the same batches through a second model
            from bertology.core.paired import CompareEngine

            self.engine = CompareEngine(self.engine, engine(compare_with))

    def run(self, shard: int, start: int, examples: list, plan: PassPlan) -> tuple[int, list, RunStats]:
        analyzers = plan.make_analyzers()
        stats = self.engine.run(_stream(examples, plan), analyzers, isolate=True, weightings=plan.weightings, start=start)
        return shard, analyzers, stats


@contextmanager
def _loopback_node():
    """Keep a node address of 127.0.0.1 while a local cluster starts, so that every Ray server binds to loopback.

    Ray turns 127.0.0.1 into the machine's own address (for other machines to join) unless clusters are off, as on
    Windows and macOS (``ray_constants.ENABLE_RAY_CLUSTER``); with that address gcs_server, the raylet and every worker
    listen on all interfaces and the agents on the machine's address. With 127.0.0.1 kept, each listens on 127.0.0.1 only."""
    from ray._private import ray_constants

    enabled = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled


def _answers(address: str) -> None:
    """Refuse in one line, within :data:`CONNECT_SECONDS`, a cluster ``address`` where nothing answers: ``auto`` with no
    cluster found, or a host and port (``ray://host:port`` too) that refuse or ignore a connection. The address is tried as
    ``ray.init`` dials it (``auto`` looked up, 127.0.0.1 made the machine's own address), which would otherwise retry for minutes."""
    try:
        if address.startswith("ray://"):
            parts = urlsplit(address)
            host, port = parts.hostname, parts.port or RAY_CLIENT_PORT
        else:
            from ray._private.services import canonicalize_bootstrap_address

            resolved = canonicalize_bootstrap_address(address)
            if resolved is None:  # RAY_ADDRESS=local
                raise ConnectionError("it names none")
            host, _, port = resolved.rpartition(":")
        if not host:
            raise ValueError("no host in it")
        port = int(port)
    except (ConnectionError, ValueError) as exc:  # no cluster found for auto, a malformed address
        raise BertologyError(f"--address {address}: no Ray cluster there ({one_line_error(exc)})") from None
    try:
        socket.create_connection((host.strip("[]"), port), timeout=CONNECT_SECONDS).close()
    except OSError as exc:  # refused, unreachable, unknown host, timed out
        raise BertologyError(f"--address {address}: no Ray cluster answers at {host}:{port} ({exc.strerror or 'timed out'}); start one, or leave "
                             "--address out to run a local cluster") from None


class _RayCluster:
    """Joins the cluster at ``address`` (refused in one line where nothing answers), or without one (or ``local``) starts a
    cluster of ``workers`` CPUs of its own here, every socket on 127.0.0.1 and no dashboard, that stops on the way out (a
    cluster found on this machine is not joined: that takes ``--address auto``)."""

    def __init__(self, workers: int | None, address: str | None):
        self.ray = require_ray()
        self.workers, self.address = workers, None if address == "local" else address

    def __enter__(self):
        self.started_here = not self.ray.is_initialized()
        if self.started_here and self.address:
            _answers(self.address)
            try:
                self.ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            except (ConnectionError, ValueError, RuntimeError, TimeoutError) as exc:  # answered, but not as a cluster that takes us
                raise BertologyError(f"--address {self.address}: cannot join the Ray cluster there ({one_line_error(exc)})") from None
        elif self.started_here:
            with _loopback_node():
                self.ray.init(address="local", num_cpus=self.workers or 2, include_dashboard=False, _node_ip_address="127.0.0.1",
                              log_to_driver=False, configure_logging=False)
        resources = self.ray.cluster_resources()
        self.gpus = resources.get("GPU", 0)
        self.actors = self.workers or max(1, int(self.gpus) or min(int(resources.get("CPU", 1)), DEFAULT_CPU_ACTORS))
        # One CPU each, so that an actor fits on any node; its torch threads take its share of the cluster's CPUs.
        self.threads = max(1, int(resources.get("CPU", 1)) // self.actors)
        self.per_actor = {"num_cpus": 1, "num_gpus": min(1.0, self.gpus / self.actors) if self.gpus else 0}
        return self

    def device(self, device: str) -> str:
        """The device an actor uses: ``cpu`` where asked for; otherwise ``auto``, its own GPU (Ray renumbers them as cuda:0)."""
        return "cpu" if device == "cpu" else "auto"

    def __exit__(self, *exc) -> None:
        if self.started_here:
            self.ray.shutdown()


def map_on_ray(function: Callable, jobs: Sequence[tuple], *, device: str = "auto", workers: int | None = None,
               address: str | None = None) -> Iterable[tuple[int, object]]:
    """Run ``function(*job, device)`` for every job as Ray tasks (one CPU each, or a GPU where the cluster has them; ``device``
    as an actor sees it, see :meth:`_RayCluster.device`); yields ``(index of the job, its result)`` as each finishes
    (``track``: one checkpoint per task)."""
    with _RayCluster(workers, address) as cluster:
        remote = cluster.ray.remote(function).options(**cluster.per_actor)
        running = {remote.remote(*job, cluster.device(device)): index for index, job in enumerate(jobs)}
        while running:
            (ready,), _ = cluster.ray.wait(list(running), num_returns=1)
            yield running.pop(ready), cluster.ray.get(ready)


def require_ray():
    """The ``ray`` module, or a one-line error that says how to install it."""
    try:
        import ray
    except ImportError:
        raise BertologyError("--backend ray needs Ray: pip install 'bertology[ray]'") from None
    return ray


def run_ray(engine: Engine, examples: Iterable, plan: PassPlan, analyzers: list, *, model, compare_with=None, workers: int | None = None,
            address: str | None = None, total: int | None = None, resume: Resume | None = None, progress: bool = True) -> RunStats:
    """The pass across a Ray cluster: ``address`` joins one (``auto``, ``ray://host:port``); otherwise a local one with
    ``workers`` CPUs starts here (on loopback) and stops at the end. ``model``: the name or folder each actor loads (or a
    loaded model, shipped once through the object store); ``compare_with``: a second model each actor runs the same
    batches through (``compare``). Each actor receives the engine's settings whole (their device as it sees it,
    :meth:`_RayCluster.device`). The driver merges each shard's analyzers into ``analyzers``."""
    with _RayCluster(workers, address) as cluster:
        from ray.util import ActorPool

        ray = cluster.ray
        def ship(source):  # a loaded model through the object store; a folder by its absolute path (which every node must see)
            if source is None or isinstance(source, (str, Path)):
                return str(Path(source).resolve()) if source is not None and Path(source).exists() else source
            return ray.put(source)

        shipped, shipped_other = ship(model), ship(compare_with)
        settings = replace(engine.settings, device=cluster.device(engine.settings.device))
        worker_class = ray.remote(PassWorker)
        pool = ActorPool([worker_class.options(**cluster.per_actor).remote(shipped, settings, cluster.threads, shipped_other)
                          for _ in range(cluster.actors)])

        stats, done = RunStats(), set()
        if resume is not None and (loaded := resume.load(analyzers)) is not None:
            progress_state, stats = loaded
            if progress_state.get("backend") != "ray":
                raise BertologyError(f"{resume.folder}: saved by a local run: resume it with --backend local, or delete that folder")
            done = resume.checked_shards(progress_state, -(-total // engine.settings.window_size) if total is not None else None)
            print(f"resuming: {len(done)} shards ({stats.seen} examples) were counted before ({resume.folder})", file=sys.stderr)
        began = time.perf_counter() - stats.seconds
        shard_size = engine.settings.window_size

        def fold(result) -> None:
            shard, shard_analyzers, shard_stats = result
            for position, (mine, theirs) in enumerate(zip(analyzers, shard_analyzers)):
                if position not in stats.dropped and position not in shard_stats.dropped:
                    mine.merge(theirs)
            stats.add(shard_stats)
            done.add(shard)
            stats.seconds = time.perf_counter() - began
            bar.update(stats.seen - bar.n)
            if resume is not None and resume.due(stats):
                resume.save({"backend": "ray", "done": sorted(done)}, stats, analyzers)

        iterator = iter(examples)
        with tqdm(total=total, initial=stats.seen, unit="seq", desc="analyzing (ray)", disable=not progress, smoothing=0.1) as bar:
            for shard in itertools.count():
                chunk = list(itertools.islice(iterator, shard_size))
                if not chunk:
                    break
                if shard in done:
                    continue
                while not pool.has_free():
                    fold(pool.get_next_unordered())
                pool.submit(lambda actor, job: actor.run.remote(*job), (shard, shard * shard_size, chunk, plan))
            while pool.has_next():
                fold(pool.get_next_unordered())
        if stats.dropped and len(stats.dropped) == len(analyzers):
            raise BertologyError("; ".join({**stats.failed, **stats.left_out}.values()))
        return stats


class LocalBackend:
    """``--backend local``: the pass, and any list of jobs, in this process."""

    name = "local"

    def run_pass(self, engine: Engine, examples: Iterable, plan: PassPlan, analyzers: list, *, model=None, compare_with=None,
                 total: int | None = None, resume: Resume | None = None) -> RunStats:
        """:func:`run_local` (``model`` and ``compare_with`` are the engine's already)."""
        return run_local(engine, examples, plan, analyzers, total=total, resume=resume)

    def map(self, function: Callable, jobs: Sequence[tuple], *, device: str = "auto") -> Iterable[tuple[int, object]]:
        """``function(*job, device)`` for every job, in order; yields ``(index of the job, its result)``."""
        for index, job in enumerate(jobs):
            yield index, function(*job, device)


@dataclass(frozen=True)
class RayBackend:
    """``--backend ray``: the pass in shards (:func:`run_ray`), jobs as Ray tasks (:func:`map_on_ray`), on ``workers`` actors
    of a local cluster started here, or on the cluster at ``address``."""

    workers: int | None = None
    address: str | None = None
    name = "ray"

    def run_pass(self, engine: Engine, examples: Iterable, plan: PassPlan, analyzers: list, *, model=None, compare_with=None,
                 total: int | None = None, resume: Resume | None = None) -> RunStats:
        """:func:`run_ray`: each actor loads ``model`` (and ``compare_with``) itself."""
        return run_ray(engine, examples, plan, analyzers, model=model, compare_with=compare_with, workers=self.workers, address=self.address,
                       total=total, resume=resume, progress=engine.progress)

    def map(self, function: Callable, jobs: Sequence[tuple], *, device: str = "auto") -> Iterable[tuple[int, object]]:
        """:func:`map_on_ray`: yields ``(index of the job, its result)`` as each finishes."""
        yield from map_on_ray(function, jobs, device=device, workers=self.workers, address=self.address)


def backend_named(name: str, workers: int | None = None, address: str | None = None) -> LocalBackend | RayBackend:
    """The backend ``--backend name`` asks for, checked in one line before anything loads: a known name, Ray installed for
    ``ray``, ``--workers`` and ``--address`` only with ``ray``."""
    if name not in BACKENDS:
        raise BertologyError(f"unknown backend {name!r}: use local or ray")
    if name == "ray":
        require_ray()
        return RayBackend(workers, address)
    if workers is not None or address is not None:
        raise BertologyError("--workers and --address go with --backend ray")
    return LocalBackend()
