"""Olsson et al.'s probe as a user gives it: a probe longer than the model reads is refused in one line before the pass,
at the exact longest length that fits (the tiny Llama adds a BOS); --synthetic-length without --synthetic-repeats is
refused; a family's setting is named by its flag."""

from __future__ import annotations

import json
import shutil

import pytest
from test_cli import bertology

from bertology import analyze
from bertology.core.errors import BertologyError
from bertology.families.headtypes.analyzer import INDUCTION
from bertology.studies.analyze import analysis


@pytest.fixture(scope="module")
def llama_32_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama told it reads 32 positions (rotary positions keep no table: its weights load as they are)."""
    folder = tmp_path_factory.mktemp("llama-32")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    return folder


def test_a_probe_longer_than_the_model_reads_is_refused_in_one_line(llama_32_dir, tmp_path):
    """50 pieces twice and the BOS are 101 pieces, over 32: refused, naming the flag, the positions and 15, the longest
    that fits (2 x 15 + 1 = 31); no run folder is begun."""
    out = tmp_path / "run"
    done = bertology("analyze", "--model", llama_32_dir, "--synthetic-repeats", "4", "--synthetic-length", "50", "--out", out,
                     "--device", "cpu", "-q")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: --synthetic-length 50 makes sequences of 101 pieces (two copies of 50 and 1 special token), more than the 32 positions "
        f"{llama_32_dir} reads: their second copies would be cut; the longest that fits is --synthetic-length 15"]
    assert not out.exists()


def test_the_longest_probe_that_fits_runs_whole_and_one_more_is_refused_before_the_pass(llama_32_dir, monkeypatch):
    """At 15 every sequence is read whole (nothing truncated) and each one's second copy is counted; at 16 (33 pieces) the
    run stops before its pass."""
    settings = dict(analyses=["headtypes"], min_sample=2, device="cpu", view=False, progress=False)
    result = analyze(llama_32_dir, synthetic_repeats=3, synthetic_length=15, **settings)
    assert result.stats.truncated == 0 and result.settings["max_length"] == 32
    table = result.table("head_types")
    assert (table[table.role == INDUCTION].n == 3).all()

    def no_pass(*args, **kwargs):
        raise AssertionError("the pass ran")

    monkeypatch.setattr(analysis, "run_pass", no_pass)
    with pytest.raises(BertologyError, match=r"^--synthetic-length 16 makes sequences of 33 pieces .* the longest that fits is --synthetic-length 15$"):
        analyze(llama_32_dir, synthetic_repeats=3, synthetic_length=16, **settings)
    with pytest.raises(BertologyError, match=r"more than --max-length 20: .* the longest that fits is --synthetic-length 9$"):
        analyze(llama_32_dir, synthetic_repeats=3, synthetic_length=15, max_length=20, **settings)


@pytest.mark.parametrize("flags, message", [
    (["--synthetic-length", "8"], "--synthetic-length 8 is the length of the --synthetic-repeats probe's sequences: give --synthetic-repeats N "
                                  "with it, or leave it out"),
    (["--no-headtypes", "--head-type-mass", "0.5"], "--head-type-mass is a setting of headtypes, which this run does not include"),
    (["--head-distance-sample", "0"], "--head-distance-sample is the share of sequences the head distance reads: give more than 0 and at most 1, "
                                      "not 0.0"),
])
def test_a_flag_without_what_it_goes_with_is_refused_by_its_flag(tiny_gpt2_dir, tmp_path, flags, message):
    out = tmp_path / "run"
    done = bertology("analyze", "--model", tiny_gpt2_dir, *flags, "--out", out, "--device", "cpu", "-q")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"error: {message}"]
    assert not out.exists()

