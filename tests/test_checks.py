"""Every registered family and study passes its contract, each rule its own test id, through the public way a user checks
their own (bertology.testing.parametrize_with_checks, as scikit-learn's for estimators); and each rule catches what it is for."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TEXTS

from bertology.core.model.models import load_model
from bertology.families import registered
from bertology.studies import registered_studies
from bertology.testing import FAMILY_CHECKS, STUDY_CHECKS, check_family, check_study, parametrize_with_checks
from bertology.testing.families import FRAMES_EXAMPLE, check_options_round_trip, check_tables_declared
from bertology.testing.studies import check_failed_run_keeps_previous

#: Settings that keep the families' runs small (each given to the families that have such an option).
SMALL = {"bootstrap": 200, "tau": 1.0, "seed": 3, "probe_folds": 2, "probe_epochs": 2, "head_distance_sample": 0.5, "probe_sentences": 50,
         "probe_tasks": "deprel"}  # the test treebank has relations, no UPOS
FAMILIES = list(registered())


def family_corpus(name, treebank):
    return FRAMES_EXAMPLE if registered()[name].needs_frames else treebank


def family_model(name, tiny_bert_dir, tiny_gpt2_dir):
    """The tiny BERT, or for a family with no meaning on an encoder (the sinks measure what only a decoder has), the tiny GPT-2."""
    return tiny_bert_dir if "encoder" in registered()[name].kinds else tiny_gpt2_dir


def small_settings(name) -> dict:
    return {key: value for key, value in SMALL.items() if key in {option.name for option in registered()[name].options} or key == "seed"}


@pytest.fixture(scope="module")
def family_inputs(tiny_bert_dir, tiny_gpt2_dir, treebank):
    """Each family's inputs to its checks by name: the model (each tiny model loaded once), a small corpus (trees, or frames)
    and the settings that keep its run small; the checks of one family share one run of it on these."""
    models = {folder: load_model(folder, device="cpu") for folder in (tiny_bert_dir, tiny_gpt2_dir)}
    return lambda name: {"model": models[family_model(name, tiny_bert_dir, tiny_gpt2_dir)], "corpus": str(family_corpus(name, treebank)),
                         **small_settings(name)}


@parametrize_with_checks(families=registered().values())
def test_family(family, check, family_inputs):
    check(family, **family_inputs(family.name))


@pytest.fixture
def study_inputs(tiny_bert_dir, tiny_gpt2_dir, tiny_classifier_dir, tiny_mlm_dir, tuned_dir, treebank, cat_task, tmp_path):
    """Each study's small inputs (its options by name), its run folder inside ``tmp_path``."""
    from conftest import write_books

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(TEXTS) + "\n")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"clean": "the cat is under the", "corrupt": "the dog is under the", "answer": " house", "wrong": " cat"}\n')
    out = tmp_path / "out" / "run"
    task = {"task": cat_task, "model": str(tiny_classifier_dir), "out": out, "seed": 1, "quiet": True, "device": "cpu"}
    families = {name: {"model": str(family_model(name, tiny_bert_dir, tiny_gpt2_dir)), "corpus": family_corpus(name, treebank), "out": out,
                       "quiet": True, "device": "cpu",
                       **{key: value for key, value in SMALL.items() if key in {option.name for option in registered()[name].options}}}
                for name in FAMILIES}
    return {
        **families,
        "analyze": {"model": str(tiny_bert_dir), "corpus": treebank, "out": out, "quiet": True, "device": "cpu", "bootstrap": 200, "probe_folds": 2,
                    "probe_epochs": 2},
        "finetune": {**task, "model": str(tiny_bert_dir), "epochs": 0.5, "max_train_examples": 8, "batch_size": 4},
        "pretrain": {"corpus": [write_books(tmp_path / "books")], "out": out, "vocab_size": 120, "layers": 2, "heads": 2, "hidden": 32, "max_length": 32,
                     "batch_size": 8, "steps": 4, "checkpoints": 2, "quiet": True, "device": "cpu"},
        "track": {"checkpoint": [str(tiny_bert_dir), str(tiny_bert_dir)], "steps": "0,10", "corpus": text, "out": out, "bootstrap": 200, "quiet": True,
                  "device": "cpu"},
        "compare": {"model_a": str(tiny_bert_dir), "model_b": str(tiny_bert_dir), "corpus": text, "out": out, "quiet": True, "device": "cpu"},
        "ablate": {**task, "bootstrap": 200, "max_examples": 12},
        "importance": {**task, "importance_examples": 12},
        "prune": {**task, "importance_examples": 12, "max_examples": 12, "step": 0.25},
        "restore": {**task, "model": str(tuned_dir), "bootstrap": 200, "max_dev_examples": 12},
        "gradients": {"model": str(tiny_mlm_dir), "corpus": text, "out": out, "quiet": True, "device": "cpu"},
        "patch": {"model": str(tiny_gpt2_dir), "pairs": pairs, "out": out, "quiet": True, "device": "cpu", "bootstrap": 200},
    }


