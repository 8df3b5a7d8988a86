import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.stats
import torch
from conftest import TEXTS, write_books

from bertology.core.errors import BertologyError, StateError
from bertology.core.model.kinds import ENCODER
from bertology.core.text.corpora import Example
from bertology.studies.pretrain.pretraining import pretrain
from bertology.studies.track import dynamics
from bertology.studies.track.checkpoints import PROBE_TEXT, check_one_series, checkpoint_step, find_checkpoints, ordered_checkpoints, parse_steps
from bertology.studies.track.dynamics import track
from bertology.studies.track.hypothesis import depth_verdict, emergence_verdict, hypothesis_verdict
from bertology.studies.track.result import TRACK_COLUMNS
from bertology.studies.track.verdicts import crossing_steps
from studies.pretrain.test_pretraining import CAUSAL, SMALL


def test_checkpoint_steps_come_from_marker_files_or_names(tmp_path):
    assert checkpoint_step("google/multiberts-seed_0-step_20k") == 20000
    assert checkpoint_step("google/multiberts-seed_3-step_2000k") == 2_000_000
    assert checkpoint_step("runs/x/checkpoints/step-000150/") == 150
    assert checkpoint_step("bert-base-uncased") is None
    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "pretraining_step.json").write_text(json.dumps({"step": 777}))
    assert checkpoint_step(str(folder)) == 777


def test_checkpoints_are_ordered_by_step_and_must_tell_it(tmp_path):
    assert ordered_checkpoints(["a/step-100", "a/step-20", "a/step_3k"]) == [(20, "a/step-20"), (100, "a/step-100"), (3000, "a/step_3k")]
    assert ordered_checkpoints(["bert-base-uncased"]) == [(None, "bert-base-uncased")]
    with pytest.raises(BertologyError, match="bert-base-uncased: cannot tell its training step"):
        ordered_checkpoints(["a/step-100", "bert-base-uncased"])
    with pytest.raises(BertologyError, match="same training step"):
        ordered_checkpoints(["a/step-100", "b/step_100"])
    with pytest.raises(BertologyError, match="no model folders"):
        find_checkpoints(tmp_path)


@pytest.mark.parametrize("name, step", [
    ("runs/ft/checkpoint-500", 500),  # Hugging Face Trainer
    ("runs/ft/checkpoint-500/", 500),
    ("runs/pt/step-1500", 1500),
    ("ckpts/step_20k", 20000),
    ("google/multiberts-seed_0-step_20k", 20000),  # MultiBERTs
    ("pythia-70m/step1000", 1000),  # Pythia revisions, as folders
    ("pythia-70m/revision=step1000", 1000),
    ("runs/ft/checkpoint-final", None),
])
def test_checkpoint_step_from_every_naming_scheme(name, step):
    assert checkpoint_step(name) == step


def test_trainer_state_gives_the_step_and_wins_over_the_name(tmp_path):
    folder = tmp_path / "checkpoint-500"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 512, "epoch": 1.0}))
    assert checkpoint_step(str(folder)) == 512
    final = tmp_path / "final"
    final.mkdir()
    (final / "trainer_state.json").write_text(json.dumps({"global_step": 3000}))
    assert ordered_checkpoints([str(final), str(folder)]) == [(512, str(folder)), (3000, str(final))]


@pytest.mark.parametrize("marker, text, message", [
    ("pretraining_step.json", '{"step": 1.5}', "'step' must be int, not 1.5"),
    ("pretraining_step.json", '{"step": true}', "'step' must be int, not true"),
    ("pretraining_step.json", '{"step": -3}', "step = -3 is out of range (it must be from 0 to 9223372036854775807)"),
    ("pretraining_step.json", '{"step": 1e400}', "not valid JSON (1e400 is too large for a number)"),
    ("pretraining_step.json", '{"step": 99999999999999999999999}', "step = 99999999999999999999999 is out of range"),
    ("pretraining_step.json", '{"step": NaN}', "not valid JSON (NaN is not a JSON number)"),
    ("trainer_state.json", '{"global_step": "12"}', "'global_step' must be int, not \"12\""),
    ("trainer_state.json", '{"epoch": 1.0}', "missing key 'global_step'"),
    ("trainer_state.json", "[" * 100_000, "JSON nested deeper than 64 levels"),
    ("trainer_state.json", "[512]", "expected a JSON object, found list"),
])
def test_a_step_file_without_a_whole_number_step_is_refused_in_one_line(tmp_path, marker, text, message):
    """A float, a bool, a negative or a string step was once truncated or believed; 1e400 and deep nesting gave a traceback."""
    folder = tmp_path / "checkpoint-500"
    folder.mkdir()
    (folder / marker).write_text(text)
    with pytest.raises(StateError) as error:
        checkpoint_step(str(folder))
    assert str(error.value).startswith(f"{folder / marker}: ") and message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("text", ["²", "1" * 5000, "99999999999999999999"])
def test_steps_refuse_what_is_no_step(text):
    with pytest.raises(BertologyError, match="is not a whole number of steps"):
        parse_steps(text)


