"""Statistics done in float64 over sequences: running moments, intervals, tests against the uniform reference and their
corrections (:mod:`.stats`)."""
