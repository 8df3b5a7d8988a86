"""The command line from end to end, as a user runs it (a separate process)."""

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
from conftest import TEXTS

from bertology.core.model.kinds import ENCODER
from bertology.families.profile.analyzer import profile_metric_names


def bertology(*args, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "bertology.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


def test_analyze_writes_a_complete_run_folder(tiny_bert_dir, corpus, tmp_path):
    out = tmp_path / "run"
    result = bertology("analyze", "--model", tiny_bert_dir, "--corpus", corpus, "--out", out, "--batch-size", 3, "--head-distance-sample", 1,
                       "--device", "cpu", "--quiet")
    assert result.returncode == 0, result.stderr
    assert f"report: {(out / 'report.html').resolve()}" in result.stdout
    heads = pd.read_csv(out / "heads.csv")
    assert list(heads.columns) == ["layer", "head", "metric", "value", "ci_low", "ci_high", "n", "uniform", "excess", "excess_ci_low", "excess_ci_high"]
    assert len(heads) == 2 * 4 * len(profile_metric_names(ENCODER))
    assert (heads.n == len(TEXTS)).all()
    pd.testing.assert_frame_equal(pd.read_parquet(out / "heads.parquet"), heads, check_dtype=False)
    for name in ("layers.csv", "head_map.csv", "head_distance.csv", "special_tokens_by_layer.png", "head_map.png", "heatmaps.png", "report.html"):
        assert (out / name).is_file(), name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["corpus"]["examples"] == len(TEXTS) and len(manifest["corpus"]["sha256"]) == 64
    assert manifest["seed"] == 0 and "transformers" in manifest["versions"]
    assert "--batch-size" in manifest["command"]
    report = (out / "report.html").read_text()
    assert report.count("data:image/png;base64,") >= 3 and "<script" not in report


def test_limit_and_max_length_are_reported(tiny_bert_dir, corpus, tmp_path):
    result = bertology("analyze", "-m", tiny_bert_dir, "-c", corpus, "-o", tmp_path / "r", "--limit", 3, "--max-length", 8, "--skip-long", "-q")
    assert result.returncode == 0, result.stderr
    assert "1 sequences (0 truncated, 2 skipped as too long)" in result.stdout


def test_bad_corpus_is_one_line_naming_file_and_line(tiny_bert_dir, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n\xfe\xff broken\n")
    result = bertology("analyze", "--model", tiny_bert_dir, "--corpus", bad, "--out", tmp_path / "run", "-q")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {bad}:2: invalid UTF-8 at byte 0 of the line"
    assert not (tmp_path / "run").exists()  # validated before any model ran


def test_unknown_model_is_one_line(corpus, tmp_path):
    result = bertology("analyze", "--model", "nobody/nothing", "--corpus", corpus, "--out", tmp_path / "run", "-q")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pass the path of a local model folder" in lines[0]


def test_info_prints_model_facts(tiny_roberta_dir):
    result = bertology("info", "--model", tiny_roberta_dir, "--device", "cpu")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert (info["layers"], info["heads"], info["cls_token"], info["sep_token"]) == (2, 4, "<s>", "</s>")


def test_syntax_writes_tables_probe_and_report(tiny_bert_dir, treebank, tmp_path):
    out = tmp_path / "syntax"
    result = bertology("syntax", "--corpus", treebank, "--model", tiny_bert_dir, "--out", out, "--bootstrap", 100,
                       "--probe-folds", 2, "--probe-epochs", 2, "--heatmap-relation", "det", "-q")
    assert result.returncode == 0, result.stderr
    assert "parsing probe UAS (2-fold cross-validation over sentences): attn" in result.stdout
    syntax = pd.read_csv(out / "syntax.csv")
    assert list(syntax.columns) == ["relation", "direction", "layer", "head", "accuracy", "n", "uniform"]
    assert set(syntax.direction) == {"dep->head", "head->dep"} and "all" in set(syntax.relation)
    best = pd.read_csv(out / "syntax_best.csv")
    assert list(best.columns)[:12] == ["relation", "n", "layer", "head", "direction", "accuracy", "ci_low", "ci_high",
                                       "baseline_offset", "baseline_accuracy", "p_value", "p_adj"]
    tested = best[~best.few]  # relations under --min-dependents get no interval and no p
    assert best.relation.iloc[0] == "all" and (tested.ci_low <= tested.accuracy).all() and (tested.accuracy <= tested.ci_high).all()
    assert best[best.few][["ci_low", "ci_high", "p_value", "p_adj"]].isna().all().all() and not best[best.few].significant.any()
    probe = json.loads((out / "probe.json").read_text())
    assert set(probe["uas"]) == {"attn", "attn+emb", "uniform_attn", "uniform_attn+emb", "right_branching", "left_branching", "best_offset"}
    assert (out / "syntax_best.png").is_file() and (out / "syntax_heatmap_det.png").is_file()
    assert not (out / "heads.csv").exists()  # syntax alone
    assert "Syntactic heads" in (out / "report.html").read_text()


def test_analyze_adds_syntax_for_trees_and_spacy(tiny_bert_dir, treebank, corpus, tmp_path):
    result = bertology("analyze", "-m", tiny_bert_dir, "-c", treebank, "-o", tmp_path / "gold", "--bootstrap", 100, "--no-probe", "-q")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "gold" / "heads.csv").is_file() and (tmp_path / "gold" / "syntax_best.csv").is_file()
    result = bertology("analyze", "-m", tiny_bert_dir, "-c", corpus, "-o", tmp_path / "spacy", "--parser", "spacy", "--bootstrap", 100, "--no-probe", "-q")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "spacy" / "manifest.json").read_text())
    assert manifest["settings"]["parser"] == "spacy" and manifest["settings"]["analyses"] == ["profile", "roles", "patterns", "syntax", "rollout", "mixing"]
    roles = pd.read_csv(tmp_path / "spacy" / "roles.csv")
    assert {"syntactic", "local", "delimiter"} <= set(roles.role)  # spaCy trees give syntactic roles


