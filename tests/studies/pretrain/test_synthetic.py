"""Issue 52, step 1: ``pretrain --causal --synthetic repeats`` (random symbols in which a segment repeats at a random period and
offset, made in memory, with a word-level vocabulary saved with every checkpoint) and ``--attention-only`` (a Llama whose MLP
blocks are of size 0). Checked against what the generator promises counted by hand, and against the model's own layers
through hooks: the MLP adds exactly 0, each layer is its input plus its attention's output."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_cli import bertology as run_cli

from bertology.core.errors import BertologyError
from bertology.core.model.models import LANGUAGE_MODEL, load_model
from bertology.core.statistics.stats import keyed_rng
from bertology.core.text.synthetic import repeated_segment, whole_word_pieces
from bertology.studies.pretrain.objectives import CAUSAL_LM
from bertology.studies.pretrain.pretraining import pretrain
from bertology.studies.pretrain.settings import PretrainSettings
from bertology.studies.pretrain.symbols import symbol_names, synthetic_corpus

#: A synthetic run small enough for seconds: 12 symbols, sequences of 24 with periods 3-6, half of each repeating.
TINY = dict(objective="causal-lm", synthetic="repeats", vocab_size=12, min_period=3, max_period=6, repeat_share=0.5, layers=2, heads=2,
            hidden=16, max_length=24, batch_size=4, learning_rate=3e-3, checkpoints=3, device="cpu", progress=False)
TINY_CLI = ("--causal", "--synthetic", "repeats", "--vocab-size", 12, "--min-period", 3, "--max-period", 6, "--layers", 1, "--heads", 2,
            "--hidden", 16, "--max-length", 24, "--batch-size", 4, "--checkpoints", 2, "--device", "cpu", "-q")


def test_a_segment_repeats_at_random_periods_and_offsets_for_the_share_asked():
    rng, pool = np.random.default_rng(0), np.arange(100, 140)
    periods, offsets = set(), set()
    for _ in range(400):
        pieces, period, second = repeated_segment(rng, pool, 30, (3, 8), repeated=12)
        offset = second - period
        assert len(pieces) == 30 and set(pieces) <= set(pool.tolist()) and 3 <= period <= 8 and 0 <= offset <= 30 - period - 12
        assert all(pieces[offset + period + k] == pieces[offset + k % period] for k in range(12))
        periods.add(period)
        offsets.add(offset)
    assert periods == set(range(3, 9)) and offsets == set(range(0, 30 - 3 - 12 + 1))  # every period and offset is drawn
    for _ in range(100):  # no share: the copies run to the end, two whole copies at least
        pieces, period, second = repeated_segment(rng, pool, 30, (3, 8))
        assert second >= period and second + period <= 30 and all(pieces[i] == pieces[i - period] for i in range(second, 30))


def test_the_synthetic_corpus_draws_symbols_alone_fresh_each_epoch_and_holds_validation_apart():
    settings = PretrainSettings([], vocab_size=12, max_length=24, seed=3, objective="causal-lm", synthetic="repeats", repeat_share=0.5,
                                min_period=3, max_period=6)
    corpus = synthetic_corpus(settings, CAUSAL_LM)
    tokenizer = corpus.tokenizer
    assert symbol_names(12) == list("abcdefghijkl") and symbol_names(27)[-2:] == ["az", "ba"]
    assert len(tokenizer) == 15 and tokenizer.convert_ids_to_tokens(list(range(3))) == ["<|endoftext|>", "<pad>", "<unk>"]
    assert tokenizer("a l b", add_special_tokens=True)["input_ids"] == [3, 14, 4]  # nothing added around a text
    assert tokenizer.decode([3, 14, 4]) == "a l b" and sorted(whole_word_pieces(tokenizer)) == list(range(3, 15))
    first, second = corpus.epoch_rows(0), corpus.epoch_rows(1)
    sequences = [row["input_ids"] for row in first]
    assert all(len(s) == 24 and min(s) >= 3 and max(s) <= 14 for s in sequences)
    assert sequences != [row["input_ids"] for row in second] and corpus.epoch_rows(1) == second  # fresh, and keyed by the epoch
    validation = corpus.validation_ids[0]
    assert not {tuple(s) for s in validation} & {tuple(s) for s in sequences}
    # each sequence holds a segment whose next 12 symbols copy it (the share 0.5 of 24), as the generator drew it
    rng = keyed_rng(3, "synthetic", "epoch", 0)
    for sequence in sequences[:50]:
        pieces, period, start = repeated_segment(rng, np.arange(3, 15), 24, (3, 6), 12)
        assert sequence == pieces and all(sequence[i] == sequence[i - period] for i in range(start, start + 12))


def test_an_attention_only_synthetic_run_is_a_standard_model_whose_mlps_add_exactly_nothing(tmp_path):
    result = run_cli("pretrain", "--out", tmp_path / "run", "--attention-only", "--steps", 4, *TINY_CLI)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # torch's warning on the empty MLP weights is not news
    summary = json.loads((tmp_path / "run" / "pretraining.json").read_text())
    assert summary["model"]["architecture"] == "Llama, attention-only (MLP blocks of size 0)"
    assert summary["corpus"]["synthetic"] == "repeats" and summary["corpus"]["periods"] == [3, 6] and summary["settings"]["intermediate"] == 0
    # the unigram yardstick of uniform symbols is ln 12, up to the add-one smoothing of 4096 x 24 draws
    assert summary["unigram_cross_entropy"] == pytest.approx(np.log(12), abs=0.01)
    folder = tmp_path / "run" / "checkpoints" / "step-000004"
    loaded = load_model(folder, head=LANGUAGE_MODEL, device="cpu")
    model = loaded.model.eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.intermediate_size == 0
    weights = load_file(folder / "model.safetensors")
    assert all(tensor.numel() == 0 for name, tensor in weights.items() if ".mlp." in name) and any(".mlp." in name for name in weights)
    seen = {}
    for k, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda module, args, kwargs, output, k=k: seen.update({("in", k): kwargs.get("hidden_states", args[0] if args else None),
                                                                                         ("out", k): output[0] if isinstance(output, tuple) else output}),
                                    with_kwargs=True)
        layer.self_attn.register_forward_hook(lambda module, args, output, k=k: seen.update({("attn", k): output[0]}))
        layer.mlp.register_forward_hook(lambda module, args, output, k=k: seen.update({("mlp", k): output}))
    ids = loaded.tokenizer("a b c a b c d", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        model(input_ids=ids)
    assert [loaded.tokenizer.decode([i]) for i in ids[0].tolist()] == "a b c a b c d".split()
    for k in range(len(model.model.layers)):
        assert torch.equal(seen[("mlp", k)], torch.zeros_like(seen[("mlp", k)]))
        torch.testing.assert_close(seen[("out", k)], seen[("in", k)] + seen[("attn", k)], rtol=0, atol=0)


def test_an_interrupted_synthetic_run_resumes_to_the_same_weights(tmp_path):
    whole = pretrain(None, tmp_path / "whole", steps=8, save_every=3, attention_only=True, **TINY)
    assert whole["steps"] == 8
    assert pretrain(None, tmp_path / "resumed", steps=8, save_every=3, max_steps=5, attention_only=True, **TINY) == {"interrupted_at_step": 5, "steps": 8}
    pretrain(None, tmp_path / "resumed", steps=8, save_every=3, attention_only=True, **TINY)
    expected = load_file(tmp_path / "whole" / "checkpoints" / "step-000008" / "model.safetensors")
    again = load_file(tmp_path / "resumed" / "checkpoints" / "step-000008" / "model.safetensors")
    for name, tensor in expected.items():
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=0, msg=name)
    with pytest.raises(TypeError, match="unexpected keyword argument 'period'"):  # the synthetic task's keywords, and no other
        pretrain(None, tmp_path / "other", steps=8, period=4, **TINY)
    pretrain(None, tmp_path / "other", steps=8, save_every=3, max_steps=3, attention_only=True, **TINY)
    with pytest.raises(BertologyError, match="the training state of a run with other settings"):  # another share is another run
        pretrain(None, tmp_path / "other", steps=8, save_every=3, attention_only=True, **{**TINY, "repeat_share": 0.25})


@pytest.mark.parametrize("arguments, message", [
    (("--synthetic", "repeats", "CORPUS", "--causal"), "--synthetic repeats makes the corpus: give no corpus with it"),
    (("--synthetic", "repeats"), "--synthetic repeats trains a decoder (the causal LM loss): give --causal with it"),
    (("--synthetic", "tables", "--causal"), "--synthetic tables: unknown synthetic task; use repeats"),
    (("CORPUS", "--attention-only"), "--attention-only builds a decoder without MLP blocks (Olsson et al. 2022): give --causal with it"),
    (("CORPUS", "--causal", "--repeat-share", "0.3"), "--repeat-share is a setting of --synthetic repeats: give --synthetic repeats with it, or leave it out"),
    (("--causal",), "give a corpus (text files or folders of .txt files), or --synthetic repeats"),
    (("CORPUS", "--causal", "--vocab-size", "50"), "--vocab-size 50: a corpus's vocabulary needs at least 100 pieces"),
    (("--synthetic", "repeats", "--causal", "--repeat-share", "1"), "--repeat-share must be above 0 and below 1, not 1.0"),
    (("--synthetic", "repeats", "--causal", "--min-period", "9", "--max-period", "4"),
     "--min-period 9 and --max-period 4: periods run from 1 up, the least first"),
    (("--synthetic", "repeats", "--causal", "--max-length", "40", "--max-period", "24"),
     "--max-period 24 and --repeat-share 0.5 make sequences of 24 + 20 symbols with a repeat of at least one, and --max-length is 40: "
     "lower them or raise --max-length"),
    (("--synthetic", "repeats", "--causal", "--attention-only", "--hidden", "24", "--heads", "8"),
     "--attention-only builds a Llama, whose rotary positions need an even head size: --hidden 24 / --heads 8 is 3"),
])
def test_a_synthetic_or_attention_only_run_out_of_its_bounds_is_one_line(tmp_path, arguments, message):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The cat sat on the mat.\n")
    result = run_cli("pretrain", *(corpus if a == "CORPUS" else a for a in arguments), "--out", tmp_path / "run", "--steps", 2, "--device", "cpu", "-q")
    assert (result.returncode, result.stderr) == (2, f"error: {message}\n")
    assert not (tmp_path / "run" / "pretraining.json").exists()
