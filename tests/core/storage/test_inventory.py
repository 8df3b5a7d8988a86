"""The run folder's inventory (issue 49, case 1): a run lists what it wrote, and a later run into the folder is refused,
before it runs, while the folder holds anything else; work folders are the run's own; an earlier bertology's folder,
which lists nothing, is refused unless it holds nothing but its own; a file that comes while a run runs is kept too."""

import json
import os

import pytest

from bertology.core.errors import BertologyError
from bertology.core.storage.runfolder import MARKER, RunFolder, check_out, claim, claims_out


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def make_run(out, **files):
    with RunFolder(out) as run:
        for name, text in files.items():
            run.write_text(name, text)
    return out


def refusal(out, **kwargs) -> str:
    with pytest.raises(BertologyError) as error:
        check_out(out, **kwargs)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_the_marker_lists_each_file_and_folder_the_run_wrote(tmp_path):
    out = make_run(tmp_path / "run", **{"report.html": "page", "figures/a.png": "png"})
    inventory = json.loads((out / MARKER).read_text())
    assert sorted(inventory["files"]) == ["figures/a.png", "report.html"] and inventory["folders"] == ["figures"]
    assert inventory["files"]["report.html"]["bytes"] == 4
    check_out(out)  # nothing else there: a rerun may replace it


@pytest.mark.parametrize("planted", ["notes.txt", "figures/mine.png", "my_figures/"])
def test_anything_the_run_did_not_write_is_refused_before_the_run_and_kept(tmp_path, planted):
    out = make_run(tmp_path / "run", **{"report.html": "page", "figures/a.png": "png"})
    if planted.endswith("/"):
        (out / planted).mkdir()  # an empty folder is the user's too
    else:
        (out / planted).write_text("mine")
    before = snapshot(out)
    ran = []

    @claims_out
    def work(*, out=None):
        ran.append(out)

    with pytest.raises(BertologyError) as error:
        work(out=out)
    assert str(error.value) == (f"{out}: holds {planted}, which the earlier run did not write; a new run replaces the folder whole and would "
                                "delete it: move it out of the folder or choose another --out")
    assert ran == [] and snapshot(out) == before and [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_file_of_the_run_with_other_bytes_is_refused_one_with_the_same_bytes_is_not(tmp_path):
    out = make_run(tmp_path / "run", **{"report.html": "page"})
    (out / "report.html").write_text("mine")  # the same size, edited
    assert "holds report.html, changed since the earlier run wrote it;" in refusal(out)
    (out / "report.html").write_text("page")
    os.utime(out / "report.html", ns=(0, 0))  # the run's bytes at another time (a copied folder): read and found the same
    check_out(out)
    (out / "report.html").unlink()
    (out / "report.html").symlink_to(tmp_path / "elsewhere")  # a link where the run wrote a file is not the run's
    assert "holds report.html, which the earlier run did not write" in refusal(out)


def test_work_folders_are_the_runs_own(tmp_path):
    out = make_run(tmp_path / "run", **{"report.html": "page"})
    (out / "resume").mkdir()
    (out / "resume" / "state.json").write_text("{}")
    (out / "resume.partial").mkdir()
    check_out(out, work="resume")
    with claim(out, work="resume"):  # an analysis resuming there replaces the folder, work and all
        with RunFolder(out) as folder:
            folder.write_text("report.html", "new page")
    assert (out / "report.html").read_text() == "new page" and not (out / "resume").exists()


def test_an_earlier_bertologys_run_folder_is_replaced_only_when_it_holds_nothing_of_a_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / MARKER).write_text("A bertology run folder: a new run writing here replaces it whole.\n")  # an earlier marker: no list
    (out / "resume").mkdir()  # an earlier bertology's unfinished analysis: nothing but its work, resumed
    check_out(out, work="resume")
    (out / "heads.csv").write_text("layer,head\n")
    message = refusal(out, work="resume")
    assert message == (f"{out}: a run folder of an earlier bertology, which did not list the files it wrote, so yours cannot be told from its "
                       "own (the first: heads.csv); a new run replaces the folder whole: move out what you keep and delete it, or choose "
                       "another --out")
    assert (out / "heads.csv").read_text() == "layer,head\n"


def test_a_file_that_comes_while_the_run_runs_is_kept_and_so_is_the_run(tmp_path):
    out = make_run(tmp_path / "run", **{"report.html": "earlier"})
    with pytest.raises(BertologyError) as error, claim(out):
        folder = RunFolder(out)
        folder.write_text("report.html", "new")
        (out / "notes.txt").write_text("mine")
        folder.commit()
    staged = folder.path
    assert str(error.value).startswith(f"{out}: holds notes.txt, which the earlier run did not write;")
    assert str(error.value).endswith(f"(it came while this run ran: the run's outputs are left in {staged})")
    assert snapshot(out) == {MARKER: (out / MARKER).read_bytes(), "notes.txt": b"mine", "report.html": b"earlier"}
    assert (staged / "report.html").read_text() == "new" and "report.html" in json.loads((staged / MARKER).read_text())["files"]
