"""Pre-training a small BERT from scratch: the checkpoint series that training-dynamics analyses track.

The recipe is BERT's (Devlin et al. 2019), scaled down:

- corpus: plain text, one document per file, paragraphs separated by blank lines and split into
  sentences by spaCy's rule-based ``sentencizer``;
- vocabulary: WordPiece trained on the training text with HF ``tokenizers`` (lower-cased);
- instances: ``[CLS] A [SEP] B [SEP]``, where A and B are runs of whole sentences filling
  ``max_length``; half of the time B is the text that follows A (next-sentence label 0), half of
  the time a run from another document (label 1), so that [SEP] separates two segments the model
  must relate. The pairing is redrawn every epoch;
- masked-LM: 15% of the non-special pieces are chosen, of those 80% become [MASK], 10% a random
  piece and 10% stay (transformers' ``DataCollatorForLanguageModeling``). The output projection is
  applied only at the chosen positions: the same loss for about a seventh of its cost;
- loss = masked-LM cross-entropy + next-sentence cross-entropy; AdamW with linear warm-up and decay.

Checkpoints are saved at log-spaced steps (step 0, the random initialisation, included), each a
model folder (config, weights, tokenizer) that every bertology command accepts as ``--model``.

Yardstick for "the model has learnt something": the unigram cross-entropy
``-mean_t ln p(t)`` over the masked validation pieces ``t``, where ``p`` is the add-one smoothed
piece frequency of the training text; the model's masked-LM loss is measured on the same masked
pieces (validation = the last ``validation_share`` of every document's sentences).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import BertConfig, BertForPreTraining, BertTokenizerFast, DataCollatorForLanguageModeling, get_linear_schedule_with_warmup
from transformers.utils import logging as hf_logging

from bertology.core.corpora import numbered_lines
from bertology.core.digests import file_digest
from bertology.core.errors import BertologyError, CorpusError, StateError
from bertology.core.models import quiet_transformers, resolve_device
from bertology.core.runfolder import RunFolder, claims_out, finish, link_tree
from bertology.core.safeload import finite_array, whole_number
from bertology.core.stats import keyed_rng
from bertology.core.training import check_generator_state, load_training_state, random_states, resume_training, save_training_state

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
#: What a pre-training state holds (:func:`pretrain`); a state without one of them is from an older bertology.
PRETRAIN_STATE_KEYS = ("model", "optimizer", "scheduler", "mask_rng", "random", "step", "epoch", "position", "losses", "evaluations", "settings")
CHECKPOINT_PREFIX = "step-"


@dataclass
class PretrainSettings:
    """What a pre-training run does (saved with its training state: a resume must match)."""

    corpus: list[str]
    vocab_size: int = 8000
    layers: int = 4
    heads: int = 8
    hidden: int = 256
    intermediate: int = 1024
    max_length: int = 128
    batch_size: int = 32
    steps: int = 1500
    learning_rate: float = 1e-3
    warmup: float = 0.06
    weight_decay: float = 0.01
    mask_probability: float = 0.15
    checkpoints: int = 12
    validation_share: float = 0.02
    seed: int = 0
    corpus_sha256: list[str] | None = None  # each corpus file's content: a resume never trains on an edited corpus


def corpus_files(paths: list[str | Path]) -> list[Path]:
    """The text files of ``paths``: files as given, folders expanded to their ``*.txt`` files (sorted)."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.glob("*.txt"))
            if not found:
                raise CorpusError(path, None, "no .txt files in this folder")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise CorpusError(path, None, "no such file or folder")
    return files


def read_documents(files: list[Path]) -> list[list[str]]:
    """Each file as one document: its sentences, in order (paragraphs end at blank lines)."""
    import spacy

    splitter = spacy.blank("en")
    splitter.add_pipe("sentencizer")
    documents = []
    for path in files:
        paragraphs, current = [], []
        for _, line in numbered_lines(path):
            if line.strip():
                current.append(line.strip())
            elif current:
                paragraphs.append(" ".join(current))
                current = []
        if current:
            paragraphs.append(" ".join(current))
        sentences = [sentence.text for doc in splitter.pipe(paragraphs, batch_size=256) for sentence in doc.sents if sentence.text.strip()]
        if not sentences:
            raise CorpusError(path, None, "no text in this file")
        documents.append(sentences)
    return documents


