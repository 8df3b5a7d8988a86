"""``bertology patch`` (issue 51): per-head denoising activation patching against a reference written from transformers' own
modules, attribution patching against its definition, a model with zero output projections (every change exactly 0, no
head matters), a planted head that alone carries the answer (it, and only it, matters), and every bad input refused in one
line with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import save_tiny_decoder
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from bertology.cli import app
from bertology.core.errors import BertologyError

#: Subjects that are one piece each of the tiny byte-level tokenizer (``" cat"``...), and the answers.
SUBJECTS = ("cat", "dog", "house", "tree")


def write_pairs(path: Path, lines: list) -> Path:
    path.write_text("".join((json.dumps(line) if isinstance(line, dict) else line) + "\n" for line in lines))
    return path


def subject_pairs() -> list[dict]:
    """12 pairs that differ in their subject only (the last piece the same in both): the answer is read at " the"."""
    return [{"clean": f"the {a} is under the", "corrupt": f"the {b} is under the", "answer": " house" if a != "house" else " tree", "wrong": f" {a}"}
            for a in SUBJECTS for b in SUBJECTS if a != b]


def patch(*args) -> tuple[int, str]:
    """The exit code and the output of ``bertology patch ARGS`` run here; a refusal's output is its error's text."""
    result = CliRunner().invoke(app, ["patch", *map(str, args), "--device", "cpu", "-q"])
    if isinstance(result.exception, BertologyError):
        return 2, str(result.exception)
    return result.exit_code, result.output


def projections(model, kind: str) -> list[torch.nn.Module]:
    """Each layer's output projection by transformers' own module names."""
    if kind == "classifier":
        return [layer.attention.output.dense for layer in model.bert.encoder.layer]
    return [block.attn.c_proj for block in model.transformer.h] if kind == "gpt2" else [block.self_attn.o_proj for block in model.model.layers]


def logit_difference(model, ids: list[int], answer: int, wrong: int) -> float:
    """``logit_a - logit_b`` at the last position of a language model, or of a classifier's labels."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    logits = logits[-1] if logits.ndim == 2 else logits
    return float(logits[answer] - logits[wrong])


def reference_model(folder: Path, kind: str):
    """transformers' own model in float64, its tokenizer, and how a pair's answer and wrong become logit indices."""
    from transformers import AutoModelForSequenceClassification

    loader = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
    model = loader.from_pretrained(folder, attn_implementation="eager").double().eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if kind == "classifier":
        return model, tokenizer, lambda text: model.config.label2id[text]
    return model, tokenizer, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"][0]


def reference_changes(folder: Path, kind: str, pairs: list[dict], position: int | None = None) -> np.ndarray:
    """``LD_patched - LD(corrupt)`` per pair, layer and head ``[pairs, layers, heads]``: transformers' own model in float64, a
    forward pre-hook on the output projection replacing the head's slice (at ``position`` alone, else at every position)
    with the clean run's, one full forward per head."""
    model, tokenizer, index = reference_model(folder, kind)
    modules = projections(model, kind)
    width = model.config.hidden_size // model.config.num_attention_heads
    changes = np.empty((len(pairs), len(modules), model.config.num_attention_heads))
    for i, pair in enumerate(pairs):
        clean, corrupt = tokenizer(pair["clean"])["input_ids"], tokenizer(pair["corrupt"])["input_ids"]
        answer, wrong = index(pair["answer"]), index(pair["wrong"])
        inputs = []
        handles = [module.register_forward_pre_hook(lambda m, args: inputs.append(args[0].clone())) for module in modules]
        with torch.no_grad():
            model(input_ids=torch.tensor([clean]))
        for handle in handles:
            handle.remove()
        corrupted = logit_difference(model, corrupt, answer, wrong)
        for layer, module in enumerate(modules):
            for head in range(changes.shape[2]):
                def put_back(m, args, layer=layer, head=head):
                    z, rows = args[0].clone(), slice(None) if position is None else slice(position, position + 1)
                    z[:, rows, head * width:(head + 1) * width] = inputs[layer][:, rows, head * width:(head + 1) * width]
                    return (z,)

                handle = module.register_forward_pre_hook(put_back)
                changes[i, layer, head] = logit_difference(model, corrupt, answer, wrong) - corrupted
                handle.remove()
    return changes


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_denoising_patching_equals_a_reference_from_transformers_own_modules(kind, tiny_decoder_dirs, tmp_path):
    folder, pairs = tiny_decoder_dirs[kind], subject_pairs()
    code, output = patch("-m", folder, "--pairs", write_pairs(tmp_path / "pairs.jsonl", pairs), "--out", tmp_path / "run", "--bootstrap", 200)
    assert code == 0, output
    expected = reference_changes(folder, kind, pairs)
    per_pair = pd.read_parquet(tmp_path / "run" / "patching_pairs.parquet")
    exact = per_pair[per_pair.method == "activation"].sort_values(["pair", "layer", "head"])
    np.testing.assert_allclose(exact.change.to_numpy().reshape(expected.shape), expected, rtol=0, atol=1e-4)
    table = pd.read_csv(tmp_path / "run" / "patching.csv")
    rows = table[table.method == "activation"].sort_values(["layer", "head"])
    np.testing.assert_allclose(rows.logit_diff_change, expected.mean(0).reshape(-1), rtol=0, atol=1e-4)
    gap = (exact.groupby("pair").ld_clean.first() - exact.groupby("pair").ld_corrupt.first()).mean()
    np.testing.assert_allclose(rows.effect, expected.mean(0).reshape(-1) / gap, rtol=1e-3)
    assert set(table.columns) >= {"ci_low", "ci_high", "p", "p_adj", "matters", "n"} and (table.n == len(pairs)).all()
    assert set(table.method) == {"activation", "attribution", "attribution*", "zero ablation", "mean ablation", "gradient importance"}
    assert set(table.direction) == {"denoise", "ablation"} and set(table.position) == {"all"}


