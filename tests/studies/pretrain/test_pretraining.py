import json
import pickle
import re

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import write_books
from core.storage.test_runfolder import snapshot
from safetensors.torch import load_file
from test_cli import bertology as run_cli

from bertology.core.errors import BertologyError, CorpusError, StateError
from bertology.core.learning.training import TrainingDiverged
from bertology.core.model.kinds import DECODER
from bertology.core.model.models import load_model
from bertology.studies.pretrain import Pretrain
from bertology.studies.pretrain import report as reports
from bertology.studies.pretrain.corpus import corpus_files, documents_for_pairs, read_documents, split_documents, unigram_cross_entropy
from bertology.studies.pretrain.objectives import causal_lm_loss, make_causal_instances, make_instances, train_byte_level_bpe
from bertology.studies.pretrain.pretraining import pretrain
from bertology.studies.pretrain.training import checkpoint_steps
from bertology.studies.track.checkpoints import checkpoint_step
from studies.finetune.test_finetuning import Planted

SMALL = dict(vocab_size=120, layers=2, heads=2, hidden=32, max_length=32, batch_size=8, learning_rate=3e-3, checkpoints=4, device="cpu", progress=False)
#: The same for the GPT-2-style decoder: a byte-level BPE has 256 byte pieces before any merge.
CAUSAL = {**SMALL, "objective": "causal-lm", "vocab_size": 300}


def test_pretrain_writes_a_checkpoint_series_every_command_can_load(tmp_path):
    books = write_books(tmp_path / "books")
    summary = pretrain(books, tmp_path / "run", steps=20, **SMALL)
    folders = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert [f.name for f in folders] == ["step-000000", "step-000010", "step-000014", "step-000020"]
    for folder in folders:
        loaded = load_model(folder, device="cpu")
        assert (loaded.num_layers, loaded.num_heads) == (2, 2)
        assert loaded.tokenizer.convert_ids_to_tokens(loaded.cls_token_id) == "[CLS]"
        assert checkpoint_step(str(folder)) == int(folder.name.split("-")[1])
    losses = pd.read_csv(tmp_path / "run" / "loss.csv")
    assert losses.step.tolist() == list(range(1, 21))
    evaluations = pd.read_csv(tmp_path / "run" / "checkpoints.csv")
    assert evaluations.step.tolist() == [0, 10, 14, 20]
    # at step 0 the loss is near ln(vocabulary); twenty steps on this repetitive text bring it clearly below
    assert evaluations.val_mlm_loss.iloc[0] == pytest.approx(np.log(summary["model"]["vocab_size"]), abs=0.5)
    assert evaluations.val_mlm_loss.iloc[-1] < evaluations.val_mlm_loss.iloc[0] - 0.3
    saved = json.loads((tmp_path / "run" / "pretraining.json").read_text())
    assert saved["val_mlm_loss"] == pytest.approx(evaluations.val_mlm_loss.iloc[-1]) and saved["settings"]["mask_probability"] == 0.15
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["objective"] == saved["objective"] == "masked-lm" and manifest["loss"].startswith("masked-LM cross-entropy + next-sentence")
    assert (tmp_path / "run" / "loss_curve.png").stat().st_size > 0
    assert "Pre-training" in (tmp_path / "run" / "report.html").read_text()
    assert not (tmp_path / "run" / "state").exists()


