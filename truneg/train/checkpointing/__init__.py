"""Checkpoints: save, load and resume, the integrity manifest, the run's output folder, export to HF."""