def documents_for_pairs(documents: list[list[str]], parts: int = 10) -> list[list[str]]:
    """Documents to draw next-sentence negatives from: a single document is cut into ``parts`` consecutive parts.

    A negative pair needs its second segment from another document; with one file there is none,
    and every pair would be a true continuation.
    """
    if len(documents) != 1:
        return documents
    sentences = documents[0]
    bounds = np.linspace(0, len(sentences), min(parts, len(sentences)) + 1).astype(int)
    return [sentences[start:end] for start, end in zip(bounds, bounds[1:]) if end > start]


def split_documents(documents: list[list[str]], validation_share: float) -> tuple[list[list[str]], list[list[str]]]:
    """Training and validation documents: the last ``validation_share`` of each document's sentences is held out."""
    train, validation = [], []
    for sentences in documents:
        held = int(round(len(sentences) * validation_share))
        train.append(sentences[: len(sentences) - held])
        if held:
            validation.append(sentences[len(sentences) - held :])
    return train, validation


def train_wordpiece(sentences: list[str], vocab_size: int, max_length: int) -> BertTokenizerFast:
    """A lower-cased WordPiece tokenizer trained on ``sentences`` (HF ``tokenizers``), wrapped for transformers.

    The trainer numbers pieces of equal rank in hash order, which changes from process to process;
    WordPiece's output does not depend on the numbering, so the pieces are renumbered (special
    tokens first, then sorted) to make the same corpus give the same ids.
    """
    from tokenizers import BertWordPieceTokenizer
    from tokenizers.models import WordPiece

    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(sentences, vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    pieces = list(SPECIAL_TOKENS) + sorted(set(wordpiece.get_vocab()) - set(SPECIAL_TOKENS))
    wordpiece._tokenizer.model = WordPiece({piece: i for i, piece in enumerate(pieces)}, unk_token="[UNK]")
    return BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, model_max_length=max_length)


def make_instances(documents: list[list[list[int]]], max_length: int, rng: np.random.Generator,
                   cls_id: int, sep_id: int) -> list[dict]:
    """Sentence-pair instances for masked-LM + next-sentence prediction (Devlin et al.'s ``create_instances_from_document``).

    Sentences of a document are gathered until they fill ``max_length - 3`` pieces; the run is cut
    at a random sentence boundary into A and B. With probability 1/2 (always for a one-sentence
    run), B is replaced by a run of sentences from another document (``next_sentence_label`` 1)
    and the unused sentences go back into the stream. A pair that is too long loses pieces from
    the end of its longer segment.
    """
    budget = max_length - 3
    instances = []
    for d, sentences in enumerate(documents):
        chunk, length, i = [], 0, 0
        while i < len(sentences):
            chunk.append(sentences[i])
            length += len(sentences[i])
            if i == len(sentences) - 1 or length >= budget:
                cut = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
                segment_a = [piece for sentence in chunk[:cut] for piece in sentence]
                others = [k for k in range(len(documents)) if k != d and documents[k]]
                if others and (len(chunk) == 1 or rng.random() < 0.5):
                    other = documents[others[int(rng.integers(len(others)))]]
                    start = int(rng.integers(len(other)))
                    segment_b = []
                    for sentence in other[start:]:
                        segment_b.extend(sentence)
                        if len(segment_b) >= budget - len(segment_a):
                            break
                    label = 1
                    i -= len(chunk) - cut  # the sentences not used go back into the stream
                else:
                    segment_b, label = [piece for sentence in chunk[cut:] for piece in sentence], 0
                while len(segment_a) + len(segment_b) > budget:
                    (segment_a if len(segment_a) > len(segment_b) else segment_b).pop()
                if segment_a and segment_b:
                    instances.append(
                        {
                            "input_ids": [cls_id, *segment_a, sep_id, *segment_b, sep_id],
                            "token_type_ids": [0] * (len(segment_a) + 2) + [1] * (len(segment_b) + 1),
                            "special_tokens_mask": [1] + [0] * len(segment_a) + [1] + [0] * len(segment_b) + [1],
                            "next_sentence_label": label,
                        }
                    )
                chunk, length = [], 0
            i += 1
    return instances