@pytest.mark.parametrize("options, steps, stops", [
    (SMALL, 12, (7, 11)),  # 10 steps per epoch: step 7 is in the first epoch, step 11 in the second
    (CAUSAL, 24, (7, 22)),  # 20 steps per epoch
])
def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path, options, steps, stops):
    books = write_books(tmp_path / "books")
    whole = pretrain(books, tmp_path / "whole", steps=steps, save_every=5, **options)
    assert stops[0] < steps / whole["epochs"] < stops[1]
    final = f"step-{steps:06d}"
    expected = load_file(tmp_path / "whole" / "checkpoints" / final / "model.safetensors")
    for stop in stops:
        interrupted = pretrain(books, tmp_path / f"resumed-{stop}", steps=steps, save_every=5, max_steps=stop, **options)
        assert interrupted == {"interrupted_at_step": stop, "steps": steps}
        resumed = pretrain(books, tmp_path / f"resumed-{stop}", steps=steps, save_every=5, **options)
        assert resumed["resumed_from_step"] == stop
        again = load_file(tmp_path / f"resumed-{stop}" / "checkpoints" / final / "model.safetensors")
        for name, tensor in expected.items():
            torch.testing.assert_close(again[name], tensor, rtol=0, atol=0, msg=f"resumed at {stop}: {name}")
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / f"resumed-{stop}" / "loss.csv"), pd.read_csv(tmp_path / "whole" / "loss.csv"))


