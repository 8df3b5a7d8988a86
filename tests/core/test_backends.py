"""Where the pass runs and how it survives an interruption (bertology.core.backends): Ray against local, merges over
many shards, kill-and-resume, and the safe state files it resumes from (bertology.core.storage.states)."""

import ipaddress
import os
import random
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
from conftest import TEXTS, tiny_examples
from test_cli import bertology as run_cli

import bertology
from bertology.core.backends import PassPlan, run_local
from bertology.core.engine import Engine
from bertology.core.errors import BertologyError
from bertology.core.model.kinds import ENCODER
from bertology.core.model.models import load_model
from bertology.core.storage import states
from bertology.core.text.parsing import spacy_trees
from bertology.families import registered
from bertology.families.profile.analyzer import GeneralProfile
from core.test_contract import CONTRACT_SETTINGS

TABLES = ("heads", "layers", "head_labels", "head_distance", "roles", "role_shares", "patterns", "patterns_by_layer", "rollout", "mixing",
          "syntax", "syntax_best", "syntax_baselines")


def _ewt(shared_data, count):
    """The first ``count`` sentences of the EWT test set as a CoNLL-U file of their own (trees and all)."""
    text = (shared_data / "ud_english_ewt" / "en_ewt-ud-test.conllu").read_text(encoding="utf-8")
    return "\n\n".join(text.split("\n\n")[:count]) + "\n\n"


def _same_tables(expected, actual, names=TABLES, exact=False):
    for name in names:
        a, b = expected.table(name), actual.table(name)
        if a is None and b is None:
            continue
        if exact:
            pd.testing.assert_frame_equal(a, b, check_exact=True, obj=name)
        else:
            # Within 1e-6, relative for large numbers: a Ray actor runs torch on its own CPU, and float32 products summed in
            # another order differ in the last bits, which a t statistic of -28277 turns into a difference of 0.006.
            pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-6, atol=1e-6, obj=name)


def _analyzers():
    """Every registered family's analyzers with a meaning on an encoder, as a run builds them."""
    built = []
    for family in registered().values():
        if family.fits(ENCODER) is not None:
            continue
        settings = {**{option.name: option.default for option in family.options}, **CONTRACT_SETTINGS}
        family.prepare(settings)
        built += list(family.analyzers(settings, ENCODER).values())
    return built


def test_seven_shards_merged_in_any_order_equal_one_pass(tiny_bert_dir):
    """What the Ray driver does, without Ray: shards run with their corpus offsets, merged in a shuffled order (in float64,
    as the contract test: float32's padding noise would be amplified by t statistics near zero)."""
    model = load_model(tiny_bert_dir, device="cpu")
    model.model.double()
    examples = list(spacy_trees(tiny_examples() * 3))
    engine = Engine(model, batch_size=2, progress=False)
    whole = _analyzers()
    engine.run(examples, whole)
    merged = _analyzers()
    bounds = [0, 3, 4, 9, 13, 20, 26, len(examples)]
    shards = list(zip(bounds, bounds[1:]))
    random.Random(0).shuffle(shards)
    for begin, end in shards:
        part = _analyzers()
        engine.run(examples[begin:end], part, start=begin)
        for mine, theirs in zip(merged, part):
            mine.merge(theirs)
    for expected, actual in zip(whole, merged):
        pd.testing.assert_frame_equal(expected.result(), actual.result(), check_exact=False, rtol=1e-5, atol=1e-6)


def _float64(folder):
    """A loaded model in float64, shipped to the actors as it is: a random tiny model's heads are so near uniform that float32
    rounding, which differs with the actors' thread counts, would move a t statistic of -25000 in its sixth digit."""
    model = load_model(folder, device="cpu")
    model.model.double()
    return model