def test_syntax_without_trees_is_one_line(tiny_bert_dir, corpus, tmp_path):
    result = bertology("syntax", "-m", tiny_bert_dir, "-c", corpus, "-o", tmp_path / "run", "-q")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: syntax needs dependency trees: give a CoNLL-U corpus or --parser spacy (tiny.txt has none)"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.tsv"
    path.write_text("\n".join(f"{a}\t{b}" for a, b in zip(TEXTS, TEXTS[1:] + TEXTS[:1])) + "\n")
    return path


def test_roles_and_patterns_commands(tiny_bert_dir, pairs, tmp_path):
    result = bertology("roles", "-m", tiny_bert_dir, "-c", pairs, "-o", tmp_path / "roles", "--tau", 1.5, "--correction", "bonferroni", "-q")
    assert result.returncode == 0, result.stderr
    roles = pd.read_csv(tmp_path / "roles" / "roles.csv")
    assert list(roles.columns) == ["layer", "head", "role", "mean", "ci_low", "ci_high", "uniform", "excess", "t", "p", "t_excess", "p_excess",
                                   "p_adj", "has_role", "n"]
    assert set(roles.role) == {"local", "delimiter", "cls", "sep", "block"}
    assert (roles.n == len(TEXTS)).all()
    shares = pd.read_csv(tmp_path / "roles" / "role_shares.csv")
    assert sorted(shares.tau.unique()) == [1.0, 1.5, 2.0, 3.0]
    manifest = json.loads((tmp_path / "roles" / "manifest.json").read_text())
    assert manifest["settings"]["tau"] == 1.5 and manifest["settings"]["correction"] == "bonferroni"

    result = bertology("patterns", "-m", tiny_bert_dir, "-c", pairs, "-o", tmp_path / "patterns", "--pattern-thresholds", "vertical=0.4", "-q")
    assert result.returncode == 0, result.stderr
    patterns = pd.read_csv(tmp_path / "patterns" / "patterns.csv")
    assert list(patterns.columns) == ["layer", "head", "pattern", "share", "n", "majority"]
    assert patterns.groupby(["layer", "head"]).share.sum().round(9).eq(1).all()
    assert set(patterns.majority) <= set(patterns.pattern)
    report = (tmp_path / "patterns" / "report.html").read_text()
    assert "Attention patterns" in report and "vertical if &gt;= 0.4" in report
    assert json.loads((tmp_path / "patterns" / "manifest.json").read_text())["settings"]["pattern_thresholds"]["vertical"] == 0.4