def test_instances_pair_a_segment_with_its_continuation_or_another_document():
    cls, sep = 2, 3
    # document d's sentence s is [100 d + 10 s + k for k < 3]: each piece says where it came from
    documents = [[[100 * d + 10 * s + k for k in range(3)] for s in range(8)] for d in range(3)]
    instances = make_instances(documents, max_length=16, rng=np.random.default_rng(0), cls_id=cls, sep_id=sep)
    labels = [row["next_sentence_label"] for row in instances]
    assert 0 < sum(labels) < len(labels)
    for row in instances:
        ids = row["input_ids"]
        assert len(ids) <= 16 and ids[0] == cls and ids[-1] == sep
        first_sep = ids.index(sep)
        a, b = ids[1:first_sep], ids[first_sep + 1 : -1]
        assert row["token_type_ids"] == [0] * (len(a) + 2) + [1] * (len(b) + 1)
        assert row["special_tokens_mask"] == [1] + [0] * len(a) + [1] + [0] * len(b) + [1]
        same_document = a[0] // 100 == b[0] // 100
        if row["next_sentence_label"] == 0:
            assert same_document and b[0] == (a[-1] // 10 + 1) * 10  # B starts with the sentence after A's last one
        else:
            assert not same_document
    # every sentence of every document ends up in some instance
    used = {piece // 10 for row in instances for piece in row["input_ids"] if piece not in (cls, sep)}
    assert used == {10 * d + s for d in range(3) for s in range(8)}


def test_a_single_document_is_cut_into_parts_so_that_pairs_can_be_negative():
    one = [[f"sentence {i}." for i in range(25)]]
    parts = documents_for_pairs(one)
    assert len(parts) == 10 and sum(parts, []) == one[0]
    assert documents_for_pairs([["a."], ["b."]]) == [["a."], ["b."]]
    ids = [[[100 * d + 10 * s + k for k in range(3)] for s in range(len(part))] for d, part in enumerate(parts)]
    labels = {row["next_sentence_label"] for row in make_instances(ids, 16, np.random.default_rng(0), 2, 3)}
    assert labels == {0, 1}


def test_checkpoint_steps_are_log_spaced_from_zero():
    steps = checkpoint_steps(1500, 12)
    assert steps[0] == 0 and steps[1] == 10 and steps[-1] == 1500 and len(steps) == 12
    ratios = np.diff(np.log(steps[1:]))
    assert np.allclose(ratios, np.log(1500 / 10) / 10, atol=0.1)  # rounding to whole steps moves the early ones a little
    assert checkpoint_steps(5, 4) == [0, 5]


def test_linear_checkpoints_are_evenly_spaced_from_zero():
    """--linear-checkpoints: dense through the middle of the run, where a phase change such as the induction heads' falls."""
    assert checkpoint_steps(1600, 33, linear=True) == list(range(0, 1601, 50))
    assert checkpoint_steps(10, 4, linear=True) == [0, 3, 7, 10]  # round(10 / 3), round(20 / 3)
    assert checkpoint_steps(2, 5, linear=True) == [0, 1, 2]  # steps that coincide are saved once


def test_unigram_cross_entropy_by_hand():
    train = [[[5, 5, 6], [7]]]  # counts: 5 -> 2, 6 -> 1, 7 -> 1; vocabulary of 8, add-one smoothing
    expected = -(np.log(3 / 12) + np.log(1 / 12)) / 2
    assert unigram_cross_entropy(train, np.array([5, 0]), vocab_size=8) == pytest.approx(expected)


def test_validation_is_the_tail_of_each_document():
    train, validation = split_documents([list("abcdefghij"), list("klmnopqrst")], 0.2)
    assert train == [list("abcdefgh"), list("klmnopqr")] and validation == [list("ij"), list("st")]


def test_bad_corpora_name_the_file(tmp_path):
    with pytest.raises(CorpusError, match="no such file or folder"):
        pretrain(tmp_path / "missing.txt", tmp_path / "run", **SMALL)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no .txt files"):
        pretrain(tmp_path / "empty", tmp_path / "run", **SMALL)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\n\xff broken\n")
    with pytest.raises(CorpusError, match=r"bad.txt:2: invalid UTF-8"):
        pretrain(bad, tmp_path / "run", **SMALL)


def test_a_planted_pickle_in_the_training_state_never_runs(tmp_path):
    books = write_books(tmp_path / "books")
    pretrain(books, tmp_path / "run", steps=12, save_every=5, max_steps=5, **SMALL)
    [state] = (tmp_path / "run").rglob("state.pt")
    marker = tmp_path / "pwned"
    state.write_bytes(pickle.dumps({"settings": Planted(marker)}, protocol=2))
    with pytest.raises(BertologyError) as error:
        pretrain(books, tmp_path / "run", steps=12, save_every=5, **SMALL)
    assert not marker.exists()
    assert str(state) in str(error.value) and "\n" not in str(error.value)


def test_a_state_saved_by_an_older_bertology_is_refused_in_one_line(tmp_path):
    books = write_books(tmp_path / "books")
    pretrain(books, tmp_path / "run", steps=12, save_every=5, max_steps=5, **SMALL)
    [state] = (tmp_path / "run").rglob("state.pt")
    older = torch.load(state, weights_only=True)
    del older["random"], older["mask_rng"]
    torch.save(older, state)
    with pytest.raises(BertologyError) as error:
        pretrain(books, tmp_path / "run", steps=12, save_every=5, **SMALL)
    assert str(error.value) == f"{state}: a training state from an older bertology (missing mask_rng, random); delete {state.parent} to start again"


def test_out_is_checked_before_the_corpus_is_read(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("a file\n")
    with pytest.raises(BertologyError, match="is a file"):
        pretrain(tmp_path / "no-such-corpus", taken, **SMALL)


def test_a_new_run_replaces_the_earlier_checkpoints_and_a_failed_save_loses_nothing(tmp_path, monkeypatch):
    books = write_books(tmp_path / "books")
    out = tmp_path / "run"
    pretrain(books, out, steps=20, **SMALL)
    earlier = snapshot(out)

    def killed(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(reports, "pretraining_report", killed)
    with pytest.raises(OSError, match="No space left"):
        pretrain(books, out, steps=12, **SMALL)
    assert {name: data for name, data in snapshot(out).items() if not name.startswith("training/")} == earlier  # the earlier run is whole
    assert (out / "training" / "state" / "state.pt").is_file()  # and the new one's training is kept
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("run")] == ["run"]
    monkeypatch.undo()
    summary = pretrain(books, out, steps=12, **SMALL)
    assert summary["resumed_from_step"] == 12
    steps = checkpoint_steps(12, SMALL["checkpoints"])
    assert steps == [0, 10, 11, 12]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{step:06d}" for step in steps]  # none of the earlier run's (14, 20)
    assert pd.read_csv(out / "checkpoints.csv").step.tolist() == steps
    assert not (out / "training").exists()


@pytest.fixture(scope="module")
def interrupted_pretraining(tmp_path_factory):
    """A pre-training run stopped at step 5 of 12 (its state saved), and its books."""
    folder = tmp_path_factory.mktemp("interrupted")
    books = write_books(folder / "books")
    pretrain(books, folder / "run", steps=12, save_every=5, max_steps=5, **SMALL)
    return folder / "run", books


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(mask_rng=torch.zeros(7, dtype=torch.uint8)), "mask_rng is not the state of a torch random generator"),
    (lambda s: s.update(epoch=-1), "epoch = -1 is out of range"),
    (lambda s: s.update(position=0.5), "position must be a whole number, not 0.5"),
    (lambda s: s.update(step=99), "step = 99 is out of range (it must be from 0 to 12)"),
    (lambda s: s.update(losses=s["losses"][:3]), "'losses' has 3 rows for 5 steps"),
    (lambda s: s["losses"].__setitem__(2, (3, float("nan"), 0.7, 0.001)), "losses holds NaN or infinite values"),
    (lambda s: s["losses"].__setitem__(2, (3, 0.7)), "losses is not an array of real numbers"),
    (lambda s: s.update(evaluations=[(0, "../../elsewhere", 4.0, 0.5)]), "'evaluations' must hold (step, checkpoint name, validation loss, accuracy) rows"),
    (lambda s: s.update(evaluations=[(0, "step-000000", float("inf"), 0.5)]), "an evaluation's loss and accuracy holds NaN or infinite values"),
    (lambda s: s["model"].update({"bert.pooler.dense.bias": torch.zeros(5)}), "model['bert.pooler.dense.bias'] must be a torch.float32 tensor of shape [32]"),
    (lambda s: s.update(run={**s["run"], "seed": 7}), "'run' must be this run's identity (id, seed 0, recipe), not {"),  # another run's
    (lambda s: s.update(run="a run"), "'run' must be this run's identity (id, seed 0, recipe), not a run"),
])
def test_a_damaged_pretraining_state_is_refused_in_one_line(interrupted_pretraining, tmp_path, change, message):
    """A masking generator's state of the wrong size once stopped the resume with a traceback; a forged step, losses or
    evaluations were believed."""
    import shutil

    run, books = interrupted_pretraining
    shutil.copytree(run, tmp_path / "run")
    [state] = (tmp_path / "run").rglob("state.pt")
    saved = torch.load(state, weights_only=True)
    change(saved)
    torch.save(saved, state)
    with pytest.raises(StateError) as error:
        pretrain(books, tmp_path / "run", steps=12, save_every=5, **SMALL)
    assert str(error.value).startswith(f"{state}: ") and message in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("text", ["{not json", '{"model": {"type": "Nope"}, "added_tokens": []}', "[" * 100_000])
