"""Model FLOPs of a training step, and the devices' dense peaks: the one formula behind `tflops` and `mfu`
(metrics.jsonl), bench/lib/gpu_step.py, bench/gpu_mfu.py and bench/loader_rate.py.

What counts: every matrix product of the forward, at 2 FLOPs a multiply-add, as DeepSpeed's flops profiler and
the PaLM / Megatron MFU convention count them; a training step is 3 forwards (the backward costs 2). What does
not: the elementwise ops (LayerNorm, GELU, softmax, dropout, the losses), the embedding lookups, HC's lookup, SR's
cosine or KL and the optimizer (together under 0.4 % of the profiler's count for the tiny presets, less for the
larger ones; how close tests/train/test_efficiency.py holds the formula to the profiler: docs/pretraining.md).

The pre-trainers as they run:
- BERT: the encoder over all positions, and the MLM head (its transform and the decoder over the vocabulary)
  only at the `max_predictions` gathered positions of each sequence, padding slots included.
- ELECTRA: the generator and the discriminator each, with their embedding projections where the embedding is
  narrower than the encoder; the generator's head at the gathered positions, the discriminator's at every one.
- `--train-only head`: the frozen encoder runs its forward alone (nothing needs its gradients); the head's backward
  takes the transform's weight gradient (not its input's) and the decoder's input gradient (and its weight gradient
  when untied): 2 forwards' worth each, 3 for an untied decoder.
- SR_Sent's extra encoder passes count as model FLOPs: they are forwards of the encoder being trained, and their
  gradients flow back through it (bert-base at seq 128: 1.96x the baseline's FLOPs at the default target, 2.92x
  with `--sr-sent-target original`; electra-base 1.86x, its one discriminator pass). An SR_Sent run's MFU is then
  comparable with a baseline's, while its samples/s is not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import BertConfig, ElectraConfig

from truneg.data.masking import default_max_predictions
from truneg.model.head import is_untied
from truneg.model.presets import BERT_PRESETS, ELECTRA_PRESETS, check_preset, common_config, is_electra

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from truneg.model.pretrainers import BertPretrainer, ElectraPretrainer

TRAINING_FACTOR = 3  # forward + backward (2x the forward: the gradients of the activations and of the weights)


@dataclass(frozen=True)
class EncoderSize:
    """What an HF BERT / ELECTRA config says of the encoder's FLOPs."""

    hidden: int
    layers: int
    intermediate: int
    embedding: int  # ELECTRA's factorised embedding width; BERT's is its hidden size
    vocab: int

    @classmethod
    def of(cls, config: PretrainedConfig) -> EncoderSize:
        return cls(config.hidden_size, config.num_hidden_layers, config.intermediate_size,
                   getattr(config, "embedding_size", config.hidden_size), config.vocab_size)


def attention_flops(seq_len: int, width: int) -> float:
    """One layer's attention products over one sequence, all heads (`width` = heads x head size): Q K^T and the
    weights times V, each seq_len x seq_len x width multiply-adds."""
    return 2 * 2 * seq_len * seq_len * width


def encoder_flops(size: EncoderSize, seq_len: int) -> float:
    """One encoder forward over one sequence: the embedding projection (ELECTRA, where the embedding is narrower),
    then per layer Q, K, V and the output projection (4 h^2 per token), the FFN (2 h f) and attention."""
    h, f = size.hidden, size.intermediate
    projection = 2 * size.embedding * h if size.embedding != h else 0
    per_layer = 2 * seq_len * (4 * h * h + 2 * h * f) + attention_flops(seq_len, h)
    return seq_len * projection + size.layers * per_layer


def bert_head_flops(size: EncoderSize, predictions: int) -> float:
    """BERT's MLM head at the gathered positions: its transform (h x h) and the decoder (h x vocab)."""
    return 2 * predictions * (size.hidden * size.hidden + size.hidden * size.vocab)


def generator_head_flops(size: EncoderSize, predictions: int) -> float:
    """ELECTRA's generator head at the gathered positions: hidden -> embedding, then the tied embedding x vocab."""
    return 2 * predictions * (size.hidden * size.embedding + size.embedding * size.vocab)


def discriminator_head_flops(size: EncoderSize, seq_len: int) -> float:
    """ELECTRA's discriminator head at every position: its dense layer (h x h) and the one-logit output."""
    return 2 * seq_len * (size.hidden * size.hidden + size.hidden)


def forward_flops(sizes: dict[str, EncoderSize], seq_len: int, max_predictions: int, sr: str = "none",
                  sr_sent_target: str = "masked") -> float:
    """One forward of the pre-trainer over one sequence. `sizes`: {"bert": ...} or {"generator": ...,
    "discriminator": ...}."""
    if "bert" in sizes:
        bert = sizes["bert"]
        passes = 1 + (sr == "sent") * (2 if sr_sent_target == "original" else 1)
        return passes * encoder_flops(bert, seq_len) + bert_head_flops(bert, max_predictions)
    generator, discriminator = sizes["generator"], sizes["discriminator"]
    disc_passes = 2 if sr == "sent" else 1  # SR_Sent: the discriminator encodes the original too
    return (encoder_flops(generator, seq_len) + generator_head_flops(generator, max_predictions)
            + disc_passes * encoder_flops(discriminator, seq_len) + discriminator_head_flops(discriminator, seq_len))