def test_explicit_steps_go_with_the_checkpoints_in_order():
    assert parse_steps("30, 10,20") == [30, 10, 20]
    assert ordered_checkpoints(["a", "b", "c"], steps=[30, 10, 20]) == [(10, "b"), (20, "c"), (30, "a")]
    assert ordered_checkpoints(["x/step-5", "y/step-9"], steps=[9, 5]) == [(5, "y/step-9"), (9, "x/step-5")]  # given steps win over names
    with pytest.raises(BertologyError, match=r"^--steps: 2 given for 3 checkpoints; give one step per checkpoint, in the same order$"):
        ordered_checkpoints(["a", "b", "c"], steps=[1, 2])
    with pytest.raises(BertologyError, match=r"^--steps: 'ten' is not a whole number of steps \(give e.g. --steps 0,500,1000\)$"):
        parse_steps("0,ten")
    with pytest.raises(BertologyError, match="same training step"):
        ordered_checkpoints(["a", "b"], steps=[7, 7])


def test_track_command_reads_trainer_checkpoints_and_explicit_steps(tiny_bert_dir, tmp_path):
    import shutil

    from test_cli import bertology

    corpus = tmp_path / "tiny.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    trainer = tmp_path / "trainer-out"
    for step in (500, 1000):
        shutil.copytree(tiny_bert_dir, trainer / f"checkpoint-{step}")
    (trainer / "checkpoint-1000" / "trainer_state.json").write_text(json.dumps({"global_step": 1000}))
    result = bertology("track", "--checkpoints", trainer, "--corpus", corpus, "--bootstrap", 100, "--out", tmp_path / "t1", "--device", "cpu", "-q")
    assert result.returncode == 0, result.stderr
    assert sorted(pd.read_csv(tmp_path / "t1" / "track.csv").step.unique()) == [500, 1000]

    a, b = tmp_path / "model-a", tmp_path / "model-b"
    shutil.copytree(tiny_bert_dir, a)
    shutil.copytree(tiny_bert_dir, b)
    result = bertology("track", b, a, "--steps", "200,0", "--corpus", corpus, "--bootstrap", 100, "--out", tmp_path / "t2", "--device", "cpu", "-q")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "t2" / "manifest.json").read_text())
    assert manifest["checkpoints"] == [{"step": 0, "checkpoint": str(a)}, {"step": 200, "checkpoint": str(b)}]

    wrong = bertology("track", a, b, "--steps", "0", "--corpus", corpus, "--out", tmp_path / "t3")
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
    assert wrong.stderr.strip().splitlines() == ["error: --steps: 1 given for 2 checkpoints; give one step per checkpoint, in the same order"]
    with_folder = bertology("track", "--checkpoints", trainer, "--steps", "1,2", "--corpus", corpus, "--out", tmp_path / "t4")
    assert with_folder.returncode == 2
    assert with_folder.stderr.strip().splitlines() == [
        "error: --steps goes with checkpoints given as arguments (one step each, in the same order), not with --checkpoints DIR"]


def replicates(data: np.ndarray, noise: float, count: int = 400, seed: int = 0) -> np.ndarray:
    """Row 0 = ``data``; rows 1.. = ``data`` plus Gaussian noise (stand-ins for bootstrap replicates)."""
    rng = np.random.default_rng(seed)
    return np.concatenate([data[None], data[None] + rng.normal(0, noise, (count, *data.shape))])


# layer means [layer, metric] for metrics (cls, sep, punct): the hypothesis' order, its reverse
ORDERED = np.array([[0.50, 0.10, 0.05], [0.30, 0.20, 0.10], [0.10, 0.60, 0.20], [0.05, 0.30, 0.40]])
#: The uniform head's attention to each token set in these made-up series (its excess is the means less this).
UNIFORM = 0.04


def test_depth_claim_is_supported_when_the_peaks_are_ordered_and_stable():
    means = replicates(ORDERED, 0.01)
    verdict = depth_verdict(means, ENCODER, step=100, checkpoint="final", excess=means - UNIFORM)
    assert {m: p["layer"] for m, p in verdict["peaks"].items()} == {"cls": 0, "sep": 2, "punct": 3}
    assert verdict["order_holds"] and verdict["probability"] == 1.0 and verdict["verdict"] == "supported"
    assert verdict["peaks"]["sep"]["value"] == pytest.approx(0.60)
    assert "layer 2" in verdict["statement"] and "supported" in verdict["statement"]


def test_depth_claim_is_contradicted_by_reversed_peaks_and_a_tie_when_the_peaks_cannot_be_told_apart():
    reversed_means = ORDERED[::-1].copy()
    means = replicates(reversed_means, 0.01)
    assert depth_verdict(means, ENCODER, excess=means - UNIFORM)["verdict"] == "contradicted"
    # [SEP] has two almost equal layers (1 and 2) around [CLS]'s peak at 1: the order holds in about half of the replicates,
    # and [SEP]'s peak interval (1-2) overlaps [CLS]'s (1-1): the order cannot be told (issue 39: a tie, not "inconclusive")
    close = np.array([[0.1, 0.1, 0.0], [0.5, 0.30, 0.1], [0.1, 0.31, 0.2], [0.0, 0.0, 0.5]])
    means = replicates(close, 0.02)
    verdict = depth_verdict(means, ENCODER, excess=means - UNIFORM)
    assert verdict["order_holds"] and 0.2 < verdict["probability"] < 0.8
    assert verdict["verdict"] == "tie" and verdict["pairs"] == {"cls<sep": "tie", "sep<punct": "<"}
    assert "[CLS] and [SEP] tie (intervals 1-1 and 1-2 overlap)" in verdict["statement"]