@parametrize_with_checks(studies=registered_studies().values())
def test_study(study, check, study_inputs):
    check(study, **study_inputs.get(study.name, {}))


def test_every_study_with_a_folder_has_inputs_here(study_inputs):
    folders = {name for name, study in registered_studies().items() if study.writes == "folder"}
    assert folders <= set(study_inputs), f"studies without inputs for their checks: {folders - set(study_inputs)}"


# Each rule catches what it is for.

def test_the_tables_check_catches_an_undeclared_table(family_inputs, monkeypatch):
    family = registered()["mixing"]
    monkeypatch.setattr(type(family), "outputs", ())
    with pytest.raises(AssertionError, match="writes tables it does not declare: \\['mixing'\\]"):
        check_tables_declared(family, **family_inputs("mixing"))


def test_the_tables_check_catches_a_declared_table_not_written(family_inputs, monkeypatch):
    family = registered()["mixing"]
    monkeypatch.setattr(type(family), "outputs", ("mixing", "mixing_by_head"))
    with pytest.raises(AssertionError, match="declares outputs it did not write: \\['mixing_by_head'\\]"):
        check_tables_declared(family, **family_inputs("mixing"))


def test_the_round_trip_check_catches_an_option_the_command_drops(monkeypatch):
    from bertology.studies.analyze import FamilyCommand

    family = registered()["frames"]
    run = FamilyCommand.run

    def dropping(self, settings, command=None):
        return run(self, {**settings, "frame_top": 10}, command)

    monkeypatch.setattr(FamilyCommand, "run", dropping)
    with pytest.raises(AssertionError, match="option frame_top given as \\['--frame-top', '11'\\] reached analyze\\(\\) as None"):
        check_options_round_trip(family)


def test_the_whole_folder_check_catches_a_run_that_swaps_in_before_it_fails(study_inputs, monkeypatch):
    from bertology.core.storage.runfolder import RunFolder

    study, given = registered_studies()["gradients"], study_inputs["gradients"]
    commit = RunFolder.commit

    def half_written(self, keep=()):
        (self.path / "report.html").unlink()
        return commit(self, keep)

    check_failed_run_keeps_previous(study, **given)  # whole: passes
    monkeypatch.setattr(RunFolder, "commit", half_written)
    with pytest.raises(AssertionError, match="report.html"):
        STUDY_CHECKS["folder_written_whole"](study, **given)


def test_the_foreign_files_check_catches_a_run_that_deletes_them(study_inputs, monkeypatch):
    monkeypatch.setattr("bertology.core.storage.runfolder.foreign_refusal", lambda *args: None)
    with pytest.raises(AssertionError, match="the command was not refused"):
        STUDY_CHECKS["foreign_files_kept"](registered_studies()["gradients"], **study_inputs["gradients"])
    assert not (Path(study_inputs["gradients"]["out"]) / "NOTES.md").exists()  # what the check guards against: the notes are gone


# The public way itself: ids, one kind per test, and every check at once for a notebook.

def test_parametrize_with_checks_gives_each_check_of_each_object_its_own_id():
    from bertology.families.profile.analyzer import GeneralProfile
    from bertology.testing import ANALYZER_CHECKS

    mark = parametrize_with_checks(families=[registered()["mixing"], registered()["frames"]]).mark
    assert mark.args[0] == ("family", "check") and len(mark.args[1]) == 2 * len(FAMILY_CHECKS) == 8
    assert mark.kwargs["ids"][:2] == ["mixing-tables_declared", "mixing-section_renders_full"] and mark.kwargs["ids"][-1] == "frames-options_round_trip"
    assert mark.args[1][5] == (registered()["frames"], FAMILY_CHECKS["section_renders_full"])
    mark = parametrize_with_checks(analyzers=[GeneralProfile]).mark
    assert mark.args[0] == ("analyzer", "check") and mark.kwargs["ids"] == [f"heads-{name}" for name in ANALYZER_CHECKS]
    mark = parametrize_with_checks(studies=[registered_studies()["info"]]).mark
    assert mark.args[0] == ("study", "check") and mark.kwargs["ids"][0] == "info-help_imports_nothing_heavy"