def train_flops(sizes: dict[str, EncoderSize], seq_len: int, max_predictions: int, sr: str = "none",
                sr_sent_target: str = "masked", head_only: bool = False, untied: bool = False) -> float:
    """FLOPs of one training sample: forward and backward (`head_only`: the frozen encoder's forward, and the head's
    forward and the backward it needs; `untied`: its decoder is trained)."""
    if head_only:
        bert = sizes["bert"]
        transform = 2 * max_predictions * bert.hidden * bert.hidden
        decoder = 2 * max_predictions * bert.hidden * bert.vocab
        return encoder_flops(bert, seq_len) + 2 * transform + (3 if untied else 2) * decoder
    return TRAINING_FACTOR * forward_flops(sizes, seq_len, max_predictions, sr, sr_sent_target)


def model_sizes(model: BertPretrainer | ElectraPretrainer) -> dict[str, EncoderSize]:
    """The encoders of a built pre-trainer (whatever its checkpoint: a continued one has its own vocab)."""
    if model.scheme == "bert":
        return {"bert": EncoderSize.of(model.mlm.config)}
    return {"generator": EncoderSize.of(model.generator.config),
            "discriminator": EncoderSize.of(model.discriminator.config)}


def model_train_flops(model: BertPretrainer | ElectraPretrainer, seq_len: int, max_predictions: int) -> float:
    """FLOPs of one training sample of this pre-trainer, with its own objective (SR_Sent's passes)."""
    objective = model.objective
    head_only = getattr(model, "encoder_frozen", False)
    return train_flops(model_sizes(model), seq_len, max_predictions, objective.sr, objective.sr_sent_target,
                       head_only=head_only, untied=head_only and is_untied(model.mlm))


def preset_sizes(preset: str) -> dict[str, EncoderSize]:
    """A preset's encoders, from its configs alone (no weights are built)."""
    check_preset(preset)
    if not is_electra(preset):
        return {"bert": EncoderSize.of(BertConfig(**common_config(), **BERT_PRESETS[preset]))}
    disc, gen = ELECTRA_PRESETS[preset]
    return {"generator": EncoderSize.of(ElectraConfig(**common_config(), **gen)),
            "discriminator": EncoderSize.of(ElectraConfig(**common_config(), **disc))}


def preset_train_flops(preset: str, seq_len: int, max_predictions: int | None = None, sr: str = "none",
                       sr_sent_target: str = "masked") -> float:
    """FLOPs of one training sample of a preset (`max_predictions` None: the run's default for `seq_len`)."""
    predictions = max_predictions or default_max_predictions(seq_len)
    return train_flops(preset_sizes(preset), seq_len, predictions, sr, sr_sent_target)


# Dense (no sparsity) tensor-core peaks in TFLOP/s, by the device name torch reports and the run's precision, from
# NVIDIA's datasheets. Matched on the whole name: an H100 SXM (989) and its PCIe card (756) differ, and a card
# not listed (an H100 NVL, an L40S) has no peak rather than a neighbour's. fp32 is never listed: an fp32 run's MFU
# needs --peak-tflops (which of FP32 and TF32 is the peak depends on the matmul precision set).
DENSE_PEAK_TFLOPS: list[tuple[re.Pattern, dict[str, float]]] = [
    (re.compile(r"H100 (80GB HBM3|SXM5?)\b.*"), {"bf16": 989.0, "fp16": 989.0}),  # SXM5 (reports "80GB HBM3")
    (re.compile(r"H100 PCIE\b.*"), {"bf16": 756.0, "fp16": 756.0}),
    (re.compile(r"H200( 141GB)?( HBM3E)?"), {"bf16": 989.0, "fp16": 989.0}),  # SXM
    (re.compile(r"GH200\b.*"), {"bf16": 989.0, "fp16": 989.0}),
    (re.compile(r"A100[- ](SXM4?-|PCIE-)?(40|80)GB( PCIE)?"), {"bf16": 312.0, "fp16": 312.0}),
    (re.compile(r"V100-SXM2-(16|32)GB"), {"fp16": 125.0}),  # no bf16 tensor cores
    (re.compile(r"V100-PCIE-(16|32)GB"), {"fp16": 112.0}),
    (re.compile(r"V100S-PCIE-32GB"), {"fp16": 130.0}),
]


def dense_peak_tflops(device_name: str, precision: str) -> float | None:
    """The device's dense peak for `precision` (bf16 | fp16 | fp32), or None where it is not known."""
    name = re.sub(r"^(NVIDIA|TESLA)\s+", "", device_name.strip().upper())
    for pattern, peaks in DENSE_PEAK_TFLOPS:
        if pattern.fullmatch(name):
            return peaks.get(precision)
    return None


def run_peak_tflops(device_name: str | None, precision: str, given: float | None) -> tuple[float | None, str | None]:
    """(the peak an MFU is measured against, a warning to print once). `device_name` None: the CPU, whose MFU
    needs `given` (--peak-tflops), as an fp32 run's does."""
    if given is not None:
        return given, None
    if device_name is None:
        return None, None
    peak = dense_peak_tflops(device_name, precision)
    if peak is None:
        what = "an fp32 run" if precision == "fp32" else f"{device_name} in {precision}"
        return None, (f"no dense peak known for {what}: metrics.jsonl has no mfu; pass --peak-tflops X (the "
                      "datasheet's dense TFLOP/s) for one")
    return peak, None