def test_crossing_step_is_interpolated_in_log_steps_by_hand():
    steps = np.array([0, 10, 100, 1000])
    strength = np.array([[0.0, 1.0, 0.3], [0.2, 1.0, 0.3], [0.6, 1.0, 0.1], [1.0, 1.0, 0.2]])  # [checkpoint, series]
    crossed = crossing_steps(steps, strength)
    # series 0: half of the rise (0.5) lies between 0.2 at step 10 and 0.6 at step 100
    x = np.log1p(10) + (0.5 - 0.2) / (0.6 - 0.2) * (np.log1p(100) - np.log1p(10))
    assert crossed[0] == pytest.approx(np.expm1(x))
    assert np.isnan(crossed[1]) and np.isnan(crossed[2])  # flat; falls


def test_a_crossing_exactly_at_a_checkpoint_is_bracketed_by_it_and_the_one_before():
    steps = [0, 10, 100, 1000]
    strength = np.array([0.0, 0.1, 0.5, 1.0])[:, None, None] * np.ones((1, 3, 3))  # crosses half at step 100 exactly
    _, table = emergence_verdict(steps, strength, ENCODER, excess=strength)
    assert table.half_step.tolist() == pytest.approx([100, 100, 100])
    assert table.bracket_low.tolist() == [10, 10, 10] and table.bracket_high.tolist() == [100, 100, 100]


def series(starts: list[int], steps: list[int]) -> np.ndarray:
    """Strength [checkpoint, metric]: metric k jumps from 0.1 to 0.5 at checkpoint ``starts[k]``."""
    values = np.full((len(steps), len(starts)), 0.1)
    for k, start in enumerate(starts):
        values[start:, k] = 0.5
    return values


def test_emergence_claim_orders_the_half_way_crossings():
    steps = [0, 10, 100, 1000, 10000]
    strength = np.stack([replicates(row, 0.005, seed=k) for k, row in enumerate(series([1, 2, 4], steps))])  # [checkpoint, 1 + B, metric]
    verdict, table = emergence_verdict(steps, strength, ENCODER, excess=strength - UNIFORM)
    assert verdict["verdict"] == "supported" and verdict["probability"] > 0.95
    assert (table.emerges == "yes").all()
    assert table.bracket_low.tolist() == [0, 10, 1000] and table.bracket_high.tolist() == [10, 100, 10000]
    late_cls = np.stack([replicates(row, 0.005, seed=k) for k, row in enumerate(series([4, 2, 1], steps))])
    assert emergence_verdict(steps, late_cls, ENCODER, excess=late_cls - UNIFORM)[0]["verdict"] == "contradicted"


def test_one_checkpoint_gives_only_the_depth_claim():
    means = replicates(ORDERED, 0.01)[None]
    verdict, table = hypothesis_verdict([None], ["default"], means, ENCODER, excess=means - UNIFORM)
    assert verdict["depth"]["step"] is None
    assert verdict["depth"]["verdict"] == "supported"
    assert verdict["training"]["verdict"] == "not applicable" and table is None


@pytest.fixture(scope="module")
def series_run(tmp_path_factory):
    """A tiny pre-training run with checkpoints at steps 0, 10, 14 and 20."""
    folder = tmp_path_factory.mktemp("pretrained")
    pretrain(write_books(folder / "books"), folder / "run", steps=20, **SMALL)
    return folder / "run"


def test_track_over_two_checkpoints_gives_both_steps(series_run, tmp_path, monkeypatch):
    checkpoints = find_checkpoints(series_run)
    assert [checkpoint_step(c) for c in checkpoints] == [0, 10, 14, 20]
    examples = [Example(text) for text in TEXTS]
    result = track([checkpoints[-1], checkpoints[0]], examples, parser="spacy", out=tmp_path / "track", bootstrap=50, min_dependents=2,
                   device="cpu", progress=False)
    table = pd.read_csv(tmp_path / "track" / "track.csv")
    assert list(table.columns) == TRACK_COLUMNS
    assert sorted(table.step.unique()) == [0, 20]
    metrics = set(table.metric)
    assert {"cls", "sep", "punct", "entropy", "role:local", "role:delimiter", "syntax:all"} <= metrics
    per_step = table[table.metric == "cls"].groupby("step").size()
    assert per_step.tolist() == [4, 4]  # 2 layers x 2 heads at each step
    layers = pd.read_csv(tmp_path / "track" / "track_layers.csv")
    assert sorted(layers.step.unique()) == [0, 20] and set(layers.layer) == {0, 1}
    verdict = json.loads((tmp_path / "track" / "verdict.json").read_text())
    assert verdict["depth"]["step"] == 20 and verdict["training"]["steps"] == [0, 20]
    assert set(verdict["training"]["patterns"]) == {"cls", "sep", "punct", "syntax"}
    assert result.syntax_series().step.tolist() == [0, 20]
    for figure in ("peak_layers", "layer_by_step", "emergence", "syntax_by_step"):
        assert (tmp_path / "track" / f"{figure}.png").stat().st_size > 0
    assert "learning-curve hypothesis" in (tmp_path / "track" / "report.html").read_text()

    # a rerun reuses every checkpoint's saved part instead of running the model again
    monkeypatch.setattr(dynamics, "_analyze_checkpoint", lambda *a, **k: pytest.fail("a saved checkpoint was recomputed"))
    again = track([checkpoints[0], checkpoints[-1]], examples, parser="spacy", out=tmp_path / "track", bootstrap=50, min_dependents=2,
                  device="cpu", progress=False)
    pd.testing.assert_frame_equal(again.table, result.table)
    assert again.verdict == result.verdict


