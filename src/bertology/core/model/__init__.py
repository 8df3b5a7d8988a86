"""The model: loading and checking it, where its attention parts are, its kind, its hook points and interventions.

:mod:`.models` loads it whole and :mod:`.load_probe` checks it; :mod:`.layouts` says where each architecture keeps its
attention parts, :mod:`.kinds` what differs between an encoder and a decoder; :mod:`.hooks` names the hook points on its
attention, through which :mod:`.interventions` and :mod:`.head_outputs` ablate, restore and patch heads and layers;
:mod:`.memory` sizes the attention budget, :mod:`.finite` refuses non-finite maps, :mod:`.unembedding` finds ``W_U``.
"""
