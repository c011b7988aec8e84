"""What decides and checks a run before a process group exists: flags, the run's config, DeepSpeed's config, the
start-up checks and the memory estimate (all that `truneg preflight` needs)."""