def test_ablate_importance_and_prune_write_their_tables(tiny_classifier_dir, cat_task, tmp_path):
    out = tmp_path / "ablate"
    result = bertology("ablate", cat_task, "--model", tiny_classifier_dir, "--out", out, "--bootstrap", 200, "--device", "cpu", "--quiet")
    assert result.returncode == 0, result.stderr
    ablation = pd.read_csv(out / "ablation.csv")
    assert list(ablation.columns) == ["layer", "head", "intervention", "metric", "value", "delta", "ci_low", "ci_high", "p", "p_adj", "matters", "n"]
    assert len(ablation) == 3 * (4 + 1) and set(ablation["head"]) == {-1, 0, 1, 2, 3}
    assert (out / "ablation_heatmap.png").is_file() and "Which heads matter" in (out / "report.html").read_text()

    out = tmp_path / "prune"
    result = bertology("prune", cat_task, "--model", tiny_classifier_dir, "--out", out, "--step", 0.2, "--prune-to", 6, "--device", "cpu", "--quiet")
    assert result.returncode == 0, result.stderr
    importance = pd.read_csv(out / "importance.csv")
    assert list(importance.columns) == ["layer", "head", "importance", "importance_normalised"]
    pruning = pd.read_csv(out / "pruning.csv")
    assert list(pruning.columns) == ["heads_pruned", "share_pruned", "metric", "value", "removed"]
    assert 6 in pruning.heads_pruned.tolist()
    pruned = json.loads((out / "pruned.json").read_text())
    assert pruned["heads_kept"] == 6 and (out / "pruned-6-heads" / "model.safetensors").is_file()
    assert "pruned to 6 heads" in result.stdout and (out / "pruning_curve.png").is_file()

    result = bertology("importance", cat_task, "--model", out / "pruned-6-heads", "--out", tmp_path / "importance", "--device", "cpu", "--quiet")
    assert result.returncode == 2 and "heads were removed from this model" in result.stderr


def test_ablate_needs_a_classifier_and_says_so_in_one_line(tiny_bert_dir, cat_task, tmp_path):
    result = bertology("ablate", cat_task, "--model", tiny_bert_dir, "--out", tmp_path / "x", "--device", "cpu", "--quiet")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1


def test_pretrain_then_track_the_checkpoints(corpus, tmp_path):
    from conftest import write_books

    books = write_books(tmp_path / "books")
    result = bertology("pretrain", books, "--out", tmp_path / "pt", "--steps", 12, "--vocab-size", 120, "--layers", 2, "--heads", 2,
                       "--hidden", 32, "--max-length", 32, "--batch-size", 8, "--checkpoints", 3, "--device", "cpu", "-q")
    assert result.returncode == 0, result.stderr
    assert "validation masked-LM loss" in result.stdout and "unigram baseline" in result.stdout
    result = bertology("track", "--checkpoints", tmp_path / "pt", "--corpus", corpus, "--bootstrap", 100, "--out", tmp_path / "track",
                       "--device", "cpu", "-q")
    assert result.returncode == 0, result.stderr
    assert "depth: " in result.stdout and "training: " in result.stdout
    assert sorted(pd.read_csv(tmp_path / "track" / "track.csv").step.unique()) == [0, 10, 12]
    neither = bertology("track", "--corpus", corpus)
    assert neither.returncode == 2 and neither.stderr.strip().splitlines() == ["error: give checkpoints as arguments or --checkpoints DIR (one of the two)"]
    missing = bertology("pretrain", tmp_path / "nothing-here")
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: {tmp_path / 'nothing-here'}: no such file or folder"