def test_track_layer_values_equal_a_plain_analysis(series_run):
    from bertology.api import analyze

    checkpoint = find_checkpoints(series_run)[1]
    examples = [Example(text) for text in TEXTS]
    result = track([checkpoint], examples, bootstrap=20, device="cpu", progress=False)
    plain = analyze(checkpoint, examples, analyses=["profile"], view=False, progress=False, device="cpu")
    layers = plain.table("layers")
    merged = result.layers.merge(layers, on=["layer", "metric"], suffixes=("", "_plain"))
    np.testing.assert_allclose(merged.value, merged.value_plain, rtol=1e-6)
    peak = result.verdict["depth"]["layer_means"]
    for metric in ("cls", "sep", "punct"):
        expected = layers[layers.metric == metric].sort_values("layer").value.to_numpy()
        np.testing.assert_allclose(peak[metric], expected, atol=1e-4)


def test_one_checkpoint_of_unknown_step_with_trees(series_run, tmp_path):
    import shutil

    final = tmp_path / "final-model"
    shutil.copytree(find_checkpoints(series_run)[-1], final)
    (final / "pretraining_step.json").unlink()
    result = track([str(final)], [Example(text) for text in TEXTS], parser="spacy", out=tmp_path / "one", bootstrap=20, min_dependents=2,
                   device="cpu", progress=False)
    assert result.steps == [None] and result.verdict["depth"]["step"] is None
    assert result.verdict["training"]["verdict"] == "not applicable"
    table = pd.read_csv(tmp_path / "one" / "track.csv")
    assert table.step.isna().all() and "syntax:all" in set(table.metric)
    assert (tmp_path / "one" / "peak_layers.png").is_file() and not (tmp_path / "one" / "emergence.png").exists()
    assert "step unknown" in (tmp_path / "one" / "report.html").read_text()


@pytest.fixture(scope="module")
def saved_parts(tiny_bert_dir, tmp_path_factory):
    """A track run over one checkpoint with trees (so its part holds syntax too): its out folder and its examples."""
    from conftest import gold_example

    examples = [gold_example(k, text) for k, text in enumerate(TEXTS)]
    out = tmp_path_factory.mktemp("track") / "out"
    track([str(tiny_bert_dir)], examples, out=out, bootstrap=20, min_dependents=2, device="cpu", progress=False)
    return out, examples


def rewrite_npz(path, **changes):
    """Write the part's ``.npz`` again with some arrays changed (None: left out)."""
    arrays = dict(np.load(path, allow_pickle=False))
    arrays.update(changes)
    np.savez(path, **{name: array for name, array in arrays.items() if array is not None})


def meta_with(path, drop=(), **changes):
    """The part's ``meta`` with some fields changed and those in ``drop`` left out."""
    meta = {**json.loads(str(np.load(path)["meta"])), **changes}
    return np.array(json.dumps({key: value for key, value in meta.items() if key not in drop}))


def means_with(path, index, value):
    means = np.load(path)["means"].copy()
    means[index] = value
    return means