def test_attribution_is_the_gradient_estimate_and_agrees_with_exact_patching(tiny_gpt2_dir, tmp_path):
    """AtP against its definition: ``(z_clean - z_corrupt) . dLD/dz`` at the corrupted run, the derivative by central finite
    differences of LD along that direction on the head's slice (transformers' own model in float64)."""
    from bertology.core.model.models import load_model
    from bertology.studies.heads.pairs import read_pairs
    from bertology.studies.heads.patching import Patcher

    loaded = load_model(tiny_gpt2_dir, device="cpu", head="causal-lm")
    model = loaded.model.double()
    pair = read_pairs(write_pairs(tmp_path / "pairs.jsonl", subject_pairs()[:1]), loaded.tokenizer, loaded.kind)[0]
    patcher = Patcher(model)
    estimate = patcher.target_run(pair, patcher.source_run(pair)[1]).attribution
    reference = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, attn_implementation="eager").double().eval()
    modules, width, step = projections(reference, "gpt2"), 8, 1e-4
    inputs = []
    handles = [module.register_forward_pre_hook(lambda m, args: inputs.append(args[0].clone())) for module in modules]
    logit_difference(reference, list(pair.clean), pair.answer, pair.wrong)
    logit_difference(reference, list(pair.corrupt), pair.answer, pair.wrong)
    for handle in handles:
        handle.remove()
    for layer, module in enumerate(modules):
        for head in range(4):
            columns = slice(head * width, (head + 1) * width)
            direction = torch.zeros_like(inputs[layer])
            direction[..., columns] = inputs[layer][..., columns] - inputs[len(modules) + layer][..., columns]
            sides = []
            for sign in (1, -1):
                handle = module.register_forward_pre_hook(lambda m, args, sign=sign: (args[0] + sign * step * direction,))
                sides.append(logit_difference(reference, list(pair.corrupt), pair.answer, pair.wrong))
                handle.remove()
            assert estimate[layer, head] == pytest.approx((sides[0] - sides[1]) / (2 * step), rel=1e-5, abs=1e-9)


def _save_with_projections(source: Path, folder: Path, keep: tuple[int, int] | None) -> Path:
    """``source``'s GPT-2 with every output projection (weight and bias) zero, except head ``keep``'s rows (scaled up)."""
    model = AutoModelForCausalLM.from_pretrained(source)
    width = model.config.n_embd // model.config.n_head
    with torch.no_grad():
        for layer, block in enumerate(model.transformer.h):
            kept = block.attn.c_proj.weight.clone()
            block.attn.c_proj.weight.zero_()
            block.attn.c_proj.bias.zero_()
            if keep is not None and keep[0] == layer:
                rows = slice(keep[1] * width, (keep[1] + 1) * width)
                block.attn.c_proj.weight[rows] = 20 * kept[rows]
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def test_zero_output_projections_change_nothing_and_no_head_matters(tiny_gpt2_dir, tmp_path):
    folder = _save_with_projections(tiny_gpt2_dir, tmp_path / "zero", None)
    code, output = patch("-m", folder, "--pairs", write_pairs(tmp_path / "pairs.jsonl", subject_pairs()), "--out", tmp_path / "run", "--bootstrap", 200)
    assert code == 0, output
    table = pd.read_csv(tmp_path / "run" / "patching.csv")
    assert (table.logit_diff_change == 0).all() and not table.matters.any() and table.p.isna().all()  # no variation: nothing tested
    assert (pd.read_parquet(tmp_path / "run" / "patching_pairs.parquet").change == 0).all()
    assert "0 heads matter" in output and "against exact patching" not in output and "least alike" not in output
    assert pd.read_csv(tmp_path / "run" / "rank_agreement.csv").empty


def test_a_planted_head_that_carries_the_answer_alone_is_the_one_that_matters(tiny_gpt2_dir, tmp_path):
    folder = _save_with_projections(tiny_gpt2_dir, tmp_path / "planted", (1, 2))
    code, output = patch("-m", folder, "--pairs", write_pairs(tmp_path / "pairs.jsonl", subject_pairs()), "--out", tmp_path / "run", "--bootstrap", 1000)
    assert code == 0, output
    table = pd.read_csv(tmp_path / "run" / "patching.csv")
    exact = table[table.method == "activation"]
    assert exact[exact.matters][["layer", "head"]].values.tolist() == [[1, 2]]
    planted = exact[(exact.layer == 1) & (exact["head"] == 2)].iloc[0]
    assert planted.effect == pytest.approx(1.0, abs=1e-4) and planted.ci_low > 0.999
    assert "head 1-2 matters" in output and "1 heads matter" in output


