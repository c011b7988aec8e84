"""Data: corpus reading, preparation into blocks, the memory-mapped blocks, masking."""
