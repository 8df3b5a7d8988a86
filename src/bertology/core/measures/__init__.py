"""What a layer's attention block computes beyond the weights: norms, mixing ratios and token-to-token contributions.

Kobayashi et al.'s norms and mixing ratios (:mod:`.norms`), the contributions of ALTI and value zeroing
(:mod:`.contributions`), and the ``x ln x`` of every entropy (:mod:`.entropy`).
"""