def test_a_damaged_tokenizer_beside_the_training_state_is_refused_in_one_line(interrupted_pretraining, tmp_path, text):
    """transformers' and tokenizers' errors (a JSONDecodeError, a bare Exception, a RecursionError) were a traceback."""
    import shutil

    run, books = interrupted_pretraining
    shutil.copytree(run, tmp_path / "run")
    [state] = (tmp_path / "run").rglob("state.pt")
    (state.parent / "tokenizer.json").write_text(text)
    with pytest.raises(StateError,
                       match=rf"^{state.parent}: cannot read the tokenizer saved with the training state \(.*\); delete {state.parent} to start over$"):
        pretrain(books, tmp_path / "run", steps=12, save_every=5, **SMALL)


def test_a_resume_on_an_edited_corpus_is_refused_in_one_line(tmp_path):
    """Issue 25: the training state's settings named the corpus files, not their contents."""
    books = write_books(tmp_path / "books")
    pretrain(books, tmp_path / "run", steps=12, save_every=5, max_steps=5, **SMALL)
    (books / "book0.txt").write_bytes((books / "book0.txt").read_bytes() + b"\r\nOne more sentence was added to this book.\r\n")
    with pytest.raises(BertologyError, match="other settings or another corpus") as error:
        pretrain(books, tmp_path / "run", steps=12, save_every=5, **SMALL)
    assert "\n" not in str(error.value)


