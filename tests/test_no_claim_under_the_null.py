"""No claim under the null (issue 39): on null models, whose every head attends uniformly over the keys it may see (the
tiny BERT, GPT-2 and grouped-query Llama with their queries zeroed, ``analyze(null="uniform")``), over held-out EWT trees
and RTE sentence pairs, ``analyze`` with roles, patterns, syntax, classes and sinks claims nothing; the calibration is
printed by the command line."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from bertology import analyze
from bertology.core.model.models import load_model

#: The families whose tests make claims of heads (the sinks family runs on the decoders; the head types on both kinds, on an
#: encoder duplicate-token alone).
CLAIMING = ["profile", "roles", "patterns", "syntax", "classes", "sinks", "headtypes"]
SENTENCES = 40


def ewt_trees(shared: Path, folder: Path, count: int = SENTENCES) -> Path:
    """The first ``count`` sentences of the UD EWT test set, as a CoNLL-U file (bench/null_claims.py takes 300)."""
    blocks = (shared / "ud_english_ewt" / "en_ewt-ud-test.conllu").read_text(encoding="utf-8").split("\n\n")
    path = folder / "ewt.conllu"
    path.write_text("\n\n".join(blocks[:count]) + "\n\n", encoding="utf-8")
    return path


def rte_pairs(shared: Path, folder: Path, count: int = SENTENCES) -> Path:
    """The first ``count`` RTE dev pairs, as a two-column TSV of sentence pairs."""
    with open(shared / "glue" / "RTE" / "dev.tsv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))[:count]
    path = folder / "rte.tsv"
    path.write_text("".join(f"{row['sentence1']}\t{row['sentence2']}\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    from conftest import SHARED_DATA

    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not beside this checkout")
    folder = tmp_path_factory.mktemp("null-corpora")
    return {"trees": ewt_trees(SHARED_DATA, folder), "pairs": rte_pairs(SHARED_DATA, folder)}


@pytest.mark.parametrize("corpus_name", ["trees", "pairs"])
@pytest.mark.parametrize("model_fixture", ["tiny_bert_dir", "tiny_gpt2_dir", "tiny_llama_dir"])
def test_a_null_model_claims_nothing(model_fixture, corpus_name, corpora, request):
    loaded = load_model(request.getfixturevalue(model_fixture), device="cpu")
    families = [name for name in CLAIMING if (name != "syntax" or corpus_name == "trees") and (name != "sinks" or loaded.kind.name == "decoder")]
    result = analyze(loaded, corpora[corpus_name], analyses=families, null="uniform", view=False, progress=False, max_length=64)
    claims = {family: lines for family, lines in result.claims().items() if lines}
    assert claims == {}, claims
    assert result.claims_line().startswith("null model uniform: 0 claims")


def test_the_calibration_is_printed_on_the_command_line(tiny_gpt2_dir, corpora, tmp_path):
    done = subprocess.run([sys.executable, "-m", "bertology.cli", "analyze", "--model", str(tiny_gpt2_dir), "--corpus", str(corpora["pairs"]),
                           "--null", "uniform", "--out", str(tmp_path / "run"), "--quiet", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "null model uniform: 0 claims, as a null model should" in done.stdout, done.stdout[-2000:]


def test_calibrate_runs_the_null_model_beside_the_run_and_shows_both(tiny_llama_dir, corpora, tmp_path):
    done = subprocess.run([sys.executable, "-m", "bertology.cli", "analyze", "--model", str(tiny_llama_dir), "--corpus", str(corpora["trees"]),
                           "--calibrate", "--out", str(tmp_path / "run"), "--quiet", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    real = next(line for line in done.stdout.splitlines() if line.startswith("claims: "))
    assert "calibration, null model uniform: 0 claims, as a null model should" in done.stdout, done.stdout[-2000:]
    # the run's own tables are the model's, not the null's: the same as a run without --calibrate
    alone = analyze(load_model(tiny_llama_dir, device="cpu"), corpora["trees"], view=False, progress=False)
    assert real == alone.claims_line()
    report = (tmp_path / "run" / "report.html").read_text(encoding="utf-8")
    assert "null model uniform: 0 claims, as a null model should" in report and real in report


@pytest.mark.parametrize("model_fixture", ["tiny_bert_dir", "tiny_gpt2_dir"])
def test_a_null_model_claims_nothing_under_every_view_of_attention(model_fixture, corpora, request):
    # under the norm, ALTI and value-zeroing views the uniform head is seen through the same view (each head's own vectors),
    # so a null model's heads do no more than it there too (the norm view alone made 67 role claims on the bundled model)
    loaded = load_model(request.getfixturevalue(model_fixture), device="cpu")
    families = [name for name in CLAIMING if name != "sinks"]
    result = analyze(loaded, corpora["trees"], analyses=families, null="uniform", view=False, progress=False, max_length=64,
                     weighting="norm,alti,value-zeroing")
    assert set(result.table("roles").weighting) == {"norm", "alti", "value-zeroing"}
    claims = {family: lines for family, lines in result.claims().items() if lines}
    assert claims == {}, claims