@pytest.mark.parametrize("command", [
    ["analyze", "-m", "nobody/none", "-c", "{missing}"], ["roles", "-m", "nobody/none", "-c", "{missing}"],
    ["patterns", "-m", "nobody/none", "-c", "{missing}"], ["syntax", "-m", "nobody/none", "-c", "{missing}"],
    ["compare", "nobody/a", "nobody/b", "-c", "{missing}"], ["track", "nobody/a", "nobody/b", "-c", "{missing}"],
    ["finetune", "{missing}", "-m", "nobody/none"], ["pretrain", "{missing}"], ["ablate", "{missing}", "-m", "nobody/none"],
    ["importance", "{missing}", "-m", "nobody/none"], ["prune", "{missing}", "-m", "nobody/none"],
])
def test_out_is_refused_before_any_input_is_read(command, tmp_path):
    from typer.testing import CliRunner

    from bertology.cli import app
    from bertology.core.errors import BertologyError

    taken = tmp_path / "taken.txt"
    taken.write_text("not a folder\n")
    args = [arg.format(missing=tmp_path / "missing") for arg in command] + ["--out", str(taken)]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, BertologyError) and str(result.exception) == (
        f"{taken}: is a file, not a folder; give a new folder or an earlier run folder")


def test_a_failing_analysis_keeps_the_others_and_exits_non_zero(tiny_bert_dir, treebank, tmp_path):
    out = tmp_path / "run"
    result = bertology("analyze", "-m", tiny_bert_dir, "-c", treebank, "-o", out, "--max-length", 3, "--bootstrap", 100, "--no-probe", "-q")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line == f"error: syntax failed: no sentence had a dependency tree with a scorable dependent; the other analyses are saved in {out.resolve()}"
    assert (out / "heads.csv").is_file() and (out / "roles.csv").is_file() and not (out / "syntax.csv").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "partial" and list(manifest["failures"]) == ["syntax"]


def test_view_refuses_a_folder_as_its_page_before_loading_the_model(tmp_path):
    from typer.testing import CliRunner

    from bertology.cli import app
    from bertology.core.errors import BertologyError

    result = CliRunner().invoke(app, ["view", "a cat sat.", "--model", str(tmp_path / "missing"), "--out", str(tmp_path)])
    assert isinstance(result.exception, BertologyError)
    assert str(result.exception) == f"{tmp_path}: is a folder; give the file to write, for instance {tmp_path / 'view.html'}"


def test_help_text_keeps_its_square_brackets():
    # typer reads help as rich markup: "[default: ...]" and "bertology[ray]" would vanish from the help without escaping
    result = bertology("track", "--help")
    text = " ".join(result.stdout.replace("│", " ").split())
    assert result.returncode == 0 and "pip install 'bertology[ray]'" in text and "Most pieces per sequence [default: the model's]" in text


def test_a_seed_outside_0_to_2_32_is_refused_by_every_command_that_takes_it(tmp_path):
    from typer.testing import CliRunner

    from bertology.cli import app
    from bertology.studies import registered_studies

    seeded = [name for name, study in registered_studies().items() if any(option.name == "seed" for option in study.options)]
    assert {"analyze", "profile", "compare", "track", "pretrain", "finetune", "gradients", "label"} <= set(seeded)
    for name in seeded:
        out = ["--out", str(tmp_path / "run")] if any(option.name == "out" for option in registered_studies()[name].options) else []
        for seed in (2**70, 2**32, -1):
            result = CliRunner().invoke(app, [name.replace("_", "-"), "--seed", str(seed), *out])
            assert result.exit_code == 2 and "Invalid value for '--seed'" in result.output, (name, seed, result.output)
    assert not (tmp_path / "run").exists()


