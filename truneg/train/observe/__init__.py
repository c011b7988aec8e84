"""What a run reports: FLOPs and MFU, efficiency figures, the metrics logger and its records, the profiler."""
