"""Corpora read lazily and validated (:mod:`.corpora`), their parses (:mod:`.parsing`) and the alignment of word pieces to
words (:mod:`.alignment`)."""