def test_analyze_with_a_seed_of_2_to_the_70_writes_nothing(tiny_bert_dir, corpus, tmp_path):
    result = bertology("analyze", "-m", tiny_bert_dir, "-c", corpus, "--seed", 2**70, "--out", tmp_path / "run", "--device", "cpu", "-q")
    assert result.returncode == 2 and "Invalid value for '--seed'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_analyze_with_a_head_distance_sample_of_0_is_one_line(tiny_bert_dir, corpus, tmp_path):
    result = bertology("analyze", "-m", tiny_bert_dir, "-c", corpus, "--head-distance-sample", 0, "--out", tmp_path / "run", "--device", "cpu", "-q")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: --head-distance-sample ") and "more than 0" in line
    assert not (tmp_path / "run").exists()


def test_track_refuses_gpt2_and_llama_as_one_series_before_running_either(tiny_gpt2_dir, tiny_llama_dir, corpus, tmp_path):
    model_types = [json.loads((folder / "config.json").read_text())["model_type"] for folder in (tiny_llama_dir, tiny_gpt2_dir)]
    result = bertology("track", tiny_gpt2_dir, tiny_llama_dir, "--steps", "0,10", "-c", corpus, "--bootstrap", 100, "--out", tmp_path / "run",
                       "--device", "cpu", "-q")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {tiny_llama_dir}: not of one series with {tiny_gpt2_dir}: its model type is {model_types[0]}, not {model_types[1]}"]
    assert not (tmp_path / "run").exists()


