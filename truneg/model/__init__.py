"""Models: the presets, the BERT and ELECTRA pre-trainers and the paper's objectives."""