def test_ray_tables_equal_local_ones_across_shards_and_workers(tiny_bert_dir, shared_data, tmp_path):
    pytest.importorskip("ray")
    corpus = tmp_path / "ewt.conllu"
    corpus.write_text(_ewt(shared_data, 90), encoding="utf-8")
    options = dict(batch_size=1, progress=False, view=False, bootstrap=200, weighting="attention,norm", probe=False,  # shards of 32 sentences: 3
                   include=["classes", "layers"], probe_bootstrap=200)
    model = _float64(tiny_bert_dir)
    local = bertology.analyze(model, corpus, out=tmp_path / "local", **options)
    on_ray = bertology.analyze(model, corpus, out=tmp_path / "ray", backend="ray", workers=2, **options)
    assert on_ray.stats.sequences == local.stats.sequences == 90 and on_ray.stats.batches == local.stats.batches
    _same_tables(local, on_ray)
    assert (tmp_path / "ray" / "report.html").is_file() and not (tmp_path / "ray" / "resume").exists()


def test_track_runs_one_checkpoint_per_ray_task(tiny_bert_dir, tmp_path):
    pytest.importorskip("ray")
    from bertology.studies.track.dynamics import track

    for name in ("step-0", "step-10"):
        shutil.copytree(tiny_bert_dir, tmp_path / name)
    checkpoints = [str(tmp_path / "step-0"), str(tmp_path / "step-10")]
    local = track(checkpoints, TEXTS, bootstrap=100, progress=False, device="cpu")
    on_ray = track(checkpoints, TEXTS, bootstrap=100, progress=False, device="cpu", backend="ray", workers=2, out=tmp_path / "run")
    assert on_ray.steps == local.steps == [0, 10]
    pd.testing.assert_frame_equal(local.table, on_ray.table, check_exact=False, rtol=1e-6, atol=1e-6)
    assert len(list((tmp_path / "run" / "parts").glob("*.npz"))) == 2 and (tmp_path / "run" / "report.html").is_file()


def test_backend_ray_without_ray_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails
    with pytest.raises(BertologyError, match=r"pip install 'bertology\[ray\]'"):
        bertology.analyze("no/such/model", ["a sentence."], backend="ray", progress=False)
    with pytest.raises(BertologyError, match="unknown backend"):
        bertology.analyze("no/such/model", ["a sentence."], backend="spark", progress=False)


# ---- the cluster: on loopback, or one that answers ----

def _on_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 is 127.0.0.1 on a dual-stack socket


def test_a_local_ray_cluster_listens_on_loopback_only():
    """Issue 37, case 5: gcs_server, the raylet and the workers listened on every interface (``*:PORT``), the agents on the
    machine's own address, though the cluster was said to be on loopback."""
    pytest.importorskip("ray")
    import psutil  # Ray brings its own

    from bertology.core.backends import _RayCluster

    driver = psutil.Process()
    before = {child.pid for child in driver.children(recursive=True)}
    with _RayCluster(workers=1, address=None) as cluster:
        worker = cluster.ray.get(cluster.ray.remote(lambda: os.getpid()).remote())  # a worker has started and run a task
        started = [child for child in driver.children(recursive=True) if child.pid not in before]
        names = {process.pid: process.name() for process in [driver, *started]}
        deadline = time.monotonic() + 30  # the agents open their ports a moment after the cluster is up
        while True:
            listening = [(c.laddr.ip, c.laddr.port, names[c.pid]) for c in psutil.net_connections(kind="inet")
                         if c.status == psutil.CONN_LISTEN and c.pid in names]
            listeners = {name for _, _, name in listening}
            if {"gcs_server", "raylet", names[worker]} <= listeners or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert {"gcs_server", "raylet", names[worker]} <= listeners, listening
    assert [(ip, port, name) for ip, port, name in listening if not _on_loopback(ip)] == []
    assert not cluster.ray.is_initialized()
    _, alive = psutil.wait_procs(started, timeout=30)
    assert alive == []  # stopped on the way out, every process of it


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


@pytest.fixture
def no_ray_cluster(monkeypatch):
    """This machine as one without a Ray cluster: another test's Ray, running beside this one, is not found by ``auto``."""
    pytest.importorskip("ray")
    from ray._private import services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}", "auto"])
