"""What a run saw (:class:`RunStats`): sequences, tokens, truncations and skips, failed analyzers, its wall time."""

from __future__ import annotations

from dataclasses import dataclass, field

from bertology.core.errors import BertologyError
from bertology.core.text.corpora import Example

MAX_SKIPPED_SOURCES = 100  # the manifest lists the first skipped sequences; the count is exact
#: The fewest pieces a sequence needs to be analysed: with 0 or 1 there is no attention between tokens (one weight of 1, and a
#: decoder's only row is left out of every mean over queries). Shorter sequences are skipped and counted (``RunStats.degenerate``).
MIN_PIECES = 2


@dataclass
class RunStats:
    """What a run saw: sequence and token counts, truncations and skips, and its wall time."""

    sequences: int = 0
    tokens: int = 0
    truncated: int = 0
    skipped: int = 0  # longer than max_length, with overflow="skip"
    degenerate: int = 0  # fewer than MIN_PIECES pieces
    batches: int = 0
    seconds: float = 0.0
    skipped_sources: list[str] = field(default_factory=list)
    #: Analyzers whose ``update`` raised (``isolate=True``): position in the run's analyzers -> the error, one line.
    failed: dict[int, str] = field(default_factory=dict)
    #: Analyzers left out of the pass past the attention budget (they read whole maps, or hold more than it; ``isolate=True``):
    #: position -> the one line that says why. Not a failure: the budget is a setting of the run.
    left_out: dict[int, str] = field(default_factory=dict)

    def add(self, other: "RunStats") -> "RunStats":
        """Fold in the counts of another part of the corpus (a shard); ``seconds`` is left to the caller (wall time)."""
        self.sequences += other.sequences
        self.tokens += other.tokens
        self.truncated += other.truncated
        self.skipped += other.skipped
        self.degenerate += other.degenerate
        self.batches += other.batches
        self.skipped_sources = (self.skipped_sources + other.skipped_sources)[:MAX_SKIPPED_SOURCES]
        for position, message in other.failed.items():
            self.failed.setdefault(position, message)
        for position, message in other.left_out.items():
            self.left_out.setdefault(position, message)
        return self

    @property
    def dropped(self) -> set[int]:
        """The analyzers out of the pass: failed or left out."""
        return set(self.failed) | set(self.left_out)

    @property
    def seen(self) -> int:
        """The examples read so far: analysed, or skipped as too long or degenerate."""
        return self.sequences + self.skipped + self.degenerate

    def leave_out(self, index: int, example: Example) -> None:
        """Note a skipped example among the first :data:`MAX_SKIPPED_SOURCES` (its source, or its place in the corpus from 1)."""
        if len(self.skipped_sources) < MAX_SKIPPED_SOURCES:
            self.skipped_sources.append(example.source or f"example {index + 1}")

    def check_counted(self, max_length: int) -> None:
        """Refuse, in one line that names the first example skipped, a pass that analysed no sequence."""
        if self.sequences:
            return
        reasons = [f"{count} {why}" for count, why in ((self.skipped, f"longer than {max_length} pieces"),
                                                      (self.degenerate, f"of fewer than {MIN_PIECES} pieces")) if count]
        if not reasons:
            raise BertologyError("no sequence to analyse: the input has none")
        first = f" (the first: {self.skipped_sources[0]})" if self.skipped_sources else ""
        advice = "; raise --max-length or truncate" if self.skipped else ""
        raise BertologyError(f"no sequence to analyse: every one was skipped, {' and '.join(reasons)}{first}{advice}")

    def as_dict(self) -> dict:
        return {
            "sequences": self.sequences,
            "tokens": self.tokens,
            "truncated": self.truncated,
            "skipped": self.skipped,
            "degenerate": self.degenerate,
            "batches": self.batches,
            "seconds": round(self.seconds, 3),
            "sequences_per_second": round(self.sequences / self.seconds, 2) if self.seconds else None,
        }

