"""The Python API, and one end-to-end run on the bundled default model."""

import json

import numpy as np
import pytest
from core.storage.test_runfolder import snapshot

import bertology
from bertology.core.errors import BertologyError
from bertology.core.model.kinds import ENCODER
from bertology.families.profile.analyzer import profile_metric_names

SENTENCES = [
    "The old lighthouse keeper climbed the stairs every evening.",
    "Where did you put the keys?",
    "She said, quietly, that the train had already left.",
    "Birds sing.",
]


def test_end_to_end_on_the_bundled_minilm(minilm, tmp_path):
    result = bertology.analyze(minilm, SENTENCES + [bertology.Example("A man plays guitar.", "Someone makes music.")], out=tmp_path, progress=False,
                               head_distance_sample=1.0)
    heads = result.table("heads")
    assert len(heads) == 6 * 12 * len(profile_metric_names(ENCODER))
    assert (heads.n == 5).all()
    wide = heads.pivot_table(index=["layer", "head"], columns="metric", values="value")
    # Attention to a set never exceeds 1, and [CLS] + [SEP] + the rest is all of it.
    assert ((wide[["cls", "sep", "punct", "self", "prev", "next"]] >= 0) & (wide[["cls", "sep", "punct", "self", "prev", "next"]] <= 1)).all().all()
    assert (wide.entropy > 0).all()
    assert (heads.ci_low <= heads.value + 1e-12).all() and (heads.value <= heads.ci_high + 1e-12).all()
    assert result.table("head_map").shape == (72, 4)
    assert (tmp_path / "report.html").is_file() and (tmp_path / "manifest.json").is_file()
    assert "all-MiniLM-L6-v2" in result._repr_html_()


def test_results_are_deterministic(tiny_bert):
    first = bertology.analyze(tiny_bert, SENTENCES, progress=False, head_distance_sample=1.0)
    second = bertology.analyze(tiny_bert, SENTENCES, progress=False, head_distance_sample=1.0, batch_size=1)
    np.testing.assert_allclose(first.table("heads").value, second.table("heads").value, rtol=1e-5)
    # An MDS map is defined up to rotation and reflection: compare the distances between the heads on it, to the map's scale.
    def spread(head_map):
        points = head_map[["x", "y"]].to_numpy()
        return np.linalg.norm(points[:, None] - points[None], axis=-1)

    np.testing.assert_allclose(first.table("head_distance").distance, second.table("head_distance").distance, rtol=1e-4, atol=1e-9)
    # The tiny model's heads are all but alike (distances of 1e-5 nats), so SMACOF's fit moves with float rounding: the maps
    # agree in shape, not to the digit.
    assert np.corrcoef(spread(first.table("head_map")).ravel(), spread(second.table("head_map")).ravel())[0, 1] > 0.99


def test_no_sampled_sequence_is_a_warning_not_a_failure(tiny_bert):
    result = bertology.analyze(tiny_bert, ["the cat sat."], progress=False, head_distance_sample=1e-9)
    assert result.table("head_map") is None and "no sequence was sampled" in result.warnings[0]


TREEBANK = """# text = the cat sat on the mat.
1\tthe\t_\tDET\t_\t_\t2\tdet\t_\t_
2\tcat\t_\tNOUN\t_\t_\t3\tnsubj\t_\t_
3\tsat\t_\tVERB\t_\t_\t0\troot\t_\t_
4\ton\t_\tADP\t_\t_\t6\tcase\t_\t_
5\tthe\t_\tDET\t_\t_\t6\tdet\t_\t_
6\tmat\t_\tNOUN\t_\t_\t3\tobl\t_\tSpaceAfter=No
7\t.\t_\tPUNCT\t_\t_\t3\tpunct\t_\t_

# text = the dog ran fast.
1\tthe\t_\tDET\t_\t_\t2\tdet\t_\t_
2\tdog\t_\tNOUN\t_\t_\t3\tnsubj\t_\t_
3\tran\t_\tVERB\t_\t_\t0\troot\t_\t_
4\tfast\t_\tADV\t_\t_\t3\tadvmod\t_\tSpaceAfter=No
5\t.\t_\tPUNCT\t_\t_\t3\tpunct\t_\t_

"""


