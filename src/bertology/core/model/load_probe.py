"""The two-token probe every loaded model passes: the pattern hook point fires in every layer, every map is finite.

Maps that are not finite from finite weights are told apart: a half-precision dtype's range (finite in float32) or a
value in config.json.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from bertology.core.errors import ModelError, one_line_error
from bertology.core.model.finite import dtype_advice
from bertology.core.model.hooks import Hooks


def require_hook_point(model: PreTrainedModel, source: str) -> None:
    """Refuse, in one line, a model whose attention maps bertology cannot read, or whose maps are not finite.

    The first: layers that compute attention in their own code instead of through transformers' attention interface
    (GPT-Neo does), so bertology's hook points would never fire. The second, with finite weights: in half precision,
    where the same probe in float32 is finite, the dtype's range (:func:`~bertology.core.model.finite.dtype_advice`),
    else a config value such as a negative norm epsilon. Checked with one forward pass of two tokens.
    """
    fired, finite = _two_token_probe(model, source)
    if not fired:
        raise ModelError(f"{source}: {bypasses_interface(model.config.model_type)}")
    if not all(finite):
        raise ModelError(f"{source}: layer {fired[finite.index(False)]}'s attention maps are NaN or infinite on two tokens in "
                         f"{str(model.dtype).removeprefix('torch.')} though every weight is finite; {_non_finite_cause(model, source)}")


def _two_token_probe(model: PreTrainedModel, source: str) -> tuple[list[int], list[bool]]:
    """The layers whose pattern hook point fired on one forward pass of two tokens, and whether each one's maps were finite."""
    fired, finite = [], []

    def seen(layer: int, pattern: torch.Tensor) -> None:  # returns nothing: the pattern is read, not replaced
        fired.append(layer)
        finite.append(bool(torch.isfinite(pattern).all()))

    hooks = Hooks().add("pattern", seen)
    with torch.inference_mode(), hooks.attach(model):
        ids = torch.ones((1, 2), dtype=torch.long, device=model.device)
        try:
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        except Exception as exc:  # noqa: BLE001 - a config value the model's code cannot run with (a field of the wrong type)
            raise ModelError(f"{source}: the model fails on two tokens ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}); "
                             "is its config.json whole?") from exc
    return fired, finite


def _non_finite_cause(model: PreTrainedModel, source: str) -> str:
    """Why finite weights gave maps that are not: a half-precision dtype where the same probe in float32 gives finite maps
    (the model is cast in place: it is refused either way), else a value in config.json."""
    broken = "a value in config.json (a norm's epsilon, a scale) breaks the model"
    dtype = model.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        return broken
    try:
        finite_in_float32 = all(_two_token_probe(model.float(), source)[1])
    except RuntimeError as exc:  # out of memory, or layers that accelerate offloaded
        return f"the same probe in float32 could not run ({one_line_error(exc)}): {dtype_advice(dtype)}, or {broken}"
    return f"in float32 they are finite: {dtype_advice(dtype)}" if finite_in_float32 else f"they are in float32 too: {broken}"


def bypasses_interface(model_type: str) -> str:
    return (f"a {model_type} model computes attention in its own code, not through transformers' attention interface, so bertology "
            "cannot read its attention maps")