def test_noising_runs_the_clean_prompt_with_the_corrupted_head(tiny_gpt2_dir, tmp_path):
    folder = _save_with_projections(tiny_gpt2_dir, tmp_path / "planted", (0, 1))
    code, output = patch("-m", folder, "--pairs", write_pairs(tmp_path / "pairs.jsonl", subject_pairs()), "--out", tmp_path / "run",
                         "--bootstrap", 1000, "--direction", "noise")
    assert code == 0, output
    exact = pd.read_csv(tmp_path / "run" / "patching.csv").query("method == 'activation'")
    assert exact[exact.matters][["layer", "head"]].values.tolist() == [[0, 1]]
    assert exact.query("layer == 0 and head == 1").effect.iloc[0] == pytest.approx(1.0, abs=1e-4)  # moves clean all the way to corrupt


GOOD = {"clean": "the cat is under the", "corrupt": "the dog is under the", "answer": " house", "wrong": " cat"}
BAD = [
    ({**GOOD, "corrupt": "the dog is under the big"}, "pairs.jsonl:2: clean and corrupt must tokenize to the same number of pieces (9 and 13)"),
    ({**GOOD, "answer": " mat"}, "pairs.jsonl:2: answer ' mat' must be one piece of the tokenizer (tokenized alone it is 3)"),
    ({**GOOD, "wrong": " house"}, "pairs.jsonl:2: answer and wrong are the same piece"),
    ("{not json", "pairs.jsonl:2: not a JSON object"),
    ({"clean": "x", "corrupt": "y", "answer": " cat"}, "pairs.jsonl:2: needs clean, corrupt, answer, wrong as strings; wrong missing"),
]


@pytest.mark.parametrize("line, message", BAD)
def test_a_bad_line_is_refused_in_one_line_naming_it_and_nothing_is_written(line, message, tiny_gpt2_dir, tmp_path):
    code, output = patch("-m", tiny_gpt2_dir, "--pairs", write_pairs(tmp_path / "pairs.jsonl", [GOOD, line]), "--out", tmp_path / "run")
    assert code != 0 and message in output and len(output.strip().splitlines()) == 1, output
    assert not (tmp_path / "run").exists()