PART_DAMAGE = [  # (file: npz, rows, layers; damage; what the refusal says)
    ("npz", lambda p: p.write_bytes(b"not a zip"), "not a NumPy .npz archive"),
    ("npz", lambda p: p.write_bytes(p.read_bytes()[:200]), "not a NumPy .npz archive"),
    ("npz", lambda p: rewrite_npz(p, means=means_with(p, (0, 1, 2), np.nan)), "'means' holds values that are not shares in [0, 1]"),
    ("npz", lambda p: rewrite_npz(p, means=means_with(p, (3, 0, 0), np.inf)), "'means' holds values that are not shares in [0, 1]"),
    ("npz", lambda p: rewrite_npz(p, means=means_with(p, (3, 0, 0), -0.5)), "'means' holds values that are not shares in [0, 1]"),
    ("npz", lambda p: rewrite_npz(p, means=np.load(p)["means"][:5]), "'means' has shape (5, 2, 3), expected (21, any, 3)"),
    ("npz", lambda p: rewrite_npz(p, means=np.load(p)["means"][0]), "'means' has shape (2, 3), expected (21, any, 3)"),
    ("npz", lambda p: rewrite_npz(p, means=np.concatenate([np.load(p)["means"]] * 2, axis=1)), "'means' has 4 layers, not those of"),
    ("npz", lambda p: rewrite_npz(p, means=np.load(p)["means"].astype(int)), "'means' is a int64 array of shape (21, 2, 3)"),
    ("npz", lambda p: rewrite_npz(p, syntax=np.load(p)["syntax"] * 3), "'syntax' holds values that are not shares in [0, 1]"),
    ("npz", lambda p: rewrite_npz(p, syntax=np.load(p)["syntax"][:3]), "'syntax' has shape (3,), expected (21)"),
    ("npz", lambda p: rewrite_npz(p, syntax=None), "no array 'syntax' in it"),
    ("npz", lambda p: rewrite_npz(p, meta=np.array("{not json")), "its 'meta' is damaged: not valid JSON"),
    ("npz", lambda p: rewrite_npz(p, meta=np.array('{"step": "5", "checkpoint": "x"}')), "its 'meta' is damaged: 'step' must be int or NoneType"),
    ("npz", lambda p: rewrite_npz(p, meta=np.array('{"step": null, "checkpoint": "elsewhere"}')), "it is the part of another checkpoint ('elsewhere')"),
    ("npz", lambda p: rewrite_npz(p, key=np.array([1, 2])), "'key' is a int64 array of shape (2,)"),
    ("npz", lambda p: rewrite_npz(p, meta=meta_with(p, kind=3)), "its 'meta' is damaged: 'kind' must be str"),
    ("npz", lambda p: rewrite_npz(p, meta=meta_with(p, kind="recurrent")), "its 'meta' is damaged: unknown kind of model 'recurrent'"),
    ("npz", lambda p: rewrite_npz(p, meta=meta_with(p, kind="decoder")),
     "'means' has shape (21, 2, 3), expected (21, any, 2)"),  # an encoder's part that says it is a decoder's
    # a part written before kinds says whether its model is a decoder (``causal``): read back as such
    ("npz", lambda p: rewrite_npz(p, meta=meta_with(p, drop=("kind",), causal="yes")), "its 'meta' is damaged: 'causal' must be bool"),
    ("npz", lambda p: rewrite_npz(p, meta=meta_with(p, drop=("kind",), causal=True)), "'means' has shape (21, 2, 3), expected (21, any, 2)"),
    ("rows", lambda p: p.write_bytes(b"PAR1 garbage PAR1"), "cannot read it as a table"),
    ("rows", lambda p: p.unlink(), "cannot read it as a table"),
    ("rows", lambda p: pd.read_parquet(p).drop(columns="head").to_parquet(p), "its columns are step, checkpoint, layer, metric, value"),
    ("rows", lambda p: pd.read_parquet(p).assign(value="high").to_parquet(p), "its column 'value' holds"),
    ("layers", lambda p: pd.read_parquet(p).assign(checkpoint="elsewhere").to_parquet(p, index=False), "it holds rows of another step or checkpoint"),
    ("layers", lambda p: pd.read_parquet(p).assign(step=7).to_parquet(p, index=False), "it holds rows of another step or checkpoint"),
    ("npz", lambda p: pd.read_parquet(p.with_suffix(".layers.parquet")).query("layer == 0").to_parquet(p.with_suffix(".layers.parquet")),
     "'means' has 2 layers, not those of"),
]


@pytest.mark.parametrize("file, damage, message", PART_DAMAGE)
def test_a_damaged_part_is_refused_in_one_line_naming_the_file_to_delete(saved_parts, tiny_bert_dir, tmp_path, file, damage, message):
    """NaN or out-of-range means were once used as results; a part that is no zip, lacks an array or has the wrong shapes,
    or a table that is damaged or missing, gave a traceback."""
    import shutil

    out, examples = saved_parts
    shutil.copytree(out, tmp_path / "out")
    parts = tmp_path / "out" / "parts"
    [marker] = parts.glob("*.npz")
    damaged = marker if file == "npz" else marker.with_suffix(f".{file}.parquet")
    damage(damaged)
    settings = dict(out=tmp_path / "out", bootstrap=20, min_dependents=2, device="cpu", progress=False)
    with pytest.raises(StateError) as error:
        track([str(tiny_bert_dir)], examples, **settings)
    assert str(error.value).startswith(f"{damaged}: ") and message in str(error.value), str(error.value)
    assert str(error.value).endswith(f"; delete {marker} to compute this checkpoint again") and "\n" not in str(error.value)
    marker.unlink()  # as the message says: the checkpoint is computed again
    assert track([str(tiny_bert_dir)], examples, **settings).results[0].syntax is not None


@pytest.mark.parametrize("old_meta", [{"causal": False}, {}], ids=["before-kinds", "before-decoders"])
def test_a_part_written_before_kinds_is_read_back_as_an_encoders(saved_parts, tiny_bert_dir, tmp_path, old_meta):
    """Parts now name their model's kind (``"kind": "encoder"``); those of older runs said ``"causal": false`` or nothing,
    and are still used, not computed again."""
    import shutil

    out, examples = saved_parts
    shutil.copytree(out, tmp_path / "out")
    [marker] = (tmp_path / "out" / "parts").glob("*.npz")
    meta = json.loads(str(np.load(marker)["meta"]))
    assert meta["kind"] == "encoder"
    old = {key: value for key, value in meta.items() if key != "kind"} | old_meta
    rewrite_npz(marker, meta=np.array(json.dumps(old)))
    result = track([str(tiny_bert_dir)], examples, out=tmp_path / "out", bootstrap=20, min_dependents=2, device="cpu", progress=False)
    assert json.loads(str(np.load(marker)["meta"])) == old  # the part was read back, not computed and written again
    assert result.kind.name == "encoder" and result.metrics == ("cls", "sep", "punct")
    np.testing.assert_array_equal(result.results[0].means, np.load(marker)["means"])
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["kind"] == "encoder"