def test_a_cluster_address_where_nothing_answers_fails_within_seconds_in_one_line(no_ray_cluster, address):
    """Issue 37, case 5: 127.0.0.1:PORT with nothing there dialled the machine's own address for minutes; auto with no
    cluster and a ray:// address that does not answer ended in tracebacks."""
    from bertology.core.backends import map_on_ray

    address = address.format(port=_free_port())
    began = time.monotonic()
    with pytest.raises(BertologyError) as error:
        next(map_on_ray(print, [("never run",)], device="cpu", address=address))
    assert time.monotonic() - began < 10
    assert str(error.value).startswith(f"--address {address}: no Ray cluster ") and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}", "auto"])
def test_a_cluster_address_where_nothing_answers_is_one_line_on_the_command_line(tiny_bert_dir, tmp_path, address):
    pytest.importorskip("ray")
    import psutil  # Ray brings its own

    if address == "auto" and (os.environ.get("RAY_ADDRESS") or any(p.info["name"] == "gcs_server" for p in psutil.process_iter(["name"]))):
        pytest.skip("a Ray cluster runs on this machine: auto would find it")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    address = address.format(port=_free_port())
    result = run_cli("analyze", "--model", tiny_bert_dir, "--corpus", corpus, "--backend", "ray", "--address", address, "--out", tmp_path / "run",
                     "--device", "cpu", "-q")
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: --address {address}: no Ray cluster "), line
    assert not (tmp_path / "run").exists()


# ---- resuming ----

def _interrupt_after(monkeypatch, batches):
    calls = {"n": 0}
    finish_batch = GeneralProfile.finish_batch  # the layer-by-layer pass ends each batch there

    def interrupted(self, batch):
        calls["n"] += 1
        if calls["n"] > batches:
            raise KeyboardInterrupt  # what Ctrl-C does in the middle of a pass
        return finish_batch(self, batch)

    monkeypatch.setattr(GeneralProfile, "finish_batch", interrupted)


def test_an_interrupted_analysis_resumes_and_ends_with_the_same_tables(tiny_bert_dir, tmp_path, monkeypatch, capsys):
    texts = [f"{text} number {k}." for k in range(9) for text in TEXTS]  # 72 sentences: windows of 2 x 32, the third cut short
    options = dict(batch_size=2, progress=False, view=False, head_distance_sample=0.5, checkpoint_every=3)
    uninterrupted = bertology.analyze(tiny_bert_dir, texts, out=tmp_path / "whole", **options)
    with monkeypatch.context() as patch:
        _interrupt_after(patch, 21)  # in the middle of the first window
        with pytest.raises(KeyboardInterrupt):
            bertology.analyze(tiny_bert_dir, texts, out=tmp_path / "run", **options)
    saved, _ = states.load(tmp_path / "run" / "resume")
    assert saved["progress"] == {"backend": "local", "window_start": 0, "batches_done": 21, "truncated_before": 0, "skipped_before": 0,
                                 "sources_before": 0, "degenerate_before": 0}
    with pytest.raises(BertologyError, match="another model, corpus or settings"):
        bertology.analyze(tiny_bert_dir, texts, out=tmp_path / "run", **{**options, "tau": 2.0})
    with monkeypatch.context() as patch:
        _interrupt_after(patch, 10)  # the resumed run is interrupted again, in the second window
        with pytest.raises(KeyboardInterrupt):
            bertology.analyze(tiny_bert_dir, texts, out=tmp_path / "run", **options)
    assert "resuming: 42 of 72 examples" in capsys.readouterr().err
    resumed = bertology.analyze(tiny_bert_dir, texts, out=tmp_path / "run", **options)
    assert "resuming: 60 of 72 examples" in capsys.readouterr().err
    _same_tables(uninterrupted, resumed, exact=True)
    assert resumed.stats.batches == uninterrupted.stats.batches and not (tmp_path / "run" / "resume").exists()


