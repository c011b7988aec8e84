"""Training: the run and DeepSpeed configs, start-up checks, build, the loop, checkpoints, export."""