def test_a_part_written_before_measured_losses_is_computed_again(saved_parts, tiny_bert_dir, tmp_path):
    """A part without ``measured_loss`` in its ``meta`` cannot tell whether the checkpoint's loss was measured: it is computed
    again (and written with it), not read back as a checkpoint without a language-model head."""
    import shutil

    out, examples = saved_parts
    shutil.copytree(out, tmp_path / "out")
    [marker] = (tmp_path / "out" / "parts").glob("*.npz")
    rewrite_npz(marker, meta=meta_with(marker, drop=("measured_loss", "measured_loss_name")))
    track([str(tiny_bert_dir)], examples, out=tmp_path / "out", bootstrap=20, min_dependents=2, device="cpu", progress=False)
    meta = json.loads(str(np.load(marker)["meta"]))
    assert meta["measured_loss"] is None and meta["measured_loss_name"] is None  # a bare BERT: no masked-LM head


def test_parts_of_an_unfinished_track_with_other_settings_or_weights_are_refused_not_overwritten(saved_parts, tiny_bert_dir, tmp_path):
    """Issue 25: a rerun with other settings overwrote an unfinished run's parts; the parts now carry the weights' hash too."""
    import shutil

    from core.storage.test_runfolder import snapshot
    from safetensors.torch import load_file, save_file

    out, examples = saved_parts
    model = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, model)
    settings = dict(bootstrap=20, min_dependents=2, device="cpu", progress=False)
    track([str(model)], examples, out=tmp_path / "out", **settings)
    (tmp_path / "out" / "manifest.json").unlink()  # as a track killed before it wrote its folder leaves it
    before = snapshot(tmp_path / "out")
    with pytest.raises(StateError, match="a part of an unfinished track run with other settings, corpus or weights") as error:
        track([str(model)], examples, out=tmp_path / "out", **{**settings, "bootstrap": 30})
    assert "\n" not in str(error.value) and snapshot(tmp_path / "out") == before
    weights = load_file(model / "model.safetensors")
    name = next(key for key in weights if key.endswith("query.weight"))
    save_file({**weights, name: weights[name] + 0.01}, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StateError, match="other settings, corpus or weights"):
        track([str(model)], examples, out=tmp_path / "out", **settings)
    assert snapshot(tmp_path / "out") == before
    # a finished run's parts are a cache: other settings compute the checkpoint again
    shutil.copytree(out, tmp_path / "finished")
    again = track([str(tiny_bert_dir)], examples, out=tmp_path / "finished", **{**settings, "bootstrap": 30})
    assert again.results[0].means.shape[0] == 31


@pytest.fixture(scope="module")
def causal_series_run(tmp_path_factory):
    """A tiny causal (GPT-2-style) pre-training run with checkpoints at steps 0, 10, 14 and 20."""
    folder = tmp_path_factory.mktemp("pretrained-causal")
    pretrain(write_books(folder / "books"), folder / "run", steps=20, **CAUSAL)
    return folder / "run"


