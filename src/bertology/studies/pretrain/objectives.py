"""The pre-training objectives: what differs between pre-training a BERT with the masked-LM and next-sentence losses and a
GPT-2-style decoder with the causal LM loss, in one object that the corpus, the training loop, the summary and the report ask
instead of branching on the objective's name.

An :class:`Objective` trains its vocabulary (WordPiece or byte-level BPE) with its special tokens, makes the instances of a
corpus's pieces (sentence pairs, or runs of sentences), masks them or not (its collator), builds the model (a
``BertForPreTraining`` or a ``GPT2LMHeadModel``), and says which pieces its loss scores, its training losses and validation
scores, and the words the report and the command line give them. :data:`OBJECTIVES` holds one of each by name (a run's
``objective``, what ``--causal`` picks); :func:`objective_named` is the one place a name becomes an objective.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from transformers import (
    BertConfig,
    BertForPreTraining,
    BertTokenizerFast,
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from bertology.core.errors import BertologyError
from bertology.core.learning.tasks import next_token_losses
from bertology.core.model.models import quiet_transformers
from bertology.studies.pretrain.settings import PretrainSettings

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
#: The byte-level BPE's special tokens: GPT-2's end of text (its BOS and EOS, never added by the tokenizer) and the padding of batches.
BPE_SPECIAL_TOKENS = ("<|endoftext|>", "<pad>")


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


def train_byte_level_bpe(sentences: list[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's, Radford et al. 2019) trained on ``sentences`` (HF ``tokenizers``), wrapped for transformers.

    Cased, every byte a piece (no unknown piece), and nothing added around a text: no [CLS]/[SEP] and no BOS, the
    first piece is the first token, as with GPT-2's tokenizer. ``<|endoftext|>`` is its BOS and EOS, ``<pad>`` pads
    batches. A text's first word gets the space marker ``Ġ`` too (``add_prefix_space``): a sentence is cut into the
    same pieces alone as inside a run. The trainer ranks merges by count, ties by the pair, so the same corpus gives the
    same pieces and ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=True)  # offsets without the leading space: pieces align with words
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(BPE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(sentences, trainer)
    end = BPE_SPECIAL_TOKENS[0]
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=end, eos_token=end, pad_token=BPE_SPECIAL_TOKENS[1], model_max_length=max_length)


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


def make_causal_instances(documents: list[list[list[int]]], max_length: int) -> list[dict]:
    """Instances for the causal LM loss: runs of whole sentences of one document, at most ``max_length`` pieces each,
    so that every run starts at a sentence; a sentence longer than ``max_length`` is cut into runs of its own."""
    instances = []
    for sentences in documents:
        run: list[int] = []
        for sentence in sentences:
            for start in range(0, len(sentence), max_length):
                part = sentence[start : start + max_length]
                if len(run) + len(part) > max_length:
                    instances.append({"input_ids": run})
                    run = []
                run = run + part
        if run:
            instances.append({"input_ids": run})
    return instances


def pretraining_losses(network: BertForPreTraining, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked-LM and next-sentence cross-entropies (means) and the next-sentence logits; the LM head runs only at masked positions."""
    output = network.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"])
    masked = batch["labels"] != -100
    scores = network.cls.predictions(output.last_hidden_state[masked])
    next_logits = network.cls.seq_relationship(output.pooler_output)
    return F.cross_entropy(scores, batch["labels"][masked]), F.cross_entropy(next_logits, batch["next_sentence_label"]), next_logits