def test_compare_refuses_a_bos_adding_llama_on_gpt2s_pieces(tiny_gpt2_dir, tiny_llama_dir, corpus, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    first = tokenizer.convert_ids_to_tokens(tokenizer(TEXTS[0])["input_ids"])[0]
    result = bertology("compare", tiny_gpt2_dir, tiny_llama_dir, "-c", corpus, "--out", tmp_path / "run", "--device", "cpu", "-q")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {tiny_gpt2_dir} and {tiny_llama_dir} cut the corpus into different pieces ({corpus.name}:1: piece 0 is {first!r} for {tiny_gpt2_dir} "
        f"and '<s>' for {tiny_llama_dir}): the comparison runs both on model A's pieces, so compare models whose tokenizers agree"]
    assert not (tmp_path / "run").exists()


def peak_memory_of(*args) -> tuple[subprocess.CompletedProcess, int]:
    """``bertology ARGS`` as :func:`bertology` runs it, and the peak resident memory of its process in KiB (``ru_maxrss``)."""
    code = ("import resource, runpy, sys\ntry:\n    runpy.run_module('bertology.cli', run_name='__main__', alter_sys=True)\n"
            "finally:\n    print(f'peak KiB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', file=sys.stderr)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    return result, int(result.stderr.rsplit("peak KiB ", 1)[1])


def test_a_five_megabyte_line_costs_no_memory_a_short_line_does_not(tiny_gpt2_dir, tmp_path):
    # issue 37, case 6: the line was tokenized whole before truncation (5 MB: 2.6 GB); now a part of it (Engine.read)
    words = ("the cat sat on the mat, where is the dog? café über 日本語 " * 90_000)[:5_000_000]
    (tmp_path / "long.txt").write_text(f"the cat sat on the mat.\n{words}\nwe saw it.\n")
    (tmp_path / "short.txt").write_text(f"the cat sat on the mat.\n{words[:300]}\nwe saw it.\n")
    peaks = {}
    for name in ("short", "long"):
        result, peaks[name] = peak_memory_of("analyze", "-m", tiny_gpt2_dir, "-c", tmp_path / f"{name}.txt", "--max-length", 16, "--out", tmp_path / name,
                                             "--device", "cpu", "-q")
        assert result.returncode == 0, result.stderr
        assert "3 sequences (1 truncated, 0 skipped as too long)" in result.stdout
    assert peaks["long"] - peaks["short"] < 400 * 1024, peaks
    result = bertology("analyze", "-m", tiny_gpt2_dir, "-c", tmp_path / "long.txt", "--max-length", 16, "--skip-long", "--out", tmp_path / "skip",
                       "--device", "cpu", "-q")
    assert result.returncode == 0 and "2 sequences (0 truncated, 1 skipped as too long)" in result.stdout
    assert json.loads((tmp_path / "skip" / "manifest.json").read_text())["skipped_sources"] == ["long.txt:2"]


def test_one_piece_lines_of_a_decoder_are_skipped_and_counted_and_rollout_and_sinks_run(tiny_gpt2_dir, tmp_path):
    # issue 37, case 7: "cat" and "the" are one piece each for the tiny GPT-2; the first line is one, so the report's viewer
    # shows the first line analysed
    from transformers import AutoTokenizer

    lines = ["cat", "the cat sat on the mat.", "we saw it.", "the", "the dog ran under the table."]
    assert [len(AutoTokenizer.from_pretrained(tiny_gpt2_dir)(line)["input_ids"]) for line in lines][::3] == [1, 1]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    result = bertology("analyze", "-m", tiny_gpt2_dir, "-c", tmp_path / "c.txt", "--out", tmp_path / "run", "--device", "cpu", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("3 sequences (0 truncated, 0 skipped as too long, 2 skipped as shorter than 2 pieces)")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["failures"] == {} and manifest["stats"]["degenerate"] == 2 and manifest["skipped_sources"] == ["c.txt:1", "c.txt:4"]
    assert "the cat sat on the mat." in (tmp_path / "run" / "viewer.html").read_text()
    for table in ("rollout.csv", "sinks.csv"):  # the excess over the uniform head is tested from --min-sample sequences on, not on 3
        assert pd.read_csv(tmp_path / "run" / table).drop(columns=["t_excess", "p_excess"], errors="ignore").notna().any().all(), table


def test_the_console_entry_point_freezes_what_is_alive_before_the_interpreter_exits(monkeypatch, capsys):
    # the interpreter's last collection walked every object torch and transformers made: about a second of every command
    import gc

    from bertology.cli import main

    monkeypatch.setattr(sys, "argv", ["bertology", "info", "--help"])
    gc.unfreeze()
    try:
        with pytest.raises(SystemExit) as exit_:
            main()
        assert exit_.value.code == 0 and "info" in capsys.readouterr().out
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_console_entry_point_imports_a_commands_libraries_with_the_collector_paused_then_freezes_them(monkeypatch, capsys):
    # imported with the collector running, torch's and transformers' objects set off full collections that walked the
    # growing heap again and again (0.8 s of bertology analyze's imports); a --help leaves the collector running
    import gc

    import bertology.cli as cli
    from bertology.studies import Study, _registry

    seen = {}

    class Probe(Study):
        name = "probe_libraries"
        title = "Records how the collector stands when its run begins."
        writes = "nothing"
        libraries = ("xml.dom.minidom",)

        def run(self, settings, command=None):
            seen.update(imported="xml.dom.minidom" in sys.modules, collecting=gc.isenabled(), frozen=gc.get_freeze_count())

    monkeypatch.setitem(_registry, "probe_libraries", Probe())
    monkeypatch.setattr(cli, "app", cli.build_app())
    monkeypatch.delitem(sys.modules, "xml.dom.minidom", raising=False)
    gc.unfreeze()
    try:
        monkeypatch.setattr(sys, "argv", ["bertology", "probe-libraries"])
        with pytest.raises(SystemExit) as exit_:  # typer's standalone mode exits
            cli.main()
        assert exit_.value.code == 0
        assert seen["imported"] and seen["collecting"] and seen["frozen"] > 0
        gc.unfreeze()
        monkeypatch.setattr(sys, "argv", ["bertology", "probe-libraries", "--help"])
        with pytest.raises(SystemExit):
            cli.main()
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


def test_every_command_names_libraries_that_import():
    import importlib

    from bertology.studies import registered_studies

    for name, study in registered_studies().items():
        assert study.libraries, name
        for module in study.libraries:
            importlib.import_module(module)