def test_causal_pretraining_writes_decoder_checkpoints_every_command_can_load(tmp_path):
    books = write_books(tmp_path / "books")
    summary = pretrain(books, tmp_path / "run", steps=20, **CAUSAL)
    folders = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert [f.name for f in folders] == ["step-000000", "step-000010", "step-000014", "step-000020"]
    for folder in folders:
        loaded = load_model(folder, device="cpu", head="causal-lm")
        assert loaded.kind is DECODER and not loaded.adds_bos and loaded.cls_token_id is None and loaded.sep_token_id is None
        assert (loaded.num_layers, loaded.num_heads, type(loaded.model).__name__) == (2, 2, "GPT2LMHeadModel")
        assert checkpoint_step(str(folder)) == int(folder.name.split("-")[1])
    tokenizer = loaded.tokenizer
    ids = tokenizer("The dog ran.")["input_ids"]
    assert ids == tokenizer("The dog ran.", add_special_tokens=False)["input_ids"]  # nothing added: the first piece is the first token
    assert not set(ids) & set(tokenizer.all_special_ids) and tokenizer.decode(ids) == " The dog ran."
    assert tokenizer.model_input_names == ["input_ids", "attention_mask"]  # GPT-2 would add a token type's embedding
    losses = pd.read_csv(tmp_path / "run" / "loss.csv")
    assert list(losses.columns) == ["step", "lm_loss", "learning_rate"] and losses.step.tolist() == list(range(1, 21))
    evaluations = pd.read_csv(tmp_path / "run" / "checkpoints.csv")
    assert list(evaluations.columns) == ["step", "checkpoint", "val_lm_loss"] and evaluations.step.tolist() == [0, 10, 14, 20]
    # at step 0 the next-token loss is near ln(vocabulary); twenty steps on this repetitive text bring it clearly below
    assert evaluations.val_lm_loss.iloc[0] == pytest.approx(np.log(summary["model"]["vocab_size"]), abs=0.1)
    assert evaluations.val_lm_loss.iloc[-1] < evaluations.val_lm_loss.iloc[0] - 0.5
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["objective"] == summary["objective"] == "causal-lm" and manifest["model"]["architecture"] == "GPT-2"
    assert manifest["loss"] == "causal LM loss: next-token cross-entropy (Radford et al. 2019)"
    assert summary["val_lm_loss"] == pytest.approx(evaluations.val_lm_loss.iloc[-1]) and "val_mlm_loss" not in summary
    saved = json.loads((tmp_path / "run" / "pretraining.json").read_text())  # a causal run masks nothing (issue 39)
    assert "mask_probability" not in saved["settings"] and saved["settings"]["objective"] == "causal-lm"
    report = (tmp_path / "run" / "report.html").read_text()
    assert "causal LM loss" in report and "next-sentence" not in report
    assert not (tmp_path / "run" / "training").exists()


