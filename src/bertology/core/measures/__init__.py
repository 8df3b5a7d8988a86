"""What a layer's attention block computes beyond the weights: Kobayashi et al.'s norms and mixing ratios (:mod:`.norms`) and the
token-to-token contributions of ALTI and value zeroing (:mod:`.contributions`), and the ``x ln x`` of every entropy
(:mod:`.entropy`)."""
