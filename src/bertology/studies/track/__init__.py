"""``bertology track``: the profile, roles and syntactic heads over training checkpoints, and the verdict on the
learning-curve hypothesis (:func:`~bertology.studies.track.dynamics.track`)."""

from __future__ import annotations

from pathlib import Path

from bertology.core.errors import BertologyError
from bertology.core.options import CORPUS, MODEL, PASS_SETTINGS, RAY, RUN, TREES, Option, pick
from bertology.families import family_option
from bertology.studies import Study, default_out, register_study


class Track(Study):
    name = "track"
    libraries = ("bertology.studies.track.dynamics", "transformers.modeling_utils")
    title = ("Profile, roles and syntactic heads (a decoder's attention sinks too) over training checkpoints, and the verdict on the "
             "learning-curve hypothesis.")
    options = (
        Option("checkpoint", None, "Checkpoints in any order: model folders or hub names ('default': the bundled model).", type=str,
               argument=True, multiple=True, reads_files=True),
        Option("checkpoints", None, "A folder of checkpoints (e.g. a `bertology pretrain` run).", type=Path),
        Option("steps", None, "Training steps of the CKPT arguments, one each in the same order, e.g. 0,500,1000 [default: from each checkpoint].",
               type=str),
        CORPUS[0].but(help="Corpus file; CoNLL-U adds syntactic heads [default: the bundled sample corpus]."),
        *pick(CORPUS, "format", "synthetic_repeats", "synthetic_length"), *pick(TREES, "parser"),
        *pick(RUN, "out"), *pick(CORPUS, "batch_size", "max_length", "limit"),
        family_option("syntax", "bootstrap"), family_option("roles", "tau"), family_option("syntax", "min_dependents"), family_option("sinks", "sink_eps"),
        Option("induction_probe", 100, "On a decoder's checkpoints: sequences of the induction probe read beside the corpus, random whole-word "
                                       "pieces in which a segment repeats at a random period and offset (only content predicts it); the "
                                       "phase-change verdict reads its scores (METHODS.md section 15).", minimum=10),
        family_option("headtypes", "head_type_mass"),
        *pick(PASS_SETTINGS, "punct", "attention_budget"), *pick(RUN, "seed", "quiet"), *pick(MODEL, "device", "trust_remote_code", "dtype"), *RAY,
    )
    outputs = ("track", "track_layers", "peaks", "losses")
    optional_outputs = ("emergence", "induction", "in_context", "induction_probe")
    work = "parts"

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.core.model.models import DEFAULT_MODEL
        from bertology.studies.track.checkpoints import find_checkpoints, parse_steps
        from bertology.studies.track.dynamics import track

        s = settings
        if bool(s["checkpoint"]) == (s["checkpoints"] is not None):
            raise BertologyError("give checkpoints as arguments or --checkpoints DIR (one of the two)")
        if s["steps"] is not None and s["checkpoints"] is not None:
            raise BertologyError("--steps goes with checkpoints given as arguments (one step each, in the same order), not with --checkpoints DIR")
        series = find_checkpoints(s["checkpoints"]) if s["checkpoints"] is not None else [DEFAULT_MODEL if c == "default" else c for c in s["checkpoint"]]
        label = s["checkpoints"].name if s["checkpoints"] is not None else Path(series[-1]).name
        s["out"] = s["out"] or default_out(self.name, label, s["corpus"])
        return track(series, s["corpus"], format=s["format"], parser=s["parser"], out=s["out"], batch_size=s["batch_size"],
                     max_length=s["max_length"], limit=s["limit"], bootstrap=s["bootstrap"], tau=s["tau"], min_dependents=s["min_dependents"],
                     punct=s["punct"], seed=s["seed"], device=s["device"], trust_remote_code=s["trust_remote_code"], dtype=s["dtype"],
                     sink_eps=s["sink_eps"], attention_budget=s["attention_budget"], progress=not s["quiet"],
                     command=command, steps=parse_steps(s["steps"]) if s["steps"] is not None else None, backend=s["backend"],
                     workers=s["workers"], address=s["address"], synthetic_repeats=s["synthetic_repeats"],
                     synthetic_length=s["synthetic_length"], induction_probe=s["induction_probe"], head_type_mass=s["head_type_mass"])

    def summary(self, result, settings: dict) -> list[str]:
        lines = [f"{claim}: {result.verdict[claim]['verdict']}: {result.verdict[claim]['statement']}" for claim in ("depth", "training")]
        if "sinks" in result.verdict:  # a decoder's series
            lines.append(f"attention sinks: {result.verdict['sinks']['statement']}")
        if "induction" in result.verdict:  # a decoder's series
            lines.append(f"induction heads' phase change: {result.verdict['induction']['verdict']}: {result.verdict['induction']['statement']}")
        if "losses" in result.verdict:
            lines.append(f"loss: {result.verdict['losses']['statement']}")
        return [*lines, f"report: {(Path(settings['out']) / 'report.html').resolve()}"]


register_study(Track())