def checkpoint_steps(steps: int, count: int) -> list[int]:
    """Step 0 and ``count - 1`` log-spaced steps from ``min(10, steps)`` to ``steps`` (fewer where they coincide)."""
    if count < 2:
        return [steps]
    spaced = np.geomspace(min(10, steps), steps, count - 1) if steps > 0 else np.array([])
    return sorted({0, *np.round(spaced).astype(int).tolist(), steps})


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def check_pretraining_state(path: Path, state: dict, steps: int) -> None:
    """Refuse a pre-training state (read by :func:`~bertology.studies.finetune.finetuning.load_training_state`) whose own parts are
    damaged: a step past ``steps``, the masking generator's state, epoch and position whole numbers from 0, a row of
    finite (step, masked-LM loss, next-sentence loss, learning rate) per step, and per checkpoint saved an evaluation
    (step, checkpoint name, validation loss, accuracy)."""
    step = whole_number(state["step"], "step", path, high=steps)
    check_generator_state(state["mask_rng"], "mask_rng", path)
    whole_number(state["epoch"], "epoch", path)
    whole_number(state["position"], "position", path)
    if len(state["losses"]) != step:
        raise StateError(path, f"'losses' has {len(state['losses'])} rows for {step} steps")
    if step:
        finite_array(state["losses"], "losses", path, shape=(step, 4))
    if not isinstance(state["evaluations"], list):
        raise StateError(path, "'evaluations' must be a list")
    for row in state["evaluations"]:
        if not (isinstance(row, (list, tuple)) and len(row) == 4 and row[1] == checkpoint_name(whole_number(row[0], "an evaluation's step", path, high=step))):
            raise StateError(path, "'evaluations' must hold (step, checkpoint name, validation loss, accuracy) rows")
        finite_array(row[2:], "an evaluation's loss and accuracy", path, shape=(2,))