def test_out_is_checked_before_the_corpus_is_read_or_the_model_loaded(tmp_path):
    taken = tmp_path / "taken.txt"
    taken.write_text("not a folder\n")
    with pytest.raises(BertologyError, match=r"taken\.txt: is a file") as error:
        bertology.analyze("nobody/no-such-model", tmp_path / "no-such-corpus.txt", out=taken, progress=False)
    assert "\n" not in str(error.value) and taken.read_text() == "not a folder\n"


def test_a_rerun_leaves_no_stale_file_and_a_failed_save_leaves_the_previous_run_whole(tiny_bert, tmp_path, monkeypatch):
    out = tmp_path / "run"
    bertology.analyze(tiny_bert, SENTENCES, out=out, progress=False, view=False)
    assert (out / "roles.csv").is_file()
    bertology.analyze(tiny_bert, SENTENCES, analyses=["profile"], out=out, progress=False, view=False)
    assert not (out / "roles.csv").exists() and not (out / "roles_grid.png").exists()  # nothing of the earlier run is left
    before = snapshot(out)

    def killed(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("bertology.families.roles.report.roles_section", killed)
    with pytest.raises(OSError, match="No space left"):
        bertology.analyze(tiny_bert, SENTENCES, out=out, progress=False, view=False)
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no staging folder, no lock


def test_an_analyzer_failing_during_the_pass_loses_nothing_else(tiny_bert, tmp_path, monkeypatch):
    """An analyzer that raises on the second batch (say, out of memory) takes only its own family out."""
    from bertology.families.roles.analyzer import HeadRoles

    calls = []
    finish_batch = HeadRoles.finish_batch  # the layer-by-layer pass ends each batch there

    def failing_update(self, batch):
        calls.append(len(batch.examples))
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")
        finish_batch(self, batch)

    monkeypatch.setattr(HeadRoles, "finish_batch", failing_update)
    out = tmp_path / "run"
    result = bertology.analyze(tiny_bert, SENTENCES * 3, batch_size=4, out=out, progress=False, view=False, head_distance_sample=1.0)
    assert calls == [4, 4]  # left out of the rest of the pass
    assert result.failures == {"roles": "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB"}
    assert result.table("roles") is None and (result.table("heads").n == 12).all() and result.table("patterns") is not None
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "partial" and manifest["failures"] == result.failures
    assert (out / "heads.csv").is_file() and (out / "patterns.csv").is_file() and not (out / "roles.csv").exists()


def test_one_family_failing_loses_nothing_else(tiny_bert, tmp_path):
    corpus = tmp_path / "tiny.conllu"
    corpus.write_text(TREEBANK)
    out = tmp_path / "run"
    result = bertology.analyze(tiny_bert, corpus, max_length=3, bootstrap=100, probe=False, out=out, progress=False, view=False)
    assert list(result.failures) == ["syntax"] and "no sentence had a dependency tree" in result.failures["syntax"]
    assert result.table("syntax") is None and result.table("heads") is not None and result.table("roles") is not None and result.table("patterns") is not None
    for name in ("heads.csv", "roles.csv", "patterns.csv", "report.html"):
        assert (out / name).is_file(), name
    assert not (out / "syntax.csv").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "partial" and manifest["failures"] == result.failures
    assert "no sentence had a dependency tree" in (out / "report.html").read_text()
    with pytest.raises(BertologyError, match="no sentence had a dependency tree"):  # when every family fails, nothing is saved
        bertology.analyze(tiny_bert, corpus, analyses=["syntax"], max_length=3, probe=False, out=tmp_path / "alone", progress=False)
    assert not (tmp_path / "alone").exists()


def test_a_figure_that_fails_loses_nothing_else(tiny_bert, tmp_path, monkeypatch):
    """A family whose report section raises (a plotting error, say) keeps its tables; the run is partial and says why."""
    from bertology.families.rollout import Rollout

    def broken(self, folder, result, settings):
        raise ValueError("Index contains duplicate entries, cannot reshape")

    monkeypatch.setattr(Rollout, "section", broken)
    out = tmp_path / "run"
    result = bertology.analyze(tiny_bert, SENTENCES, out=out, progress=False, view=False, head_distance_sample=1.0)
    assert result.failures == {"rollout": "its report section: ValueError: Index contains duplicate entries, cannot reshape"}
    assert (out / "rollout.csv").is_file() and (out / "heads.csv").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "partial" and "its report section" in (out / "report.html").read_text()


def test_analyze_takes_exactly_the_shared_settings_with_the_defaults_their_options_declare():
    """One declaration (bertology.core.options.ANALYSIS) for the CLI's flags, the names no family option may take, and
    analyze()'s keywords: a keyword added to one and not the others fails here."""
    import inspect

    from bertology.core.options import ANALYSIS
    from bertology.families import COMMON_SETTINGS
    from bertology.studies.analyze.analysis import analyze

    parameters = inspect.signature(analyze).parameters
    keywords = {name for name, parameter in parameters.items() if parameter.kind is not parameter.VAR_KEYWORD}
    cli_only = {"quiet", "skip_long"}  # the API's progress and overflow
    assert keywords == COMMON_SETTINGS - cli_only
    for option in ANALYSIS:
        if option.name not in cli_only:
            assert parameters[option.name].default == option.default, option.name


def test_every_phase_of_a_run_is_timed_in_the_manifest_and_the_report(tiny_bert, tmp_path):
    import json

    from bertology.api import analyze

    out = tmp_path / "run"
    result = analyze(tiny_bert, ["The cat sat on the mat.", "A dog ran fast."] * 6, analyses=["profile", "roles"], out=out, progress=False)
    phases = json.loads((out / "manifest.json").read_text())["phases"]
    assert list(phases) == ["load", "pass", "finish:profile", "finish:roles", "viewer", "report"]
    assert all(isinstance(seconds, float) and seconds >= 0 for seconds in phases.values())
    assert phases["pass"] == round(result.stats.seconds, 2)
    assert "finish:roles" in (out / "report.html").read_text()


@pytest.mark.parametrize("seed", [2**70, 2**32, -1])
def test_a_seed_numpy_cannot_take_is_refused_before_the_corpus_is_read(seed, tmp_path):
    """numpy's random states take seeds from 0 to 2**32 - 1, and the head map's MDS takes its random state from the seed:
    any other seed is refused in one line before the corpus is read or the model loaded (it used to drop the head map and
    the head distance from a run whose manifest said complete, or end in a traceback)."""
    with pytest.raises(ValueError):
        np.random.RandomState(seed)
    with pytest.raises(BertologyError, match=f"^seed must be a whole number from 0 to 4294967295, not {seed}$"):
        bertology.analyze("nobody/no-such-model", tmp_path / "no-such-corpus.txt", seed=seed, out=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_the_largest_seed_keeps_the_head_distance_and_map(tiny_bert, tmp_path):
    np.random.RandomState(2**32 - 1)  # numpy's largest seed
    bertology.analyze(tiny_bert, SENTENCES, analyses=["profile"], seed=2**32 - 1, head_distance_sample=1.0, out=tmp_path / "run", view=False,
                      progress=False)
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["status"] == "complete"
    assert (tmp_path / "run" / "head_distance.csv").is_file() and (tmp_path / "run" / "head_map.csv").is_file()


def test_a_head_distance_sample_of_nothing_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(BertologyError, match="^--head-distance-sample .*more than 0"):
        bertology.analyze("nobody/no-such-model", SENTENCES, head_distance_sample=0, out=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_table_is_found_by_name_and_a_name_no_family_declares_is_refused_naming_the_known_ones():
    """``Analysis.table`` in place of attributes resolved at run time: a table, a document or an in-memory result by name,
    None for an output a registered family declares but this run did not make, a KeyError that says what there is otherwise."""
    import pandas as pd

    from bertology.core.engine import RunStats
    from bertology.families import FamilyResult
    from bertology.studies.analyze.result import Analysis, UnknownTable

    heads = pd.DataFrame({"layer": [0], "head": [0], "value": [0.5]})
    analysis = Analysis(model={}, corpus={}, stats=RunStats(), settings={}, started="",
                        results={"profile": FamilyResult(tables={"heads": heads}, documents={"doc": {"x": 1}}, extras={"role_tau": 2.0})})
    assert analysis.table("heads") is heads and analysis.table("doc") == {"x": 1} and analysis.table("role_tau") == 2.0
    assert analysis.table("roles") is None and analysis.table("sink_rates") is None  # declared by a family that did not run
    with pytest.raises(UnknownTable, match=r"^no table 'haeds': this run made doc, heads, role_tau; the registered families declare .*\bheads\b"):
        analysis.table("haeds")
    with pytest.raises(KeyError):
        analysis.table("haeds")
    with pytest.raises(AttributeError):
        analysis.heads  # noqa: B018  (no table is an attribute)
