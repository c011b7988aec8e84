"""Cluster plumbing: hostfiles, the env file DeepSpeed's runners read, and `truneg preflight`."""