def test_a_real_kill_loses_only_the_batches_since_the_last_save(minilm, shared_data, tmp_path):
    """A whole `bertology analyze` process killed with SIGKILL, then the same command again."""
    corpus = tmp_path / "ewt.conllu"
    corpus.write_text(_ewt(shared_data, 160), encoding="utf-8")
    command = [sys.executable, "-m", "bertology.cli", "analyze", "--corpus", str(corpus), "--out", str(tmp_path / "run"), "--checkpoint-every", "1",
               "--batch-size", "4", "--no-syntax", "--quiet", "--device", "cpu"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    resume = tmp_path / "run" / "resume" / "state.json"
    import time

    deadline = time.monotonic() + 240
    while not resume.is_file() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    process.kill()
    process.wait()
    assert resume.is_file(), "the run saved no state before it was killed"
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "resuming:" in done.stderr
    whole = bertology.analyze(minilm, corpus, out=tmp_path / "whole", batch_size=4, progress=False, view=False, exclude=["syntax"])
    for name in ("heads", "roles", "patterns", "rollout", "mixing"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "run" / f"{name}.parquet"), whole.table(name), check_exact=False, atol=1e-9)


# ---- the state files ----

def test_every_analyzers_state_round_trips_exactly_without_pickle(tiny_bert, tmp_path):
    examples = list(spacy_trees(tiny_examples()))
    analyzers = _analyzers()
    Engine(tiny_bert, batch_size=3, progress=False).run(examples, analyzers)
    states.save(tmp_path / "state", {"note": "test"}, {"analyzers": analyzers})
    document, loaded = states.load(tmp_path / "state")
    assert document == {"note": "test"}
    for before, after in zip(analyzers, loaded["analyzers"]):
        assert type(before) is type(after)
        pd.testing.assert_frame_equal(before.result(), after.result(), check_exact=True)
    assert not (tmp_path / "state.partial").exists() and not (tmp_path / "state.old").exists()


def test_a_planted_class_or_pickle_in_a_state_is_refused(tmp_path):
    import json

    states.save(tmp_path / "state", {}, {"x": np.arange(3)})
    for planted in ("os:system", "subprocess:Popen", "bertology.core.errors:one_line_error",
                    "bertology.core.storage.states:torch.hub.tempfile._TemporaryFileCloser",  # a class reached through modules bertology imports
                    "bertology.core.storage.states:np.ndarray", "bertology.core.backends:RunStats.__class__"):
        (tmp_path / "state" / "state.json").write_text(json.dumps({"values": {"__object__": planted, "state": {"__dict__": []}}}))
        with pytest.raises(BertologyError, match="refused"):
            states.load(tmp_path / "state")
    states.save(tmp_path / "other", {}, {"x": np.arange(3)})
    with open(tmp_path / "other" / "arrays.npz", "wb") as handle:  # an object array, which only a pickle could hold
        np.savez(handle, a0=np.array([{"a": 1}], dtype=object))
    with pytest.raises(BertologyError, match="not a state"):
        states.load(tmp_path / "other")
    with pytest.raises(TypeError, match="without pickle"):
        states.save(tmp_path / "bad", {}, {"x": np.array([object()], dtype=object)})


def test_run_local_without_resume_is_the_engine_run(tiny_bert):
    examples = tiny_examples()
    plan = PassPlan(lambda: [GeneralProfile(ENCODER)], ["attention"])
    direct, through = GeneralProfile(ENCODER), GeneralProfile(ENCODER)
    Engine(tiny_bert, progress=False).run(examples, [direct])
    stats = run_local(Engine(tiny_bert, progress=False), examples, plan, [through], total=len(examples))
    assert stats.sequences == len(examples)
    pd.testing.assert_frame_equal(direct.result(), through.result(), check_exact=True)