def test_causal_validation_loss_is_the_next_token_cross_entropy_of_each_run_alone(tmp_path):
    """The batched, padded validation loss against transformers' own ``labels=`` loss on each run, one at a time (no padding),
    weighted by its n - 1 predicted pieces; the unigram baseline against the training pieces' counts."""
    from transformers import GPT2LMHeadModel

    books = write_books(tmp_path / "books")
    summary = pretrain(books, tmp_path / "run", steps=10, validation_share=0.2, **{**CAUSAL, "checkpoints": 2})
    folder = tmp_path / "run" / "checkpoints" / "step-000010"
    tokenizer = load_model(folder, device="cpu").tokenizer
    train_text, validation_text = split_documents(documents_for_pairs(read_documents(corpus_files([books]))), 0.2)
    runs = make_causal_instances([[tokenizer(s, add_special_tokens=False)["input_ids"] for s in document] for document in validation_text], 32)
    assert len(runs) > 8 and len({len(run["input_ids"]) for run in runs}) > 1  # more than one batch, of runs of several lengths
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for run in runs:
            ids = torch.tensor([run["input_ids"]])
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    saved = pd.read_csv(tmp_path / "run" / "checkpoints.csv").set_index("step").val_lm_loss
    assert saved[10] == pytest.approx(total / count, rel=1e-5)
    assert json.loads((folder / "pretraining_step.json").read_text())["lm_loss"] == pytest.approx(total / count, rel=1e-5)

    counts = np.bincount([piece for document in train_text for s in document for piece in tokenizer(s, add_special_tokens=False)["input_ids"]],
                         minlength=len(tokenizer)) + 1.0
    targets = [piece for run in runs for piece in run["input_ids"][1:]]
    assert summary["unigram_cross_entropy"] == pytest.approx(-np.mean(np.log(counts[targets] / counts.sum())))


def test_causal_lm_loss_of_a_padded_batch_is_transformers_loss_over_the_real_pieces():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    network = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, pad_token_id=0)).eval()
    rows = [torch.randint(1, 50, (length,)) for length in (9, 5)]
    input_ids = torch.stack([torch.cat([row, torch.zeros(9 - len(row), dtype=torch.long)]) for row in rows])
    attention_mask = (torch.arange(9)[None] < torch.tensor([[9], [5]])).long()
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": input_ids.masked_fill(attention_mask == 0, -100)}
    with torch.inference_mode():
        loss = causal_lm_loss(network, batch)
        assert float(loss) == pytest.approx(float(network(**batch).loss), rel=1e-6)  # transformers shifts the labels itself
        by_hand = [-torch.log_softmax(network(input_ids=row[None]).logits[0, :-1], dim=-1).gather(1, row[1:, None]).squeeze(1) for row in rows]
    assert float(loss) == pytest.approx(float(torch.cat(by_hand).mean()), rel=1e-5)  # 8 + 4 predicted pieces, each run alone


def test_causal_instances_are_runs_of_whole_sentences():
    # sentence s of a document has 2 + s % 4 pieces, 100 d + 10 s + k; sentence 5 of document 0 has 13, more than max_length
    documents = [[[100 * d + 10 * s + k for k in range(13 if (d, s) == (0, 5) else 2 + s % 4)] for s in range(9)] for d in range(2)]
    runs = [row["input_ids"] for row in make_causal_instances(documents, max_length=8)]

    def joined(d: int, *sentences: int) -> list[int]:
        return [piece for s in sentences for piece in documents[d][s]]

    long = documents[0][5]  # cut into runs of its own: 8 pieces and the other 5
    assert runs == [joined(0, 0, 1), joined(0, 2), joined(0, 3, 4), long[:8], long[8:], joined(0, 6), joined(0, 7, 8),  # 5 + 4 > 8, 4 + 5 > 8, ...
                    joined(1, 0, 1), joined(1, 2), joined(1, 3, 4), joined(1, 5, 6), joined(1, 7, 8)]  # never across documents


def test_the_byte_level_vocabulary_is_the_same_on_every_training():
    sentences = [line for _ in range(3) for line in ("The cat sat on the mat.", "A dog ran, and it rained!", "Was it the cat?")]
    first, second = (train_byte_level_bpe(sentences, 300, 32) for _ in range(2))
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert first.convert_ids_to_tokens(first("The cat sat.")["input_ids"])[0] == "ĠThe"  # the first word has its space marker too


def test_a_state_of_the_other_objective_is_refused(tmp_path):
    books = write_books(tmp_path / "books")
    pretrain(books, tmp_path / "run", steps=12, save_every=5, max_steps=5, **SMALL)
    with pytest.raises(BertologyError, match="other settings or another corpus"):
        pretrain(books, tmp_path / "run", steps=12, save_every=5, **{**SMALL, "objective": "causal-lm"})
    with pytest.raises(BertologyError, match="^unknown objective 'gpt': use masked-lm or causal-lm$"):
        pretrain(books, tmp_path / "other", objective="gpt", **{k: v for k, v in SMALL.items()})


