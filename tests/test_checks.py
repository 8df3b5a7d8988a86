"""Every registered family and study passes its contract, each rule its own test id (bertology.checks), as scikit-learn's
``parametrize_with_checks`` does for estimators; and each rule catches what it is for."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from conftest import TEXTS

from bertology.checks import FAMILY_CHECKS, STUDY_CHECKS, check_failed_run_keeps_previous, check_options_round_trip, check_tables_declared
from bertology.core.model.models import load_model
from bertology.families import registered
from bertology.studies import registered_studies

FRAMES_EXAMPLE = Path(str(resources.files("bertology") / "data" / "frames_example.jsonl"))
#: Settings that keep the families' runs small (each given to the families that have such an option).
SMALL = {"bootstrap": 200, "tau": 1.0, "seed": 3, "probe_folds": 2, "probe_epochs": 2, "head_distance_sample": 0.5, "probe_sentences": 50,
         "probe_tasks": "deprel"}  # the test treebank has relations, no UPOS
FAMILIES = list(registered())
STUDIES = list(registered_studies())


def family_corpus(name, treebank):
    return FRAMES_EXAMPLE if registered()[name].needs_frames else treebank


def family_model(name, tiny_bert_dir, tiny_gpt2_dir):
    """The tiny BERT, or for a family with no meaning on an encoder (the sinks measure what only a decoder has), the tiny GPT-2."""
    return tiny_bert_dir if "encoder" in registered()[name].kinds else tiny_gpt2_dir


@pytest.fixture(scope="module")
def family_runs(tiny_bert_dir, tiny_gpt2_dir, treebank, tmp_path_factory):
    """Each family run once on its own over a small corpus (trees, or frames), by name, made when first asked for."""
    from bertology.checks import run_family

    models, runs = {}, {}

    def run(name):
        if name not in runs:
            family = registered()[name]
            folder = family_model(name, tiny_bert_dir, tiny_gpt2_dir)
            model = models.setdefault(folder, load_model(folder, device="cpu"))
            settings = {key: value for key, value in SMALL.items() if key in {option.name for option in family.options} or key == "seed"}
            runs[name] = run_family(family, model, str(family_corpus(name, treebank)), tmp_path_factory.mktemp(name) / "run", **settings)
        return runs[name]

    return run


@pytest.mark.parametrize("check", FAMILY_CHECKS)
@pytest.mark.parametrize("name", FAMILIES)
def test_family(name, check, family_runs, tmp_path):
    family = registered()[name]
    if check == "options_round_trip":
        if not family.command:
            pytest.skip(f"{name} has no command of its own")
        FAMILY_CHECKS[check](family)
    elif check == "tables_declared":
        FAMILY_CHECKS[check](family, family_runs(name))
    else:
        FAMILY_CHECKS[check](family, family_runs(name), tmp_path / "section")


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


@pytest.mark.parametrize("check", STUDY_CHECKS)
@pytest.mark.parametrize("name", STUDIES)
def test_study(name, check, study_inputs):
    study = registered_studies()[name]
    if check == "help_imports_nothing_heavy":
        STUDY_CHECKS[check](study)
        return
    if study.writes != "folder":
        pytest.skip(f"{name} writes {'one file' if study.writes == 'file' else 'nothing'}, not a run folder")
    STUDY_CHECKS[check](study, study_inputs[name])


def test_every_study_with_a_folder_has_inputs_here(study_inputs):
    folders = {name for name, study in registered_studies().items() if study.writes == "folder"}
    assert folders <= set(study_inputs), f"studies without inputs for their checks: {folders - set(study_inputs)}"


# Each rule catches what it is for.

def test_the_tables_check_catches_an_undeclared_table(family_runs, monkeypatch):
    family = registered()["mixing"]
    monkeypatch.setattr(type(family), "outputs", ())
    with pytest.raises(AssertionError, match="writes tables it does not declare: \\['mixing'\\]"):
        check_tables_declared(family, family_runs("mixing"))


def test_the_tables_check_catches_a_declared_table_not_written(family_runs, monkeypatch):
    family = registered()["mixing"]
    monkeypatch.setattr(type(family), "outputs", ("mixing", "mixing_by_head"))
    with pytest.raises(AssertionError, match="declares outputs it did not write: \\['mixing_by_head'\\]"):
        check_tables_declared(family, family_runs("mixing"))


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

    check_failed_run_keeps_previous(study, given)  # whole: passes
    monkeypatch.setattr(RunFolder, "commit", half_written)
    with pytest.raises(AssertionError, match="report.html"):
        STUDY_CHECKS["folder_written_whole"](study, given)


def test_the_foreign_files_check_catches_a_run_that_deletes_them(study_inputs, monkeypatch):
    monkeypatch.setattr("bertology.core.storage.runfolder.foreign_refusal", lambda *args: None)
    with pytest.raises(AssertionError, match="the command was not refused"):
        STUDY_CHECKS["foreign_files_kept"](registered_studies()["gradients"], study_inputs["gradients"])
    assert not (Path(study_inputs["gradients"]["out"]) / "NOTES.md").exists()  # what the check guards against: the notes are gone
