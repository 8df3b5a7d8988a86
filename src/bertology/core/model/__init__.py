"""The model: loading it whole (:mod:`.models`), where each architecture keeps its attention parts (:mod:`.layouts`), the kind
of model it is (:mod:`.kinds`), the named hook points on its attention (:mod:`.hooks`) and the interventions that ablate or
restore its heads and layers (:mod:`.interventions`)."""