def first_token_attention(checkpoint, texts: list[str]) -> np.ndarray:
    """``[sequence, layer, head]``: ``alpha_0 = mean_{i>=1} a[i, 0]`` of every head, from transformers' own eager attention maps
    (each text alone, NaN for a text of one piece): the independent reference of track's numbers on a decoder."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = GPT2LMHeadModel.from_pretrained(checkpoint, attn_implementation="eager").eval()
    rows = []
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=model.config.n_positions)["input_ids"]
            maps = torch.stack(model(input_ids=ids, output_attentions=True).attentions)[:, 0]  # [layer, head, n, n]
            rows.append(maps[..., 1:, 0].mean(dim=-1).double().numpy())  # NaN where n = 1
    return np.stack(rows)


def test_track_over_causal_checkpoints_leaves_sep_out_and_follows_the_sinks(causal_series_run, tmp_path):
    from bertology.core.model.models import load_model

    checkpoints = find_checkpoints(causal_series_run)
    first, final = checkpoints[0], checkpoints[-1]
    tokenizer = load_model(final, device="cpu").tokenizer
    one_piece = next(tokenizer.decode([i]).strip() for i in range(len(tokenizer))
                     if tokenizer.decode([i]).strip().isalpha() and len(tokenizer(tokenizer.decode([i]).strip())["input_ids"]) == 1)
    texts = [*TEXTS, one_piece]  # a sequence of one piece has no query i >= 1: it must take no part
    expected = {checkpoint: first_token_attention(checkpoint, texts) for checkpoint in (first, final)}
    assert np.isnan(expected[final][-1]).all() and np.isfinite(expected[final][:-1]).all()
    heads = np.nanmean(expected[final], axis=0)  # [layer, head]: each head's alpha_0
    eps = float(np.mean(np.sort(heads.ravel())[1:3]))  # halfway between the second and third of the four heads: two pass, two do not

    result = track([final, first], [Example(text) for text in texts], out=tmp_path / "track", bootstrap=50, sink_eps=eps, device="cpu", progress=False)
    table = pd.read_csv(tmp_path / "track" / "track.csv")
    assert {"first", "punct", "self", "prev", "entropy", "distance", "role:local", "role:delimiter"} <= set(table.metric)
    assert not {"cls", "sep", "next", "cls_entropy", "role:cls", "role:sep"} & set(table.metric)  # [SEP] and [CLS] have no meaning here
    layers = pd.read_csv(tmp_path / "track" / "track_layers.csv")
    assert set(layers.metric) == {"first", "punct", "self", "prev", "entropy", "distance", "sink_eps"}
    assert set(pd.read_csv(tmp_path / "track" / "peaks.csv").metric) == set(pd.read_csv(tmp_path / "track" / "emergence.csv").metric) == {"first", "punct"}
    verdict = json.loads((tmp_path / "track" / "verdict.json").read_text())
    assert set(verdict["depth"]["layer_means"]) == set(verdict["training"]["patterns"]) == {"first", "punct"}
    assert "first token" in verdict["depth"]["claim"] and "[SEP]" not in verdict["depth"]["statement"] + verdict["training"]["statement"]
    assert result.kind.name == json.loads((tmp_path / "track" / "manifest.json").read_text())["kind"] == "decoder"
    assert {json.loads(str(np.load(part)["meta"]))["kind"] for part in (tmp_path / "track" / "parts").glob("*.npz")} == {"decoder"}

    for k, (step, checkpoint) in enumerate(((0, first), (20, final))):  # against transformers' maps: per sequence the head mean, then over sequences
        layer_means = np.nanmean(expected[checkpoint].mean(axis=2), axis=0)
        at_step = layers[(layers.step == step) & (layers.metric == "first")].sort_values("layer")
        np.testing.assert_allclose(at_step.value, layer_means, rtol=1e-5)  # the profile's
        np.testing.assert_allclose(result.results[k].means[0, :, 0], layer_means, rtol=1e-5)  # the peaks' (the verdict's)
    # Sink_eps per layer: the share of its heads past eps whose excess over the uniform head (alpha_0 = mean_{i>=1} 1/(i+1) per
    # sequence) has a 95% Student-t interval above 0
    lengths = np.array([len(tokenizer(text)["input_ids"]) for text in texts])
    uniform = np.array([np.mean(1 / np.arange(2, n + 1)) if n > 1 else np.nan for n in lengths])
    excess = (expected[final] - uniform[:, None, None])[lengths > 1]  # [sequence, layer, head]
    low = excess.mean(axis=0) - scipy.stats.t.ppf(0.975, len(excess) - 1) * excess.std(axis=0, ddof=1) / np.sqrt(len(excess))
    rates = ((heads > eps) & (low > 0)).mean(axis=1)
    assert 0 < rates.mean() < 1
    sinks = layers[(layers.step == 20) & (layers.metric == "sink_eps")].sort_values("layer")
    np.testing.assert_array_equal(sinks.value, rates)
    assert sinks.ci_low.isna().all()
    assert verdict["sinks"]["steps"] == [0, 20] and verdict["sinks"]["by_layer"][1] == rates.tolist()
    assert verdict["sinks"]["overall"][1] == pytest.approx(rates.mean()) and f"{rates.mean():.0%} at step 20" in verdict["sinks"]["statement"]
    for figure in ("peak_layers", "layer_by_step", "sinks_by_step", "emergence"):
        assert (tmp_path / "track" / f"{figure}.png").stat().st_size > 0
    assert "attention sink" in (tmp_path / "track" / "report.html").read_text()


@pytest.fixture(scope="module")
def unlike_checkpoints(tiny_gpt2_dir, tiny_llama_dir, tmp_path_factory):
    """Checkpoints that each differ from tiny GPT-2 or tiny Llama (2 layers, 4 heads) in one way: heads, layers, the architecture
    (task head) named in config.json, a token added to the tokenizer, a tokenizer that does not put BOS first."""
    import shutil

    from conftest import byte_level_bpe, save_tiny_decoder
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("unlike")
    folders = {"llama-2-heads": save_tiny_decoder("llama", root / "llama-2-heads", heads=2),
               "llama-3-layers": save_tiny_decoder("llama", root / "llama-3-layers", layers=3)}
    for name, base in (("gpt2-base", tiny_gpt2_dir), ("gpt2-more-pieces", tiny_gpt2_dir), ("llama-no-bos", tiny_llama_dir)):
        folders[name] = Path(shutil.copytree(base, root / name))
    config = json.loads((folders["gpt2-base"] / "config.json").read_text())
    (folders["gpt2-base"] / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2Model"]}))
    tokenizer = AutoTokenizer.from_pretrained(folders["gpt2-more-pieces"])
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(folders["gpt2-more-pieces"])
    PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(), bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(folders["llama-no-bos"])
    return folders


def _differences(tiny_bert_dir, tiny_gpt2_dir, tiny_llama_dir, folders) -> list:
    """(first checkpoint, the one that differs, how), each difference told from config.json and transformers' tokenizers."""
    from transformers import AutoTokenizer

    model_types = [json.loads((folder / "config.json").read_text())["model_type"] for folder in (tiny_llama_dir, tiny_gpt2_dir)]
    vocabulary = AutoTokenizer.from_pretrained(tiny_gpt2_dir).get_vocab()
    pieces = AutoTokenizer.from_pretrained(folders["llama-no-bos"]).tokenize(PROBE_TEXT)
    assert AutoTokenizer.from_pretrained(folders["llama-no-bos"]).get_vocab() == AutoTokenizer.from_pretrained(tiny_llama_dir).get_vocab()
    return [
        (tiny_bert_dir, tiny_gpt2_dir, "it is a decoder, not an encoder"),
        (tiny_gpt2_dir, tiny_llama_dir, "its model type is {}, not {}".format(*model_types)),
        (tiny_llama_dir, folders["llama-3-layers"], "it has 3 layers, not 2"),
        (tiny_llama_dir, folders["llama-2-heads"], "it has 2 heads per layer, not 4"),
        (tiny_gpt2_dir, folders["gpt2-more-pieces"],
         f"its tokenizer has another vocabulary ({len(vocabulary) + 1} pieces, not {len(vocabulary)}; '<extra>' is {len(vocabulary)}, not absent)"),
        (tiny_llama_dir, folders["llama-no-bos"], f"its tokenizer cuts {PROBE_TEXT!r} into {' '.join(pieces)}, not <s> {' '.join(pieces)}"),
    ]