def test_a_causal_state_with_a_masked_lm_evaluation_is_refused_in_one_line(tmp_path):
    books = write_books(tmp_path / "books")
    pretrain(books, tmp_path / "run", steps=12, save_every=5, max_steps=5, **CAUSAL)
    [state] = (tmp_path / "run").rglob("state.pt")
    saved = torch.load(state, weights_only=True)
    assert [tuple(row[:2]) for row in saved["evaluations"]] == [(0, "step-000000")] and len(saved["losses"][0]) == 3
    saved["evaluations"] = [(0, "step-000000", 5.0, 0.5)]
    torch.save(saved, state)
    with pytest.raises(StateError) as error:
        pretrain(books, tmp_path / "run", steps=12, save_every=5, **CAUSAL)
    assert str(error.value) == f"{state}: 'evaluations' must hold (step, checkpoint name, validation loss) rows"


#: A decoder small enough that a command-line run takes seconds.
TINY_CLI = ("--causal", "--vocab-size", 300, "--layers", 1, "--heads", 2, "--hidden", 16, "--max-length", 16, "--batch-size", 4, "--checkpoints", 2,
            "--device", "cpu", "-q")


def _strict_json(path):
    """``path`` read as JSON proper: NaN and Infinity, which Python's json writes by default, are refused."""
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.parametrize("options", [SMALL, CAUSAL], ids=["masked-lm", "causal-lm"])
@pytest.mark.parametrize("steps, loss", [(20, "training"), (2, "validation")])  # at step 2 a checkpoint is due: its validation scores
def test_a_diverging_run_stops_at_its_first_non_finite_loss_keeping_the_good_checkpoints(tmp_path, options, steps, loss):
    """Issue 37, case 4: `--learning-rate 1e30` gave NaN weights and `"lm_loss": NaN` in step files, and exited 0."""
    books = write_books(tmp_path / "books")
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as error:
        pretrain(books, out, steps=steps, save_every=1, **{**options, "learning_rate": 1e30})
    name = "lm_loss" if options is CAUSAL else "mlm_loss"
    prefix = "validation " if loss == "validation" else ""
    match = re.fullmatch(rf"pre-training diverged at step (\d+): its {prefix}{name} is (nan|inf) \(--learning-rate 1e\+30\); stopped, "
                         rf"the last good checkpoint is {re.escape(str((out / 'training' / 'checkpoints' / 'step-000000').resolve()))}; "
                         r"lower --learning-rate and give another --out", str(error.value))
    assert match, str(error.value)
    assert 1 < int(match[1]) <= steps  # the first step's loss, of the random weights, is finite
    assert not (out / "pretraining.json").exists() and not (out / "manifest.json").exists()
    kept = sorted((out / "training" / "checkpoints").iterdir())
    assert [folder.name for folder in kept] == ["step-000000"]
    assert all(torch.isfinite(tensor).all() for tensor in load_file(kept[0] / "model.safetensors").values())
    assert _strict_json(kept[0] / "pretraining_step.json")["step"] == 0
    for path in out.rglob("*.json"):
        _strict_json(path)
    state = torch.load(out / "training" / "state" / "state.pt", weights_only=True)  # saved at every step before the divergence
    assert state["step"] == int(match[1]) - 1 and all(torch.isfinite(tensor).all() for tensor in state["model"].values())
    with pytest.raises(TrainingDiverged) as again:  # the same command resumes from that state, to the same divergence
        pretrain(books, out, steps=steps, save_every=1, **{**options, "learning_rate": 1e30})
    assert str(again.value) == str(error.value)