def test_compare_on_ray_equals_compare_here(tiny_bert_dir, tmp_path):
    pytest.importorskip("ray")
    from bertology.studies.compare.comparison import compare

    changed = tmp_path / "changed"
    shutil.copytree(tiny_bert_dir, changed)
    from safetensors.torch import load_file, save_file

    weights = load_file(changed / "model.safetensors")
    weights = {name: tensor * 100 if "layer.1.attention.self.query" in name else tensor for name, tensor in weights.items()}
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    texts = [f"{text} number {k}." for k in range(5) for text in TEXTS]
    models = _float64(tiny_bert_dir), _float64(changed)
    local = compare(*models, texts, batch_size=1, progress=False, device="cpu")
    on_ray = compare(*models, texts, batch_size=1, progress=False, device="cpu", backend="ray", workers=2)
    assert on_ray.stats.sequences == local.stats.sequences == 40
    assert local.similarity_layers.cosine.iloc[1] < 0.999  # the changed layer changed
    for name in ("similarity", "similarity_layers", "profile_delta", "roles_delta"):
        pd.testing.assert_frame_equal(getattr(local, name), getattr(on_ray, name), check_exact=False, rtol=1e-6, atol=1e-6, obj=name)


def test_an_interrupted_ray_analysis_resumes_from_the_shards_it_merged(tiny_bert_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("ray")
    from bertology.core.engine import RunStats

    texts = [f"{text} number {k}." for k in range(12) for text in TEXTS]  # 96 sentences: 3 shards of 32 at batch size 1
    options = dict(batch_size=1, progress=False, view=False, backend="ray", workers=2, checkpoint_every=1)
    model = _float64(tiny_bert_dir)
    add = RunStats.add
    folded = {"n": 0}

    def interrupted(self, other):
        folded["n"] += 1
        if folded["n"] > 1:
            raise KeyboardInterrupt  # the driver stops after merging one shard
        return add(self, other)

    with monkeypatch.context() as patch:
        patch.setattr(RunStats, "add", interrupted)
        with pytest.raises(KeyboardInterrupt):
            bertology.analyze(model, texts, out=tmp_path / "run", **options)
    saved, _ = states.load(tmp_path / "run" / "resume")
    assert saved["progress"]["backend"] == "ray" and len(saved["progress"]["done"]) == 1
    with pytest.raises(BertologyError, match="resume it with --backend ray"):
        bertology.analyze(model, texts, out=tmp_path / "run", **{**options, "backend": "local", "workers": None})
    resumed = bertology.analyze(model, texts, out=tmp_path / "run", **options)
    assert "resuming: 1 shards (32 examples)" in capsys.readouterr().err
    local = bertology.analyze(model, texts, batch_size=1, progress=False, view=False)
    _same_tables(local, resumed, names=("heads", "roles", "patterns", "rollout", "mixing", "head_distance"))


def test_options_that_cannot_apply_are_refused_in_one_line(tmp_path):
    with pytest.raises(BertologyError, match="--workers and --address go with --backend ray"):
        bertology.analyze("no/such/model", ["a sentence."], workers=2, progress=False)
    with pytest.raises(BertologyError, match="--checkpoint-every saves into the run folder: give --out too"):
        bertology.analyze("no/such/model", ["a sentence."], checkpoint_every=5, progress=False)


def test_a_shard_reports_its_positions_in_the_whole_corpus(tiny_bert):
    """on_batch's window_start counts from the corpus's start, also for a shard that starts further in."""
    positions = []
    engine = Engine(tiny_bert, batch_size=1, sort_window=2, progress=False)
    engine.run(tiny_examples(), [GeneralProfile(ENCODER)], start=100, on_batch=lambda stats, position: positions.append(position["window_start"]))
    assert positions == [100, 100, 102, 102, 104, 104, 106, 106, 108, 108]


def test_in_memory_corpora_of_one_length_do_not_resume_each_other(tiny_bert_dir, tmp_path, monkeypatch):
    texts = [f"{text} number {k}." for k in range(9) for text in TEXTS]
    options = dict(batch_size=2, progress=False, view=False, checkpoint_every=3, analyses=["profile"])
    with monkeypatch.context() as patch:
        _interrupt_after(patch, 5)
        with pytest.raises(KeyboardInterrupt):
            bertology.analyze(tiny_bert_dir, texts, out=tmp_path / "run", **options)
    with pytest.raises(BertologyError, match="another model, corpus or settings"):
        bertology.analyze(tiny_bert_dir, [text.upper() for text in texts], out=tmp_path / "run", **options)
