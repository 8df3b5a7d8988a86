"""The core: models and hook points, corpora, word alignment, the engine and its analyzer contract, statistics, the run folder."""