def test_a_diverging_run_is_one_line_and_exit_status_2_on_the_command_line(tmp_path):
    books = write_books(tmp_path / "books")
    result = run_cli("pretrain", books, "--out", tmp_path / "run", *TINY_CLI, "--steps", 20, "--learning-rate", "1e30")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    [line] = result.stderr.splitlines()
    assert re.match(r"error: pre-training diverged at step \d+: its lm_loss is (nan|inf)", line), line
    assert (tmp_path / "run" / "training" / "checkpoints" / "step-000000" / "model.safetensors").is_file()


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), float("-inf"), 0.0, -1e-3, "0.001"])
def test_a_learning_rate_that_is_not_a_finite_number_above_0_is_refused_before_any_work(tmp_path, rate):
    """Issue 37, case 8: `--learning-rate nan` trained on, every loss NaN."""
    with pytest.raises(BertologyError, match=rf"^--learning-rate must be a finite number above 0, not {re.escape(repr(rate))}$"):
        pretrain(tmp_path / "no-such-corpus", tmp_path / "run", **{**SMALL, "learning_rate": rate})  # refused before the corpus is read
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rate", ["nan", "inf", "0"])
def test_a_learning_rate_that_is_not_a_finite_number_above_0_is_one_line_on_the_command_line(tmp_path, rate):
    books = write_books(tmp_path / "books")
    result = run_cli("pretrain", books, "--out", tmp_path / "run", "--learning-rate", rate, *TINY_CLI, "--steps", 2)
    assert result.returncode == 2 and result.stderr == f"error: --learning-rate must be a finite number above 0, not {float(rate)!r}\n"
    assert not (tmp_path / "run").exists()


def test_a_corpus_too_small_to_hold_text_out_says_that_it_validates_on_training_text(tmp_path):
    """Issue 37, case 9: a one-sentence corpus was validated on its training text without a word."""
    one = tmp_path / "one.txt"
    one.write_text("The cat sat on the mat.\n")
    _, validation = split_documents(documents_for_pairs(read_documents([one])), 0.02)
    assert validation == []  # no text is held out
    result = run_cli("pretrain", one, "--out", tmp_path / "run", *TINY_CLI, "--steps", 3)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["warning: the corpus is too small to hold text out, so the validation scores are measured on training "
                                          "text and say nothing of generalisation"]
    for name in ("pretraining.json", "manifest.json"):
        assert _strict_json(tmp_path / "run" / name)["corpus"]["validated_on_training_text"] is True, name
    assert "so it measures fit, not generalisation" in (tmp_path / "run" / "report.html").read_text()
    books = write_books(tmp_path / "books")  # held-out text: none of it
    summary = pretrain(books, tmp_path / "books-run", steps=2, **{**CAUSAL, "checkpoints": 2})
    assert summary["corpus"]["validated_on_training_text"] is False
    assert not any(line.startswith("warning:") for line in Pretrain().summary(summary, {"out": tmp_path / "books-run"}))
    assert "measured on held-out text" in (tmp_path / "books-run" / "report.html").read_text()


def test_a_batch_with_no_piece_to_score_is_passed_over_not_a_nan_step(tmp_path):
    """Runs of one piece (a document that is one frequent word) have no next piece: a batch of them had a NaN loss, written to
    loss.csv and the training state (which a resume then refused), and taken for a divergence."""
    books = write_books(tmp_path / "books")
    for k in range(4):
        (books / f"word{k}.txt").write_text("a\n")
    options = {**CAUSAL, "batch_size": 1}
    pretrain(books, tmp_path / "run", steps=30, save_every=5, max_steps=15, **options)
    pretrain(books, tmp_path / "run", steps=30, save_every=5, **options)  # resumed from a state of finite losses
    tokenizer = load_model(tmp_path / "run" / "checkpoints" / "step-000030", device="cpu").tokenizer
    assert tokenizer("a", add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids("Ġa")]  # one piece: nothing to predict
    losses = pd.read_csv(tmp_path / "run" / "loss.csv")
    assert losses.step.tolist() == list(range(1, 31)) and np.isfinite(losses.lm_loss).all()
