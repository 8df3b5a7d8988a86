"""Issue 49: ``bertology pretrain`` writes its run's identity into every checkpoint's ``pretraining_step.json``, and ``track``
refuses checkpoints of two runs (two seeds of one recipe) as one series, in one line naming both folders; checkpoints that name
no run (older ones, a plain model folder given with --steps) are still taken."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import TEXTS, write_books
from test_cli import bertology

from bertology.studies.pretrain.pretraining import pretrain
from bertology.studies.track.checkpoints import find_checkpoints
from studies.pretrain.test_pretraining import SMALL


def identity(checkpoint) -> dict:
    return json.loads((checkpoint / "pretraining_step.json").read_text())["run"]


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    """Two runs of one recipe, seeds 0 and 1; seed 0's interrupted at step 5 and resumed: their checkpoint folders."""
    root = tmp_path_factory.mktemp("two-seeds")
    books = write_books(root / "books")
    assert pretrain(books, root / "seed-0", steps=12, save_every=5, max_steps=5, seed=0, **SMALL) == {"interrupted_at_step": 5, "steps": 12}
    pretrain(books, root / "seed-0", steps=12, save_every=5, seed=0, **SMALL)
    pretrain(books, root / "seed-1", steps=12, seed=1, **SMALL)
    return {seed: [root / f"seed-{seed}" / "checkpoints" / name for name in sorted(p.name for p in (root / f"seed-{seed}" / "checkpoints").iterdir())]
            for seed in (0, 1)}


def test_each_checkpoint_names_its_run_and_a_resume_keeps_it(two_seeds):
    first, second = ([identity(checkpoint) for checkpoint in two_seeds[seed]] for seed in (0, 1))
    assert len(first) == len(second) == 4 and two_seeds[0][0].name == "step-000000" and two_seeds[0][-1].name == "step-000012"
    assert all(run == first[0] for run in first) and all(run == second[0] for run in second)  # before and after the resume at step 5
    assert (first[0]["seed"], second[0]["seed"]) == (0, 1)
    assert first[0]["recipe"] == second[0]["recipe"] and first[0]["id"] != second[0]["id"]  # one recipe, two runs
    assert [str(c) for c in two_seeds[0]] == find_checkpoints(two_seeds[0][0].parent.parent)


def test_checkpoints_of_two_seeds_are_refused_in_one_line(two_seeds, tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    a, b = two_seeds[0][0], two_seeds[1][-1]
    refused = bertology("track", b, a, "--corpus", corpus, "--bootstrap", 100, "--out", tmp_path / "t", "--device", "cpu", "-q")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    one, other = identity(a), identity(b)
    assert refused.stderr.strip().splitlines() == [
        f"error: {b}: not of one run with {a}: its pretraining_step.json names run {other['id'][:12]} (seed 1, recipe {other['recipe']}), "
        f"not {one['id'][:12]} (seed 0, recipe {one['recipe']}); track the checkpoints of one run"]
    assert not (tmp_path / "t").exists()


def test_checkpoints_that_name_no_run_are_taken(two_seeds, tmp_path):
    """Seed 0's first checkpoint, seed 1's last with its run left out of pretraining_step.json (written before runs had an
    identity), and a plain model folder with no pretraining_step.json, given with --steps: one series."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    older, plain = (shutil.copytree(two_seeds[1][k], tmp_path / name) for k, name in ((-1, "older"), (1, "plain")))
    marker = json.loads((older / "pretraining_step.json").read_text())
    (older / "pretraining_step.json").write_text(json.dumps({key: value for key, value in marker.items() if key != "run"}))
    (plain / "pretraining_step.json").unlink()
    tracked = bertology("track", two_seeds[0][0], older, plain, "--steps", "0,20,10", "--corpus", corpus, "--bootstrap", 100,
                        "--out", tmp_path / "t", "--device", "cpu", "-q")
    assert tracked.returncode == 0, tracked.stderr
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert [c["step"] for c in manifest["checkpoints"]] == [0, 10, 20]
    # a damaged identity is refused in one line naming the file
    (older / "pretraining_step.json").write_text(json.dumps({**marker, "run": "seed 1"}))
    damaged = bertology("track", two_seeds[0][0], older, "--steps", "0,20", "--corpus", corpus, "--out", tmp_path / "t2", "--device", "cpu", "-q")
    assert damaged.returncode != 0 and "Traceback" not in damaged.stderr
    assert damaged.stderr.strip().splitlines() == [f"error: {older / 'pretraining_step.json'}: 'run' must be dict, not \"seed 1\""]