def next_token_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[batch, n - 1]``: the piece each position but the last predicts, ``labels[:, 1:]`` (-100 where that is padding)."""
    return batch["labels"][:, 1:]


def causal_lm_loss(network: GPT2LMHeadModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal LM loss: the next-token cross-entropy ``-mean_t ln p(x_{t+1} | x_{<=t})``, the mean over the pieces
    that have a next piece (the logits at position t score the piece at t + 1; padding scores nothing)."""
    logits = network(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    summed, predicted = next_token_losses(logits, batch["input_ids"], batch["attention_mask"].bool())  # the loss importance and gradients use
    return summed.sum() / predicted.sum()


def check_attention_only_shape(hidden: int, heads: int) -> None:
    """Refuse in one line an attention-only decoder (:func:`attention_only_decoder`, a Llama) whose head size is odd: its
    rotary positions turn pairs of coordinates."""
    if (hidden // heads) % 2:
        raise BertologyError(f"--attention-only builds a Llama, whose rotary positions need an even head size: --hidden {hidden} / --heads {heads} "
                             f"is {hidden // heads}")


def attention_only_decoder(tokenizer: PreTrainedTokenizerFast, settings: PretrainSettings) -> LlamaForCausalLM:
    """An attention-only decoder (``--attention-only``; Olsson et al. 2022's and Elhage et al. 2021's small models): a Llama
    (``LlamaForCausalLM``, a standard transformers model every command loads) whose MLP blocks are of ``intermediate_size``
    0. Their three weights are empty (``[0, hidden]``, ``[hidden, 0]``) and ``down_proj`` of an empty product is exactly 0, so
    each layer is ``x + attention(RMSNorm(x))`` and nothing else; the post-attention norm before the empty MLP reaches no
    output (its gradient is 0). transformers has no attention-only switch, and GPT-2's MLP cannot be sized 0 (its Conv1D
    fails on an empty weight), hence Llama's layout: rotary positions, RMSNorm, no biases, an untied unembedding."""
    check_attention_only_shape(settings.hidden, settings.heads)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=settings.hidden, intermediate_size=0, num_hidden_layers=settings.layers,
                         num_attention_heads=settings.heads, num_key_value_heads=settings.heads, max_position_embeddings=settings.max_length,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with quiet_transformers():  # and torch's warning that initialising the empty MLP weights does nothing: that is the point
        return LlamaForCausalLM(config)


#: The synthetic task's settings, which a run on a corpus leaves out of what it records.
SYNTHETIC_SETTINGS = ("synthetic", "repeat_share", "min_period", "max_period")


class Objective:
    """What one pre-training objective trains and records (see the module docstring). One instance of each serves every run:
    :data:`MASKED_LM` and :data:`CAUSAL_LM`, by name in :data:`OBJECTIVES`."""

    #: ``masked-lm`` or ``causal-lm``: :attr:`PretrainSettings.objective`, as ``pretraining.json`` and the manifest say.
    name: ClassVar[str]
    #: The model's architecture, as the summary names it.
    architecture: ClassVar[str]
    #: The report's and the manifest's words for the loss.
    loss: ClassVar[str]
    #: The report's name of the LM loss (its curve's title and axis).
    loss_name: ClassVar[str]
    #: The training losses of each step (loss.csv, between step and learning_rate); the first is the LM loss.
    step_losses: ClassVar[tuple[str, ...]]
    #: The validation scores of each checkpoint (checkpoints.csv: ``val_<score>``); the first is the LM loss.
    scores: ClassVar[tuple[str, ...]]
    #: The scores in a refusal of a damaged state.
    score_names: ClassVar[tuple[str, ...]]
    #: Whether its instances are masked (``DataCollatorForLanguageModeling``'s ``mlm``): the report says "with fixed masks".
    masks: ClassVar[bool]
    #: Whether it also predicts the next sentence (``nsp_loss``, ``val_nsp_accuracy``): the report draws a panel of it.
    predicts_next_sentence: ClassVar[bool]
    #: The settings it plays no part in: the summary leaves them out.
    unused_settings: ClassVar[tuple[str, ...]]
    #: Its vocabulary's special tokens.
    special_tokens: ClassVar[tuple[str, ...]]
    #: The tokenizer class that reads its vocabulary back (a resumed run's, saved with the training state).
    tokenizer_class: ClassVar[type[PreTrainedTokenizerFast]]

    def __repr__(self) -> str:
        return f"<{self.name} objective>"

    def train_tokenizer(self, sentences: list[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
        """A vocabulary of at most ``vocab_size`` pieces trained on ``sentences``."""
        raise NotImplementedError

    def instances(self, documents: list[list[list[int]]], max_length: int, rng: np.random.Generator,
                  tokenizer: PreTrainedTokenizerFast) -> list[dict]:
        """The training or validation instances of ``documents`` (sentences in pieces), at most ``max_length`` pieces each."""
        raise NotImplementedError

    def collator(self, tokenizer: PreTrainedTokenizerFast, settings: PretrainSettings, seed: int) -> DataCollatorForLanguageModeling:
        """What pads a batch of instances (and masks it, where the objective :attr:`masks`), its generator seeded by ``seed``."""
        return DataCollatorForLanguageModeling(tokenizer, mlm=self.masks, mlm_probability=settings.mask_probability, seed=seed)

    def build_model(self, tokenizer: PreTrainedTokenizerFast, settings: PretrainSettings) -> torch.nn.Module:
        """A randomly initialised model of the settings' size (drawn from torch's generator) for ``tokenizer``'s vocabulary."""
        raise NotImplementedError

    def scored_labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pieces the objective's loss scores in ``batch``."""
        raise NotImplementedError

    def training_losses(self, network: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The training losses of one batch (:attr:`step_losses`); their sum is minimised."""
        raise NotImplementedError

    def validation_loss(self, network: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, int]]:
        """The LM loss of one validation batch (a mean over its scored pieces) and the counts its other scores tally."""
        raise NotImplementedError

    def validation_scores(self, loss: float, tallies: Counter) -> dict[str, float]:
        """The :attr:`scores` of a validation pass: its LM loss and what the batches' counts ``tallies`` give."""
        raise NotImplementedError

    def evaluate(self, network: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """The validation scores on fixed (already masked) batches: the LM loss, a mean over the scored pieces
        (:meth:`scored_labels`), and what :meth:`validation_scores` adds."""
        network.eval()
        total, count, tallies = 0.0, 0, Counter()
        with torch.inference_mode():
            for batch in batches:
                scored = len(self.scored_labels(batch))
                loss, counts = self.validation_loss(network, batch)
                tallies.update(counts)
                if scored:  # a batch with no scored piece (a lone run of one piece) adds nothing: its mean is NaN
                    total += float(loss) * scored
                    count += scored
        network.train()
        return self.validation_scores(total / max(count, 1), tallies)

    def recorded_settings(self, settings: dict) -> dict:
        """``settings`` (:class:`PretrainSettings` as a dict) as the summary records them: but the :attr:`unused_settings`, and
        the synthetic task's where the run reads a corpus."""
        unused = (*self.unused_settings, *(SYNTHETIC_SETTINGS if settings["synthetic"] is None else ()))
        return {key: value for key, value in settings.items() if key not in unused}

    def architecture_of(self, settings: PretrainSettings) -> str:
        """The model's architecture, as the summary names it."""
        return self.architecture

    def score_words(self, summary: dict) -> str:
        """The final validation scores of ``summary`` (``pretraining.json``) against the unigram baseline, as the command line says them."""
        raise NotImplementedError

    def report_words(self, summary: dict) -> tuple[str, str]:
        """The report's words on the model and its loss (its intro), and on the final validation scores of ``summary``."""
        raise NotImplementedError


class MaskedLM(Objective):
    """BERT's recipe (Devlin et al. 2019), scaled down:

    - vocabulary: WordPiece trained on the training text with HF ``tokenizers`` (lower-cased);
    - instances: ``[CLS] A [SEP] B [SEP]``, where A and B are runs of whole sentences filling
      ``max_length``; half of the time B is the text that follows A (next-sentence label 0), half of
      the time a run from another document (label 1), so that [SEP] separates two segments the model
      must relate. The pairing is redrawn every epoch;
    - masked-LM: 15% of the non-special pieces are chosen, of those 80% become [MASK], 10% a random
      piece and 10% stay (transformers' ``DataCollatorForLanguageModeling``). The output projection is
      applied only at the chosen positions: the same loss for about a seventh of its cost;
    - loss = masked-LM cross-entropy + next-sentence cross-entropy; the pieces scored are the masked ones.
    """

    name = "masked-lm"
    architecture = "BERT"
    loss = "masked-LM cross-entropy + next-sentence cross-entropy (Devlin et al. 2019)"
    loss_name = "masked-LM loss"
    step_losses = ("mlm_loss", "nsp_loss")
    scores = ("mlm_loss", "nsp_accuracy")
    score_names = ("loss", "accuracy")
    masks = True
    predicts_next_sentence = True
    unused_settings = ("attention_only",)  # a decoder's (pretrain refuses it without --causal)
    special_tokens = SPECIAL_TOKENS
    tokenizer_class = BertTokenizerFast

    def train_tokenizer(self, sentences, vocab_size, max_length):
        return train_wordpiece(sentences, vocab_size, max_length)

    def instances(self, documents, max_length, rng, tokenizer):
        return make_instances(documents, max_length, rng, tokenizer.cls_token_id, tokenizer.sep_token_id)

    def build_model(self, tokenizer, settings):
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=settings.hidden, num_hidden_layers=settings.layers,
                            num_attention_heads=settings.heads, intermediate_size=settings.intermediate, max_position_embeddings=settings.max_length,
                            type_vocab_size=2, pad_token_id=tokenizer.pad_token_id)
        return BertForPreTraining(config)

    def scored_labels(self, batch):
        return batch["labels"][batch["labels"] != -100]

    def training_losses(self, network, batch):
        return pretraining_losses(network, batch)[:2]

    def validation_loss(self, network, batch):
        loss, _, next_logits = pretraining_losses(network, batch)
        return loss, {"correct": int((next_logits.argmax(-1) == batch["next_sentence_label"]).sum()), "pairs": len(next_logits)}

    def validation_scores(self, loss, tallies):
        return {"mlm_loss": loss, "nsp_accuracy": tallies["correct"] / max(tallies["pairs"], 1)}

    def score_words(self, summary):
        return (f"validation masked-LM loss {summary['val_mlm_loss']:.3f} (unigram baseline {summary['unigram_cross_entropy']:.3f}), "
                f"next-sentence accuracy {summary['val_nsp_accuracy']:.3f}")

    def report_words(self, summary):
        return (f"A BERT trained from scratch with the {summary['loss']}. ",
                f"Final validation masked-LM loss {summary['val_mlm_loss']:.3f} nats against {summary['unigram_cross_entropy']:.3f} for unigram "
                f"guessing; next-sentence accuracy {summary['val_nsp_accuracy']:.3f} (chance 0.5).")


class CausalLM(Objective):
    """GPT-2's recipe (Radford et al. 2019), scaled down, on the same sentences and the same validation text as the masked LM,
    so that ``track`` can follow the attention sink's emergence (Gu et al. 2025, docs/methods.md#decoders):

    - vocabulary: byte-level BPE trained on the training text with HF ``tokenizers`` (cased, no unknown piece); the
      tokenizer adds nothing around a text: no [CLS] or [SEP], and no BOS, so that the first piece is the first token, as GPT-2's;
    - instances: runs of whole sentences of one document, at most ``max_length`` pieces each, so that every run starts
      at a sentence (as ``track`` reads a corpus); nothing is masked (``mask_probability`` plays no part);
    - loss = the causal LM loss, the next-token cross-entropy ``-mean_t ln p(x_{t+1} | x_{<=t})`` over every piece but
      the first of each run, the pieces scored.
    """

    name = "causal-lm"
    architecture = "GPT-2"
    loss = "causal LM loss: next-token cross-entropy (Radford et al. 2019)"
    loss_name = "causal LM loss"
    step_losses = ("lm_loss",)
    scores = ("lm_loss",)
    score_names = ("loss",)
    masks = False
    predicts_next_sentence = False
    unused_settings = ("mask_probability",)  # a causal run masks nothing
    special_tokens = BPE_SPECIAL_TOKENS
    tokenizer_class = PreTrainedTokenizerFast

    def train_tokenizer(self, sentences, vocab_size, max_length):
        return train_byte_level_bpe(sentences, vocab_size, max_length)

    def instances(self, documents, max_length, rng, tokenizer):
        return make_causal_instances(documents, max_length)

    def architecture_of(self, settings):
        return "Llama, attention-only (MLP blocks of size 0)" if settings.attention_only else self.architecture

    def build_model(self, tokenizer, settings):
        if settings.attention_only:
            return attention_only_decoder(tokenizer, settings)
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=settings.max_length, n_embd=settings.hidden, n_layer=settings.layers,
                            n_head=settings.heads, n_inner=settings.intermediate, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return GPT2LMHeadModel(config)

    def scored_labels(self, batch):
        labels = next_token_labels(batch)
        return labels[labels != -100]

    def training_losses(self, network, batch):
        return (causal_lm_loss(network, batch),)

    def validation_loss(self, network, batch):
        return causal_lm_loss(network, batch), {}

    def validation_scores(self, loss, tallies):
        return {"lm_loss": loss}

    def score_words(self, summary):
        return f"validation causal LM loss {summary['val_lm_loss']:.3f} (unigram baseline {summary['unigram_cross_entropy']:.3f})"

    def report_words(self, summary):
        settings = summary["settings"]
        model = ("An attention-only decoder (a Llama whose MLP blocks are of size 0, as Olsson et al. 2022's small models)"
                 if settings["attention_only"] else "A GPT-2-style decoder")
        text = ("a byte-level BPE vocabulary" if settings.get("synthetic") is None else
                f"sequences of {settings['vocab_size']} random symbols in which a segment of {settings['min_period']} to {settings['max_period']} "
                f"symbols repeats at a random offset ({settings['repeat_share']:.0%} of each sequence's symbols), made in memory, a word-level vocabulary")
        return (f"{model} trained from scratch with the {summary['loss']}, on {text} that adds no "
                "special token, so that each checkpoint's first token is the candidate attention sink (docs/methods.md#decoders). ",
                f"Final validation causal LM loss {summary['val_lm_loss']:.3f} nats against {summary['unigram_cross_entropy']:.3f} for unigram guessing.")


MASKED_LM: Objective = MaskedLM()
CAUSAL_LM: Objective = CausalLM()
#: Every objective by name.
OBJECTIVES: dict[str, Objective] = {objective.name: objective for objective in (MASKED_LM, CAUSAL_LM)}


def objective_named(name: str) -> Objective:
    """The objective a run's settings, its ``pretraining.json`` or the command line (``--causal``) names."""
    if name not in OBJECTIVES:
        raise BertologyError(f"unknown objective {name!r}: use {' or '.join(OBJECTIVES)}")
    return OBJECTIVES[name]
