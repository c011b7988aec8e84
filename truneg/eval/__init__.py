"""Evaluation: false-negative statistics, GLUE, SQuAD, robustness and the ablation."""
