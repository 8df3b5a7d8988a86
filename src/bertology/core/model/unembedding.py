"""A model's unembedding ``W_U``, which turns its last hidden state into logits, found wherever it is.

In order: the language-model head loaded with the model; the input embeddings where the model ties the two (GPT-2's,
BERT's); or, where a bare model (``AutoModel``, as ``analyze`` loads it) has a head of its own that was not loaded (an
untied Llama's or Mistral's ``lm_head``), that one weight read from the checkpoint's safetensors files: no second model
is loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bertology.core.model.kinds import DECODER

NO_UNEMBEDDING = ("the model has no unembedding (no language-model head is loaded or in its checkpoint, and its input embeddings are "
                  "not tied to one)")


def unembedding(loaded) -> tuple[torch.Tensor | None, str | None]:
    """``(W_U, None)`` as transformers stores it, ``[vocab, hidden]``, or ``(None, reason)`` (:data:`NO_UNEMBEDDING`) for a
    :class:`~bertology.core.model.models.LoadedModel`."""
    model = loaded.model
    head = model.get_output_embeddings()
    if head is not None:
        return head.weight, None
    if getattr(model.config, "tie_word_embeddings", False):
        return model.get_input_embeddings().weight, None
    key, folder = output_embeddings_key(model.config, loaded.kind), checkpoint_folder(loaded)
    weight = checkpoint_tensor(folder, key) if key is not None and folder is not None else None
    return (weight, None) if weight is not None else (None, NO_UNEMBEDDING)


def output_embeddings_key(config, kind) -> str | None:
    """The checkpoint key of the language-model head's weight of ``config``'s causal LM (a decoder) or masked LM (an encoder),
    as transformers names it (``lm_head.weight``, GPT-NeoX's ``embed_out.weight``): the class built on the meta device, no
    memory; None where transformers has no such class for the config."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto = AutoModelForCausalLM if kind is DECODER else AutoModelForMaskedLM
    try:
        with torch.device("meta"):
            language_model = auto.from_config(config)
    except ValueError:  # "Unrecognized configuration class": no language model of this kind
        return None
    head = language_model.get_output_embeddings()
    return next((f"{name}.weight" for name, module in language_model.named_modules() if module is head), None)


def checkpoint_folder(loaded) -> Path | None:
    """The folder of ``loaded``'s weights: the one it was loaded from, or a hub model's snapshot in the local cache (where
    ``load_model`` put it); None for a model built in memory."""
    if loaded.source is not None:
        return Path(loaded.source)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(loaded.name, local_files_only=True, allow_patterns=["*.safetensors"]))
    except (HFValidationError, LocalEntryNotFoundError):
        return None


def checkpoint_tensor(folder: Path, key: str) -> torch.Tensor | None:
    """The tensor stored under ``key`` in one of ``folder``'s safetensors files (a sharded checkpoint's too), read alone; None
    where none holds it."""
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            if key in weights.keys():
                return weights.get_tensor(key)
    return None
