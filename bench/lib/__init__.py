"""What the bench scripts import and nobody runs: gpu_runs (truneg's entry point run in-process, the GPU check's
and dry run's settings), gpu_step (the GPU check's stages 3 and 4) and masked_batch (a masked batch of real text)."""