def test_the_command_line_prints_a_refusal_as_one_line(tiny_gpt2_dir, tmp_path):
    import subprocess
    import sys

    pairs = write_pairs(tmp_path / "pairs.jsonl", [GOOD, BAD[0][0]])
    result = subprocess.run([sys.executable, "-m", "bertology.cli", "patch", "-m", str(tiny_gpt2_dir), "--pairs", str(pairs), "--out",
                             str(tmp_path / "run"), "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and result.stderr.strip().splitlines() == [f"error: {pairs}:2: {BAD[0][1].split(':2: ')[1]}"], result.stderr
    assert not (tmp_path / "run").exists()


def test_an_empty_file_a_missing_source_and_an_unknown_layout_are_refused_in_one_line(tiny_gpt2_dir, tmp_path, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for args, message in [(["--pairs", empty], "empty.jsonl: no pairs in the file"), ([], "give --pairs FILE.jsonl or --task"),
                          (["--task", "ioi"], "--task ioi: the tokenizer has"), (["--task", "nope"], "unknown --task 'nope'")]:
        code, output = patch("-m", tiny_gpt2_dir, *args, "--out", tmp_path / "run")
        assert code != 0 and message in output and len(output.strip().splitlines()) == 1, output
    from bertology.core.model import layouts

    monkeypatch.delitem(layouts.LAYOUTS, "gpt2")
    code, output = patch("-m", tiny_gpt2_dir, "--pairs", write_pairs(tmp_path / "pairs.jsonl", [GOOD]), "--out", tmp_path / "run")
    assert code != 0 and "bertology does not know where this model keeps its layers" in output and len(output.strip().splitlines()) == 1, output
    assert not (tmp_path / "run").exists()


def test_a_tiny_llama_from_conftest_runs_through_the_command(tmp_path):
    folder = save_tiny_decoder("llama", tmp_path / "llama", layers=1, heads=2, hidden=16)
    code, output = patch("-m", folder, "--pairs", write_pairs(tmp_path / "pairs.jsonl", subject_pairs()[:3]), "--out", tmp_path / "run",
                         "--bootstrap", 100)
    assert code == 0 and "No p-value" in (tmp_path / "run" / "report.html").read_text(), output  # 3 pairs < --min-sample 10
    assert not pd.read_csv(tmp_path / "run" / "patching.csv").matters.any()


def _word_level_folder(folder: Path, texts: list[str], decoder: bool) -> Path:
    """A tiny random GPT-2 (``decoder``) or BERT with its masked-LM head, whose word-level vocabulary holds every word of ``texts``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    split = pre_tokenizers.Whitespace()
    words = sorted({word for text in texts for word, _ in split.pre_tokenize_str(text.lower() if not decoder else text)})
    torch.manual_seed(0)
    if decoder:
        vocab = {word: i for i, word in enumerate(["<unk>", "<|endoftext|>", *words])}
        bare = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        bare.pre_tokenizer = split
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bare, unk_token="<unk>", bos_token="<|endoftext|>", eos_token="<|endoftext|>")
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=len(vocab)))
    else:
        vocab = {word: i for i, word in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
        tokenizer = BertTokenizerFast(vocab=vocab, do_lower_case=True)
        model = BertForMaskedLM(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                           max_position_embeddings=64))
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def test_the_built_in_sets_are_what_they_say(tmp_path):
    from bertology.core.model.kinds import DECODER, ENCODER
    from bertology.studies.heads.pair_tasks import AGREEMENT_TEMPLATE, IOI_TEMPLATES, NAMES, NOUNS, VERBS, task_pairs

    texts = [*IOI_TEMPLATES, " ".join(NAMES), AGREEMENT_TEMPLATE, " ".join(w for pair in NOUNS + VERBS for w in pair)]
    decoder = AutoTokenizer.from_pretrained(_word_level_folder(tmp_path / "decoder", texts, True))
    names = {decoder.convert_tokens_to_ids(name) for name in NAMES}
    for pair in task_pairs("ioi", decoder, DECODER, 20, seed=1):
        clean_names = [piece for piece in pair.clean if piece in names]
        assert len(pair.clean) == len(pair.corrupt) and pair.position == len(pair.clean) - 1
        assert clean_names == [pair.answer, pair.wrong, pair.wrong]  # A and B, then B again gives: A is the indirect object
        assert not {pair.answer, pair.wrong} & set(pair.corrupt)  # the ABC set: three other names
    for pair in task_pairs("induction", decoder, DECODER, 20, seed=1):
        differ = [i for i, (a, b) in enumerate(zip(pair.clean, pair.corrupt)) if a != b]
        last = pair.clean[-1]
        assert len(differ) == 1 and pair.clean[differ[0] - 1] == last and pair.clean.index(last) == differ[0] - 1
        assert (pair.clean[differ[0]], pair.corrupt[differ[0]]) == (pair.answer, pair.wrong)
    encoder = AutoTokenizer.from_pretrained(_word_level_folder(tmp_path / "encoder", texts, False))
    for pair in task_pairs("agreement", encoder, ENCODER, 20, seed=1):
        clean, corrupt = encoder.convert_ids_to_tokens(pair.clean), encoder.convert_ids_to_tokens(pair.corrupt)
        assert clean[pair.position] == "[MASK]" and encoder.convert_ids_to_tokens([pair.answer, pair.wrong]) in [[s, p] for s, p in VERBS]
        singular = {s for s, _ in NOUNS}
        assert clean[2] in singular and clean[5] not in singular and corrupt[2] not in singular and corrupt[5] in singular
    assert task_pairs("ioi", decoder, DECODER, 5, seed=2) == task_pairs("ioi", decoder, DECODER, 5, seed=2)


@pytest.mark.parametrize("task", ["ioi", "induction"])
def test_a_built_in_task_runs_on_a_tiny_decoder(task, tmp_path):
    from bertology.studies.heads.pair_tasks import IOI_TEMPLATES, NAMES

    folder = _word_level_folder(tmp_path / "decoder", [*IOI_TEMPLATES, " ".join(NAMES)], True)
    code, output = patch("-m", folder, "--task", task, "--n", 12, "--out", tmp_path / "run", "--bootstrap", 200, "--seed", 4)
    assert code == 0, output
    table = pd.read_csv(tmp_path / "run" / "patching.csv")
    assert len(table) == 6 * 2 * 4 and (table.n == 12).all() and f"12 pairs of --task {task}" in output
    per_pair = pd.read_parquet(tmp_path / "run" / "patching_pairs.parquet")
    assert sorted(per_pair.pair.unique()) == list(range(12))


def test_agreement_runs_through_the_mask_of_an_encoder_and_the_bundled_model_without_one_is_refused(tmp_path):
    from bertology.studies.heads.pair_tasks import AGREEMENT_TEMPLATE, NOUNS, VERBS

    texts = [AGREEMENT_TEMPLATE, " ".join(w for pair in NOUNS + VERBS for w in pair)]
    folder = _word_level_folder(tmp_path / "encoder", texts, False)
    code, output = patch("-m", folder, "--task", "agreement", "--n", 12, "--out", tmp_path / "run", "--bootstrap", 200)
    assert code == 0, output
    per_pair = pd.read_parquet(tmp_path / "run" / "patching_pairs.parquet")
    from transformers import BertForMaskedLM

    from bertology.core.model.kinds import ENCODER
    from bertology.studies.heads.pair_tasks import task_pairs

    first = task_pairs("agreement", AutoTokenizer.from_pretrained(folder), ENCODER, 12, seed=0)[0]
    with torch.no_grad():  # transformers' own masked LM: LD at the mask of the clean prompt
        logits = BertForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()(input_ids=torch.tensor([first.clean])).logits[0, first.position]
    assert per_pair[per_pair.pair == 0].ld_clean.iloc[0] == pytest.approx(float(logits[first.answer] - logits[first.wrong]), abs=1e-4)
    code, output = patch("--task", "agreement", "--out", tmp_path / "bundled")
    assert code != 0 and "the bundled model (all-MiniLM-L6-v2, a sentence encoder) has none: give --model" in output and "\n" not in output, output
    assert not (tmp_path / "bundled").exists()


def test_each_position_alone_equals_the_reference_patched_there(tiny_gpt2_dir, tmp_path):
    """``--positions each``: head h patched at position p alone, against the reference's pre-hook at p; the rows at all
    positions stay what they were, and the per-position family gets its own correction."""
    pairs = subject_pairs()[:10]
    code, output = patch("-m", tiny_gpt2_dir, "--pairs", write_pairs(tmp_path / "pairs.jsonl", pairs), "--out", tmp_path / "run",
                         "--bootstrap", 200, "--positions", "each")
    assert code == 0, output
    per_pair = pd.read_parquet(tmp_path / "run" / "patching_pairs.parquet").query("method == 'activation'")
    length = len(AutoTokenizer.from_pretrained(tiny_gpt2_dir)(pairs[0]["clean"])["input_ids"])
    for position in (1, length - 1):
        rows = per_pair[per_pair.position == str(position)].sort_values(["pair", "layer", "head"])
        expected = reference_changes(tiny_gpt2_dir, "gpt2", pairs, position)
        np.testing.assert_allclose(rows.change.to_numpy().reshape(expected.shape), expected, rtol=0, atol=1e-4)
    table = pd.read_csv(tmp_path / "run" / "patching.csv", dtype={"position": str})
    each = table[(table.method == "activation") & (table.position != "all")]
    assert len(each) == 2 * 4 * length and sorted(each.position.astype(int).unique()) == list(range(length))
    assert (tmp_path / "run" / "patching_positions.png").is_file()


def test_positions_each_refuses_pairs_of_different_lengths(tiny_gpt2_dir, tmp_path):
    lines = [GOOD, {**GOOD, "clean": "the cat is under the big", "corrupt": "the dog is under the big"}]
    code, output = patch("-m", tiny_gpt2_dir, "--pairs", write_pairs(tmp_path / "pairs.jsonl", lines), "--out", tmp_path / "run",
                         "--positions", "each")
    assert code != 0 and "--positions each needs every pair to be one length" in output and len(output.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def graddrop_reference(folder: Path, pairs: list[dict]) -> np.ndarray:
    """AtP with layer l's gradient dropped, ``[pairs, l, layers, heads]``: transformers' own GPT-2 in float64, block l's output
    replaced by ``input + (output - input).detach()`` (the residual stream alone carries the gradient past it), a zero leaf
    added to each output projection's input, ``(z_clean - z_corrupt) . dLD/dz`` summed over the head's slice."""
    model, tokenizer, index = reference_model(folder, "gpt2")
    modules, blocks = projections(model, "gpt2"), model.transformer.h
    width, heads = model.config.n_embd // model.config.n_head, model.config.n_head
    values = np.zeros((len(pairs), len(blocks), len(modules), heads))
    for i, pair in enumerate(pairs):
        clean, corrupt = tokenizer(pair["clean"])["input_ids"], tokenizer(pair["corrupt"])["input_ids"]
        z_clean = []
        handles = [module.register_forward_pre_hook(lambda m, args: z_clean.append(args[0].clone())) for module in modules]
        logit_difference(model, clean, index(pair["answer"]), index(pair["wrong"]))
        for handle in handles:
            handle.remove()
        for dropped in range(len(blocks)):
            leaves, z_corrupt = [], []

            def shifted(m, args):
                z_corrupt.append(args[0].detach().clone())
                leaves.append(torch.zeros_like(args[0], requires_grad=True))
                return (args[0] + leaves[-1],)

            def residual_only(m, args, kwargs, output):
                start = args[0] if args else kwargs["hidden_states"]
                hidden = output[0] if isinstance(output, tuple) else output
                hidden = start + (hidden - start).detach()
                return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

            handles = [module.register_forward_pre_hook(shifted) for module in modules]
            handles.append(blocks[dropped].register_forward_hook(residual_only, with_kwargs=True))
            logits = model(input_ids=torch.tensor([corrupt])).logits[0, -1]
            gradients = torch.autograd.grad(logits[index(pair["answer"])] - logits[index(pair["wrong"])], leaves, allow_unused=True)
            for handle in handles:
                handle.remove()
            for layer in range(len(modules)):
                if gradients[layer] is None:  # inside the dropped block: cut off from LD
                    continue
                product = ((z_clean[layer] - z_corrupt[layer]) * gradients[layer])[0].sum(0)
                values[i, dropped, layer] = product.reshape(heads, width).sum(-1).detach().numpy()
    return values


def test_attribution_star_is_graddrop_against_a_reference(tiny_gpt2_dir, tmp_path):
    """attribution* = ``1/(L-1) sum_l |mean_pairs AtP_l|`` (Kramar et al. 2024), AtP_l from the reference above; a magnitude:
    an interval, no p, nothing called."""
    pairs = subject_pairs()  # 12, past --min-sample: the agreement is reported
    code, output = patch("-m", tiny_gpt2_dir, "--pairs", write_pairs(tmp_path / "pairs.jsonl", pairs), "--out", tmp_path / "run", "--bootstrap", 200)
    assert code == 0, output
    dropped = graddrop_reference(tiny_gpt2_dir, pairs)
    assert np.abs(dropped[:, 0, 0]).max() == 0 and np.abs(dropped[:, 0, 1]).max() > 0  # a head's own layer dropped: no gradient reaches it
    expected = np.abs(dropped.mean(0)).sum(0) / (dropped.shape[1] - 1)
    table = pd.read_csv(tmp_path / "run" / "patching.csv").query("method == 'attribution*'").sort_values(["layer", "head"])
    np.testing.assert_allclose(table.logit_diff_change, expected.reshape(-1), rtol=1e-4, atol=1e-7)
    assert table.p.isna().all() and not table.matters.any() and (table.ci_low >= 0).all() and (table.ci_low <= table.ci_high).all()
    assert "attribution* against exact patching: Spearman" in output


def test_a_classifier_is_patched_on_the_logit_difference_of_two_labels(tiny_classifier_dir, tmp_path):
    """A sequence classifier (answer and wrong name its labels): per-head denoising against the reference's pre-hook on
    BERT's attention output dense, LD = logit["1"] - logit["0"]; a label it lacks is refused naming the line."""
    pairs = [{"clean": f"the {a} sat.", "corrupt": f"the {b} sat.", "answer": "1", "wrong": "0"} for a in ("cat", "dog", "tree") for b in ("house", "table")]
    code, output = patch("-m", tiny_classifier_dir, "--pairs", write_pairs(tmp_path / "pairs.jsonl", pairs), "--out", tmp_path / "run", "--bootstrap", 200)
    assert code == 0, output
    expected = reference_changes(tiny_classifier_dir, "classifier", pairs)
    per_pair = pd.read_parquet(tmp_path / "run" / "patching_pairs.parquet").query("method == 'activation'").sort_values(["pair", "layer", "head"])
    np.testing.assert_allclose(per_pair.change.to_numpy().reshape(expected.shape), expected, rtol=0, atol=1e-4)
    code, output = patch("-m", tiny_classifier_dir, "--pairs", write_pairs(tmp_path / "bad.jsonl", [pairs[0], {**pairs[1], "answer": "positive"}]),
                         "--out", tmp_path / "bad")
    assert code != 0 and "bad.jsonl:2: answer 'positive' is not one of the classifier's labels (0, 1)" in output
    code, output = patch("-m", tiny_classifier_dir, "--task", "ioi", "--out", tmp_path / "bad")
    assert code != 0 and "a classifier needs --pairs" in output and not (tmp_path / "bad").exists()


def test_ray_spreads_the_pairs_over_workers_and_gives_the_local_tables(tiny_llama_dir, tmp_path):
    """``--backend ray --workers 2`` on a local cluster (loopback, started and stopped by the command): the pairs in two
    shards, the tables equal to the local run's (a float64 copy of the model: a worker's threads sum in another order, which
    float32 would show in the sixth digit of a small effect)."""
    pytest.importorskip("ray")
    pairs = write_pairs(tmp_path / "pairs.jsonl", subject_pairs()[:6])
    folder = tmp_path / "llama64"
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).double().save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(folder)
    code, output = patch("-m", folder, "--pairs", pairs, "--out", tmp_path / "local", "--bootstrap", 200, "--positions", "each")
    assert code == 0, output
    code, output = patch("-m", folder, "--pairs", pairs, "--out", tmp_path / "ray", "--bootstrap", 200, "--positions", "each",
                         "--backend", "ray", "--workers", 2)
    assert code == 0, output
    for name in ("patching.csv", "patching_pairs.csv"):
        local, on_ray = (pd.read_csv(tmp_path / run / name, dtype={"position": str}) for run in ("local", "ray"))
        pd.testing.assert_frame_equal(local, on_ray, check_exact=False, rtol=1e-9, atol=1e-12)
    assert json.loads((tmp_path / "ray" / "manifest.json").read_text())["settings"]["backend"] == "ray"


def ablation_reference(folder: Path, kind: str, pairs: list[dict]) -> dict[str, np.ndarray]:
    """On the clean prompts, ``[pairs, layers, heads]``, from transformers' own model in float64 with pre-hooks on the output
    projections: zero ablation (the head's slice set to 0), mean ablation (set to its mean over every position of every
    clean and corrupted prompt, recorded by hand first) and Michel's gradient importance (a gate xi on the slice,
    ``|dLD/dxi|`` at 1)."""
    model, tokenizer, index = reference_model(folder, kind)
    modules = projections(model, kind)
    heads = model.config.num_attention_heads
    width = model.config.hidden_size // heads
    seen = []
    handles = [module.register_forward_pre_hook(lambda m, args, layer=layer: seen.append((layer, args[0][0].clone())))
               for layer, module in enumerate(modules)]
    for pair in pairs:
        for text in (pair["clean"], pair["corrupt"]):
            logit_difference(model, tokenizer(text)["input_ids"], 0, 1)
    for handle in handles:
        handle.remove()
    means = [torch.cat([z for at, z in seen if at == layer]).mean(0) for layer in range(len(modules))]
    found = {name: np.empty((len(pairs), len(modules), heads)) for name in ("zero ablation", "mean ablation", "gradient importance")}
    for i, pair in enumerate(pairs):
        ids, answer, wrong = tokenizer(pair["clean"])["input_ids"], index(pair["answer"]), index(pair["wrong"])
        clean = logit_difference(model, ids, answer, wrong)
        for layer, module in enumerate(modules):
            for head in range(heads):
                columns = slice(head * width, (head + 1) * width)
                for name, value in (("zero ablation", 0.0), ("mean ablation", means[layer][columns])):
                    def replace(m, args, columns=columns, value=value):
                        z = args[0].clone()
                        z[..., columns] = value
                        return (z,)

                    handle = module.register_forward_pre_hook(replace)
                    found[name][i, layer, head] = logit_difference(model, ids, answer, wrong) - clean
                    handle.remove()
        gates = [torch.ones(heads, dtype=torch.float64, requires_grad=True) for _ in modules]
        handles = [module.register_forward_pre_hook(lambda m, args, gate=gate: ((args[0].unflatten(-1, (heads, width)) * gate[:, None]).flatten(-2),))
                   for module, gate in zip(modules, gates)]
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        logits = logits[-1] if logits.ndim == 2 else logits
        gradients = torch.autograd.grad(logits[answer] - logits[wrong], gates)
        for handle in handles:
            handle.remove()
        found["gradient importance"][i] = np.abs(np.stack([gradient.numpy() for gradient in gradients]))
    return found


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_zero_and_mean_ablation_and_gradient_importance_equal_references(kind, tiny_decoder_dirs, tmp_path):
    """Per pair against :func:`ablation_reference`; ``rank_agreement.csv`` against scipy's Spearman of the table's own columns."""
    from scipy.stats import spearmanr

    folder, pairs = tiny_decoder_dirs[kind], subject_pairs()  # 12, past --min-sample: the rankings are compared
    code, output = patch("-m", folder, "--pairs", write_pairs(tmp_path / "pairs.jsonl", pairs), "--out", tmp_path / "run", "--bootstrap", 200)
    assert code == 0, output
    expected = ablation_reference(folder, kind, pairs)
    per_pair = pd.read_parquet(tmp_path / "run" / "patching_pairs.parquet")
    for method, values in expected.items():
        rows = per_pair[per_pair.method == method].sort_values(["pair", "layer", "head"])
        assert (rows.direction == "ablation").all()
        np.testing.assert_allclose(rows.change.to_numpy().reshape(values.shape), values, rtol=1e-4, atol=1e-6, err_msg=method)
    table = pd.read_csv(tmp_path / "run" / "patching.csv")
    rankings = pd.read_csv(tmp_path / "run" / "rank_agreement.csv")
    assert len(rankings) == 10 and "least alike rankings:" in output
    row = rankings[(rankings.method_a == "activation") & (rankings.method_b == "zero ablation")].iloc[0]
    scores = [table[table.method == method].sort_values(["layer", "head"]).logit_diff_change.abs() for method in ("activation", "zero ablation")]
    assert row.spearman == pytest.approx(spearmanr(*scores).statistic, abs=1e-12)
    importance = table[table.method == "gradient importance"]
    assert importance.p.isna().all() and not importance.matters.any()


def test_no_ablations_leaves_them_out(tiny_gpt2_dir, tmp_path):
    code, output = patch("-m", tiny_gpt2_dir, "--pairs", write_pairs(tmp_path / "pairs.jsonl", subject_pairs()), "--out", tmp_path / "run",
                         "--bootstrap", 100, "--no-ablations")
    assert code == 0, output
    assert set(pd.read_csv(tmp_path / "run" / "patching.csv").method) == {"activation", "attribution", "attribution*"}
    assert len(pd.read_csv(tmp_path / "run" / "rank_agreement.csv")) == 1 and "least alike" not in output
    assert "zero ablation" not in (tmp_path / "run" / "report.html").read_text()


def test_every_built_in_task_runs_on_a_decoder_pretrained_here(tmp_path):
    """``bertology pretrain --causal`` on a corpus written here from the tasks' own templates and words (so that its BPE
    makes them single pieces), then ``patch --task ioi|induction|agreement`` on the last checkpoint; each pair's clean LD
    is transformers' own model's at the last position."""
    import random

    from bertology.core.model.kinds import DECODER
    from bertology.studies.heads.pair_tasks import AGREEMENT_TEMPLATE, IOI_TEMPLATES, NAMES, NOUNS, VERBS, task_pairs

    rng = random.Random(0)
    lines = [rng.choice(IOI_TEMPLATES).format(A=a, B=b, C=b) + f" {a}." for a, b in (rng.sample(NAMES, 2) for _ in range(150))]
    lines += [AGREEMENT_TEMPLATE.format(subject=subject[plural], attractor=attractor[1 - plural]) + f" {verb[plural]} here."
              for subject in NOUNS[:6] for attractor in NOUNS[4:] for verb in VERBS for plural in (0, 1)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(app, ["pretrain", str(tmp_path / "corpus.txt"), "--causal", "--layers", "2", "--heads", "4", "--hidden", "32",
                                      "--steps", "20", "--checkpoints", "2", "--vocab-size", "500", "--out", str(tmp_path / "pretrained"),
                                      "--device", "cpu", "-q"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "pretrained" / "checkpoints" / "step-000020"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    for task in ("ioi", "induction", "agreement"):
        code, output = patch("-m", folder, "--task", task, "--n", 12, "--out", tmp_path / task, "--bootstrap", 200)
        assert code == 0 and f"12 pairs of --task {task}" in output, output
        per_pair = pd.read_parquet(tmp_path / task / "patching_pairs.parquet").groupby("pair").ld_clean.first()
        expected = [logit_difference(model, list(pair.clean), pair.answer, pair.wrong) for pair in task_pairs(task, tokenizer, DECODER, 12, seed=0)]
        np.testing.assert_allclose(per_pair.to_numpy(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lines, message", [
    ([GOOD, {**GOOD, "answer": " tree"}, GOOD], "pairs.jsonl:3: the same pair as line 1: a repeated pair is not a new observation"),
    ([{**GOOD, "corrupt": GOOD["clean"]}], "pairs.jsonl:1: clean and corrupt are the same pieces: a pair needs a difference to patch"),
])
def test_a_repeated_pair_and_a_pair_without_a_difference_are_refused(lines, message, tiny_gpt2_dir, tmp_path):
    code, output = patch("-m", tiny_gpt2_dir, "--pairs", write_pairs(tmp_path / "pairs.jsonl", lines), "--out", tmp_path / "run")
    assert code != 0 and message in output and len(output.strip().splitlines()) == 1, output
    assert not (tmp_path / "run").exists()


def test_n_without_a_task_and_an_unknown_word_are_refused(tiny_gpt2_dir, tmp_path):
    code, output = patch("-m", tiny_gpt2_dir, "--pairs", write_pairs(tmp_path / "pairs.jsonl", [GOOD]), "--n", 5, "--out", tmp_path / "run")
    assert code != 0 and "--n draws pairs of a built-in --task; a --pairs file is used whole" in output
    from bertology.studies.heads.pair_tasks import AGREEMENT_TEMPLATE

    folder = _word_level_folder(tmp_path / "encoder", [AGREEMENT_TEMPLATE, "key keys cabinet cabinets is are"], False)
    line = {"clean": "the key near the cabinets [MASK] .", "corrupt": "the keys near the cabinet [MASK] .", "answer": "is", "wrong": "zebra"}
    code, output = patch("-m", folder, "--pairs", write_pairs(tmp_path / "unk.jsonl", [line]), "--out", tmp_path / "run")
    assert code != 0 and "unk.jsonl:1: wrong 'zebra' is not in the tokenizer's vocabulary (it is the unknown piece)" in output, output


def test_positions_both_prompts_share_decide_nothing_and_a_built_in_run_keeps_its_prompts(tiny_gpt2_dir, tmp_path):
    """Before the differing piece a decoder's z_h is the same in both prompts, and the last layer's z_h before the read
    position reaches no logit that is read: every change there is exactly 0, so those tests get no p and stay out of the
    correction; a built-in set's pairs are written, decoded, to pair_prompts.csv."""
    code, output = patch("-m", tiny_gpt2_dir, "--pairs", write_pairs(tmp_path / "pairs.jsonl", subject_pairs()), "--out", tmp_path / "each",
                         "--bootstrap", 200, "--positions", "each", "--no-ablations")
    assert code == 0, output
    table = pd.read_csv(tmp_path / "each" / "patching.csv", dtype={"position": str}).query("method == 'activation' and position != 'all'")
    shared, after = table[table.position == "0"], table[table.position != "0"]  # "the" starts both prompts; the subject differs
    assert len(shared) == 8 and (shared.logit_diff_change == 0).all() and shared.p.isna().all() and shared.p_adj.isna().all()
    assert after.p.notna().any()
    last = table.position.astype(int).max()  # the last layer's z_h before the read position reaches no logit read: exactly 0 too
    assert table.query("layer == 1").pipe(lambda t: t[t.position.astype(int) < last]).p.isna().all()
    from bertology.studies.heads.pair_tasks import IOI_TEMPLATES, NAMES

    folder = _word_level_folder(tmp_path / "decoder", [*IOI_TEMPLATES, " ".join(NAMES)], True)
    code, output = patch("-m", folder, "--task", "ioi", "--n", 12, "--out", tmp_path / "run", "--bootstrap", 200, "--no-ablations")
    assert code == 0, output
    prompts = pd.read_csv(tmp_path / "run" / "pair_prompts.csv")
    assert len(prompts) == 12 and prompts.pair.tolist() == list(range(12)) and (prompts.clean != prompts.corrupt).all()
    assert not prompts.duplicated(["clean", "corrupt", "answer", "wrong"]).any()
    assert all(prompt.split()[-1] in ("to",) for prompt in prompts.clean) and set(prompts.answer.str.strip()) <= set(NAMES)


def test_a_change_within_float_rounding_never_matters():
    """Two heads whose per-pair changes sit far from 0 in their own spread: one of 1e-9 (float rounding of LDs of size 1),
    one of 1e-3; both intervals exclude 0, only the second head matters."""
    from bertology.studies.heads.patch_statistics import patching_table
    from bertology.studies.heads.patching import PairEffects

    rng = np.random.default_rng(0)
    n = 40
    clean, corrupt = 1.0 + rng.normal(0, 0.1, n), rng.normal(0, 0.1, n)
    activation = np.stack([1e-9 * (1 + 0.1 * rng.normal(size=n)), 1e-3 * (1 + 0.1 * rng.normal(size=n))], axis=1)[:, None, :]
    effects = PairEffects(clean, corrupt, {"activation": activation, "attribution": activation}, np.zeros((n, 1, 1, 2)))
    rows = patching_table(effects, "denoise", replicates=1000).query("method == 'activation'")
    assert (rows.ci_low > 0).all() and (rows.p_adj < 0.05).all()
    assert rows.matters.tolist() == [False, True]