def pretraining_losses(network: BertForPreTraining, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked-LM and next-sentence cross-entropies (means) and the next-sentence logits; the LM head runs only at masked positions."""
    output = network.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"])
    masked = batch["labels"] != -100
    scores = network.cls.predictions(output.last_hidden_state[masked])
    next_logits = network.cls.seq_relationship(output.pooler_output)
    return F.cross_entropy(scores, batch["labels"][masked]), F.cross_entropy(next_logits, batch["next_sentence_label"]), next_logits


def _collate(collator: DataCollatorForLanguageModeling, rows: list[dict], device: torch.device) -> dict[str, torch.Tensor]:
    labels = torch.tensor([row["next_sentence_label"] for row in rows])
    batch = collator([{k: v for k, v in row.items() if k != "next_sentence_label"} for row in rows])
    batch["next_sentence_label"] = labels
    return {k: v.to(device) for k, v in batch.items()}


def evaluate(network: BertForPreTraining, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Masked-LM loss (mean over the masked pieces) and next-sentence accuracy on fixed, already masked batches."""
    network.eval()
    total, count, correct, pairs = 0.0, 0, 0, 0
    with torch.inference_mode():
        for batch in batches:
            masked = int((batch["labels"] != -100).sum())
            mlm, _, next_logits = pretraining_losses(network, batch)
            total += float(mlm) * masked
            count += masked
            correct += int((next_logits.argmax(-1) == batch["next_sentence_label"]).sum())
            pairs += len(next_logits)
    network.train()
    return {"mlm_loss": total / max(count, 1), "nsp_accuracy": correct / max(pairs, 1)}


def unigram_cross_entropy(train_ids: list[list[list[int]]], batches: list[dict[str, torch.Tensor]], vocab_size: int) -> float:
    """``-mean_t ln p(t)`` over the masked pieces of ``batches``, ``p`` = add-one smoothed training piece frequencies."""
    pieces = np.fromiter((piece for document in train_ids for sentence in document for piece in sentence), dtype=np.int64)
    counts = np.bincount(pieces, minlength=vocab_size) + 1.0
    log_p = np.log(counts / counts.sum())
    targets = np.concatenate([batch["labels"][batch["labels"] != -100].cpu().numpy() for batch in batches])
    return float(-log_p[targets].mean())


@claims_out(work="training", words=("device",))
def pretrain(
    corpus: list[str | Path] | str | Path,
    out: str | Path,
    *,
    vocab_size: int = 8000,
    layers: int = 4,
    heads: int = 8,
    hidden: int = 256,
    intermediate: int | None = None,
    max_length: int = 128,
    batch_size: int = 32,
    steps: int = 1500,
    learning_rate: float = 1e-3,
    warmup: float = 0.06,
    weight_decay: float = 0.01,
    mask_probability: float = 0.15,
    checkpoints: int = 12,
    validation_share: float = 0.02,
    seed: int = 0,
    device: str = "auto",
    save_every: int = 200,
    max_steps: int | None = None,
    progress: bool = True,
    command: list[str] | None = None,
) -> dict:
    """Pre-train a BERT of the given size from scratch on ``corpus`` (text files or folders of ``*.txt``).

    Writes to ``out``: ``checkpoints/step-NNNNNN/`` (model folders), ``checkpoints.csv`` (step,
    validation masked-LM loss and next-sentence accuracy), ``loss.csv`` (training losses per step),
    ``loss_curve.png``, ``report.html`` and ``pretraining.json`` (settings, corpus, unigram
    baseline, final losses, wall time). While training, the checkpoints so far and the training state
    (saved every ``save_every`` steps, read back with ``weights_only=True``) are kept in ``out/training/``:
    the same call resumes an interrupted run, and an earlier run in ``out`` stays whole until the new
    one replaces it at the end. ``max_steps`` stops early (tests use it to interrupt).
    """
    if hidden % heads:
        raise BertologyError(f"--hidden {hidden} is not divisible by --heads {heads}")
    started = time.perf_counter()
    files = corpus_files([corpus] if isinstance(corpus, (str, Path)) else list(corpus))
    settings = PretrainSettings([str(f) for f in files], vocab_size, layers, heads, hidden, intermediate or 4 * hidden, max_length,
                                batch_size, steps, learning_rate, warmup, weight_decay, mask_probability, checkpoints, validation_share, seed,
                                corpus_sha256=[file_digest(Path(f), {}) for f in files])
    torch_device = resolve_device(device)
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)

    training = Path(out) / "training"  # the work of an unfinished run: its state and checkpoints so far
    state_folder = training / "state"
    state = load_training_state(state_folder / "state.pt", PRETRAIN_STATE_KEYS) if (state_folder / "state.pt").is_file() else None
    if state is None:
        shutil.rmtree(training, ignore_errors=True)  # a start that never saved a state: nothing to resume
    elif state.get("settings") != asdict(settings):
        raise BertologyError(f"{state_folder}: the training state of a run with other settings or another corpus is there; use another --out or delete it")
    else:
        check_pretraining_state(state_folder / "state.pt", state, steps)
    documents = documents_for_pairs(read_documents(files))
    train_text, validation_text = split_documents(documents, validation_share)
    if state is not None:  # resume with the vocabulary the saved weights were trained with
        try:
            tokenizer = BertTokenizerFast.from_pretrained(state_folder)
        except Exception as exc:  # transformers and tokenizers raise many kinds for a damaged file, the bare Exception included
            raise StateError(state_folder, f"cannot read the tokenizer saved with the training state ({' '.join(str(exc).split())[:120]}); "
                                           f"delete {state_folder} to start over") from None
    else:
        tokenizer = train_wordpiece([s for document in train_text for s in document], vocab_size, max_length)

    def encode(docs: list[list[str]]) -> list[list[list[int]]]:
        return [tokenizer(document, add_special_tokens=False)["input_ids"] if document else [] for document in docs]

    with quiet_transformers():  # sentences longer than max_length are fine here: instances are cut to size
        train_ids, validation_ids = encode(train_text), encode(validation_text)
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id

    def epoch_rows(index: int) -> list[dict]:
        """The training instances of epoch ``index``, paired and shuffled by a generator keyed by the epoch."""
        rng = keyed_rng(seed, "epoch", index)
        rows = make_instances(train_ids, max_length, rng, cls_id, sep_id)
        return [rows[i] for i in rng.permutation(len(rows))]

    rows = epoch_rows(0)
    if not rows:
        raise CorpusError(files[0], None, "too little text to make one training instance")
    validation_rows = make_instances(validation_ids, max_length, keyed_rng(seed, "validation"), cls_id, sep_id)
    if not validation_rows:  # a corpus too small to hold text out: validate on (fixed) training instances
        validation_rows = make_instances(train_ids, max_length, keyed_rng(seed, "validation"), cls_id, sep_id)[:batch_size]
    validation_collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mask_probability, seed=seed + 1)
    validation_batches = [_collate(validation_collator, validation_rows[i : i + batch_size], torch_device)
                          for i in range(0, len(validation_rows), batch_size)]
    unigram = unigram_cross_entropy(train_ids, validation_batches, len(tokenizer))

    config = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=settings.intermediate, max_position_embeddings=max_length, type_vocab_size=2,
                        pad_token_id=tokenizer.pad_token_id)
    network = BertForPreTraining(config).to(torch_device)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in network.named_parameters() if not n.endswith(no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in network.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.98), eps=1e-6)
    scheduler = get_linear_schedule_with_warmup(optimizer, max(1, int(warmup * steps)), steps)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mask_probability, seed=seed)
    collator.create_rng()

    step, epoch, position, losses, evaluations = 0, 0, 0, [], []
    if state is not None:
        resume_training(state_folder / "state.pt", state, network, optimizer, scheduler)  # and torch's random state: dropout
        collator.generator.set_state(state["mask_rng"])
        step, epoch, position, losses, evaluations = state["step"], state["epoch"], state["position"], state["losses"], state["evaluations"]
    resumed_from = step

    def save_state() -> None:
        save_training_state(state_folder, {
            "model": network.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "mask_rng": collator.generator.get_state(), "random": random_states(), "step": step, "epoch": epoch, "position": position,
            "losses": losses, "evaluations": evaluations, "settings": asdict(settings),
        }, tokenizer)

    def save_checkpoint() -> None:
        scores = evaluate(network, validation_batches)
        name = checkpoint_name(step)
        target = training / "checkpoints" / name
        with quiet_transformers():
            network.save_pretrained(target)
            tokenizer.save_pretrained(target)
        (target / "pretraining_step.json").write_text(json.dumps({"step": step, **scores}, indent=2) + "\n")
        evaluations.append((step, name, scores["mlm_loss"], scores["nsp_accuracy"]))

    saved_steps = set(checkpoint_steps(steps, checkpoints))
    done = {row[0] for row in evaluations}
    network.train()
    if step == 0 and 0 not in done:
        save_checkpoint()
    stop_at = steps if max_steps is None else min(steps, max_steps)
    if epoch:  # resumed in a later epoch
        rows = epoch_rows(epoch)
    with tqdm(total=steps, initial=step, unit="step", desc="pre-training", disable=not progress) as bar:
        while step < stop_at:
            if position >= len(rows):
                epoch, position = epoch + 1, 0
                rows = epoch_rows(epoch)
            batch = _collate(collator, rows[position : position + batch_size], torch_device)
            position += batch_size
            mlm, nsp, _ = pretraining_losses(network, batch)
            (mlm + nsp).backward()
            torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            losses.append((step, mlm.item(), nsp.item(), scheduler.get_last_lr()[0]))
            bar.update(1)
            bar.set_postfix(mlm=f"{np.mean([row[1] for row in losses[-50:]]):.3f}")
            if step in saved_steps:
                save_checkpoint()
            if step in saved_steps or step % save_every == 0 or step == stop_at:
                save_state()
    if step < steps:
        return {"interrupted_at_step": step, "steps": steps}

    seconds = time.perf_counter() - started
    final = evaluations[-1]
    summary = {
        "corpus": {"files": settings.corpus, "documents": len(documents), "sentences": sum(map(len, documents)),
                   "training_pieces": int(sum(len(s) for document in train_ids for s in document)),
                   "validation_instances": len(validation_rows)},
        "model": {"parameters": sum(p.numel() for p in network.bert.parameters()), "vocab_size": len(tokenizer)},
        "settings": asdict(settings),
        "device": str(torch_device),
        "steps": steps,
        "epochs": round(epoch + position / max(len(rows), 1), 2),
        "resumed_from_step": resumed_from or None,
        "seconds": round(seconds, 1),
        "final_checkpoint": str((Path(out) / "checkpoints" / final[1]).resolve()),
        "val_mlm_loss": final[2],
        "val_nsp_accuracy": final[3],
        "unigram_cross_entropy": unigram,
        "train_mlm_loss_last_50": float(np.mean([row[1] for row in losses[-50:]])),
    }
    from bertology.studies.pretrain.report import pretraining_report

    folder = RunFolder(out)  # replaces out whole, training/ with it
    link_tree(training / "checkpoints", folder.path / "checkpoints")
    loss_table = pd.DataFrame(losses, columns=["step", "mlm_loss", "nsp_loss", "learning_rate"])
    checkpoint_table = pd.DataFrame(evaluations, columns=["step", "checkpoint", "val_mlm_loss", "val_nsp_accuracy"])
    folder.write_table("loss", loss_table)
    folder.write_table("checkpoints", checkpoint_table)
    folder.write_json("pretraining.json", summary)
    manifest = {key: summary[key] for key in ("corpus", "model", "settings", "device", "steps", "resumed_from_step")}
    finish(folder, manifest, report=pretraining_report(folder, summary, loss_table, checkpoint_table), command=command)
    return summary
