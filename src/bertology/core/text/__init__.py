"""Text: corpora read lazily and validated, their dependency parses, and the alignment of word pieces to words.

:mod:`.corpora` reads them (each reader yields :mod:`.examples`; gold trees from :mod:`.conllu`; the synthetic probe
corpus of :mod:`.synthetic`), :mod:`.parsing` parses plain text, :mod:`.alignment` aligns pieces to words.
"""
