"""truneg: pre-training BERT and ELECTRA on true negatives, on DeepSpeed."""

__version__ = "0.1.0"