def test_checkpoints_that_are_not_one_series_are_refused_before_any_runs(unlike_checkpoints, tiny_bert_dir, tiny_gpt2_dir, tiny_llama_dir,
                                                                          tmp_path, monkeypatch):
    """An encoder and a decoder, GPT-2 and Llama, other layers, heads, vocabulary or special tokens: refused in one
    line naming the checkpoint that differs and how, before any checkpoint runs or the run folder is made."""
    monkeypatch.setattr(dynamics, "_analyze_checkpoint", lambda *args, **kwargs: pytest.fail("a checkpoint ran"))
    for first, other, how in _differences(tiny_bert_dir, tiny_gpt2_dir, tiny_llama_dir, unlike_checkpoints):
        with pytest.raises(BertologyError) as error:
            track([str(other), str(first)], [Example(text) for text in TEXTS], steps=[10, 0], out=tmp_path / "run", bootstrap=20, device="cpu",
                  progress=False)
        assert str(error.value) == f"{other}: not of one series with {first}: {how}"
    assert not (tmp_path / "run").exists()


def test_a_model_and_the_same_model_with_another_task_head_are_one_series(unlike_checkpoints, tiny_gpt2_dir):
    """A pre-trained model and its fine-tuned classifier differ only in ``architectures`` (the task head): one series (the
    golden tables track the bundled model and a classifier fine-tuned from it)."""
    check_one_series([str(tiny_gpt2_dir), str(unlike_checkpoints["gpt2-base"])])


@pytest.mark.parametrize("seed", [2**70, 2**32, -1])
def test_a_seed_numpy_cannot_take_is_refused_before_a_checkpoint_loads(seed, tmp_path):
    with pytest.raises(ValueError):
        np.random.RandomState(seed)  # the bootstrap's random state is numpy's
    with pytest.raises(BertologyError, match=f"^seed must be a whole number from 0 to 4294967295, not {seed}$"):
        track(["nobody/a", "nobody/b"], tmp_path / "no-such-corpus.txt", steps=[0, 1], seed=seed, out=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_pretrain_causal_and_track_from_the_command_line(tmp_path):
    """``bertology pretrain --causal`` gives a decoder series that ``bertology track --checkpoints`` follows, sinks included."""
    from test_cli import bertology

    books = write_books(tmp_path / "books")
    pretrained = bertology("pretrain", books, "--causal", "--out", tmp_path / "pt", "--steps", 10, "--layers", 2, "--heads", 2, "--hidden", 32,
                           "--vocab-size", 300, "--max-length", 32, "--batch-size", 8, "--checkpoints", 3, "--device", "cpu", "-q")
    assert pretrained.returncode == 0, pretrained.stderr
    assert "validation causal LM loss" in pretrained.stdout and "next-sentence" not in pretrained.stdout
    assert json.loads((tmp_path / "pt" / "manifest.json").read_text())["settings"]["objective"] == "causal-lm"
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    tracked = bertology("track", "--checkpoints", tmp_path / "pt", "--corpus", corpus, "--bootstrap", 100, "--sink-eps", 0.2, "--out", tmp_path / "t",
                        "--device", "cpu", "-q")
    assert tracked.returncode == 0, tracked.stderr
    assert "attention sinks: Sink_0.2 (the share of heads whose mean attention to the first token exceeds 0.2" in tracked.stdout
    assert sorted(pd.read_csv(tmp_path / "t" / "track.csv").step.unique()) == [0, 10]
    assert json.loads((tmp_path / "t" / "verdict.json").read_text())["sinks"]["eps"] == 0.2