@pytest.mark.parametrize("kinds", [{}, {"families": registered().values(), "studies": registered_studies().values()}])
def test_parametrize_with_checks_takes_one_kind_of_object(kinds):
    from bertology.core.errors import BertologyError

    with pytest.raises(BertologyError, match="^parametrize_with_checks: give one of families, studies or analyzers .* not (none|family and study)$"):
        parametrize_with_checks(**kinds)


def test_check_family_runs_every_check_and_stops_at_a_broken_one(family_inputs, monkeypatch):
    family = registered()["mixing"]
    assert check_family(family, **family_inputs("mixing")) == dict.fromkeys(FAMILY_CHECKS, "passed")
    monkeypatch.setattr(type(family), "command", False)
    assert check_family(family, **family_inputs("mixing"))["options_round_trip"] == "skipped: family mixing has no command of its own"
    monkeypatch.setattr(type(family), "outputs", ())
    with pytest.raises(AssertionError, match="writes tables it does not declare"):
        check_family(family, **family_inputs("mixing"))


def test_a_family_checked_before_it_is_registered_is_told_so(family_inputs):
    from bertology.families import Family

    class Unregistered(Family):
        name = "unregistered_for_test"

    with pytest.raises(AssertionError, match="^family unregistered_for_test is not registered: bertology.register_family\\(Unregistered\\(\\)\\)"):
        check_family(Unregistered(), **family_inputs("mixing"))


def test_check_study_skips_the_folder_checks_of_a_study_that_writes_none():
    outcomes = check_study(registered_studies()["info"])
    assert outcomes["help_imports_nothing_heavy"] == "passed"
    assert {outcomes[name] for name in STUDY_CHECKS if name != "help_imports_nothing_heavy"} == {"skipped: info writes nothing, not a run folder"}


def test_the_study_checks_write_into_a_fresh_temporary_folder_when_out_is_left_out(study_inputs, monkeypatch):
    study = registered_studies()["gradients"]
    outs, run = [], type(study).run

    def recorded(self, settings, command=None):
        outs.append(Path(settings["out"]))
        return run(self, settings, command)

    monkeypatch.setattr(type(study), "run", recorded)
    assert check_study(study, **study_inputs["gradients"]) == dict.fromkeys(STUDY_CHECKS, "passed")  # its out is left out
    # a folder of its own for each check that runs it (the failed run's second try reuses its first's), removed after
    assert len(outs) == 4 and len(set(outs)) == 3 and not any(out.exists() for out in outs)


def test_the_help_check_runs_a_users_study_afresh_and_catches_its_heavy_import(tmp_path, monkeypatch):
    """A study in a module of the user's: the fresh interpreter imports that module (which registers it), and a module that
    imports pandas where it declares the study fails the check, naming pandas."""
    import importlib
    import sys

    from bertology import studies

    (tmp_path / "heavy_study_for_test.py").write_text("import pandas  # heavy, where the study is declared\n\n"
                                                      "from bertology.studies import Study, register_study\n\n\n"
                                                      "class Heavy(Study):\n    name = 'heavy_for_test'\n    title = 'Nothing.'\n\n\n"
                                                      "register_study(Heavy())\n")
    monkeypatch.chdir(tmp_path)  # the fresh interpreter finds the module here, as it finds a user's beside their tests
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(studies, "_registry", dict(studies.registered_studies()))  # registered for this test only
    try:
        importlib.import_module("heavy_study_for_test")
        with pytest.raises(AssertionError, match="^study heavy_for_test: --help imports .*pandas"):
            STUDY_CHECKS["help_imports_nothing_heavy"](studies.registered_studies()["heavy_for_test"])
    finally:
        sys.modules.pop("heavy_study_for_test", None)
