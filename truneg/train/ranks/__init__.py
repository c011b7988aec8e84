"""The process group and its faults: start-up and shutdown, the step watchdog (hangs), diverged replicas."""
