"""The core, in rooms: the model (loading it whole, its layout, its kind, hook points and interventions: :mod:`.model`), what
a block computes beyond the weights (norms, mixing ratios, contributions: :mod:`.measures`), text (corpora, parses, word
alignment: :mod:`.text`), statistics (:mod:`.statistics`), what lasts between runs (run folders, states, safe loading,
digests: :mod:`.storage`) and training (:mod:`.learning`); above them the one pass (:mod:`.engine`), the analyzer contract
(:mod:`.analyzer`, :mod:`.testing`), the paired pass (:mod:`.paired`) and the backends (:mod:`.backends`). The layering is
a tested contract (pyproject.toml's import-linter contracts, tests/test_layout.py)."""
