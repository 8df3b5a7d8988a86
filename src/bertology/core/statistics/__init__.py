"""Statistics in float64 over sequences: moments, intervals, tests against the uniform reference and their corrections."""
