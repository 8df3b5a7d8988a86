"""The core: the model, text, statistics, storage and training, and the one pass over a corpus with its backends.

Its rooms: the model (loading it whole, its layout, its kind, hook points and interventions: :mod:`.model`), what a
block computes beyond the weights (norms, mixing ratios, contributions: :mod:`.measures`), text (corpora, parses, word
alignment: :mod:`.text`), statistics (:mod:`.statistics`), what lasts between runs (run folders, states, safe loading,
digests: :mod:`.storage`) and training (:mod:`.learning`); above them the one pass (:mod:`.engine`), the analyzer
interface (:mod:`.analyzer`), the paired pass (:mod:`.paired`) and the backends (:mod:`.backends`). The layering is a
tested contract (pyproject.toml's import-linter contracts, tests/test_layout.py).
"""
