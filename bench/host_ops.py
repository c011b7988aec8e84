"""A CPU proxy of the host's work in one GPU step: the operations the host issues per sample in one optimizer step
of the shipped BERT-large and ELECTRA-base bf16 recipes, today's eager step beside the new one (`--compile layers`,
and DeepSpeed's bf16 gradient accumulation in multi-tensor ops: truneg.train.fused_grads).

    OMP_NUM_THREADS=1 python bench/host_ops.py

What counts as one operation: in eager code, an ATen op dispatched (a TorchDispatchMode counts them: what the
dispatcher hands a backend after autograd and the composite ops' decompositions; a multi-tensor op over tensors
of two dtypes counts one a tensor, as a GPU runs it); in a compiled region, each
kernel Inductor generated and each op its wrapper calls (an extern matmul, an allocation, a gradient's add:
torch.profiler's events, `cpp_fused_*` kernels and the ATen ops that no other ATen op called). CPU inductor
kernels are not GPU launches one for one: on the CPU Inductor writes attention out of matmuls and its own
softmax kernel, where on a GPU it calls SDPA's flash kernel, and it may fuse differently.

Each step is truneg's own (`truneg.pretrain.main` in this process, 1 rank, the shipped bf16 ZeRO-1 config, torch
AdamW with `foreach` in place of FusedAdam, a CUDA op: both issue a few multi-tensor ops for all parameters), at the
recipes' depth, heads and parameter tensors but 32-96 wide (4-8 per head), seq 128, HC + SR. A dispatch
mode cannot watch a compiled region (dynamo falls back to eager under it), so the new step is the count of the
step with the multi-tensor accumulation, each compiled part's eager operations (counted alone, on the inputs it
had in the step) replaced by its compiled region's (profiled alone, on the same inputs, Inductor on this CPU), times
its calls in the step.

The host's work does not grow with the micro-batch (the count at micro 2 and 4 is printed: the same), so the step is
counted at micro 2 with 4 and with 1 micro-steps: per micro-step M and per optimizer step S, and per sample at a
micro-batch m and accumulation a, (a x M + S) / (m x a). X and Y: today's recipes' micro-batch (BERT-large 64,
ELECTRA-base 32) x 4 (as the H200 measured them), today against new; Z: BERT-large today at 64 x 4 against the
new step at the new recipe's 256 x 1 (the same 256 samples a step). Each ratio is today's count over the new one.
Last line: `RESULT bert_large_ops_per_sample_vs_today=X bert_large_recipe_ops_per_sample_vs_today=Z
electra_base_ops_per_sample_vs_today=Y`.
"""
from __future__ import annotations

import collections
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.gpu_runs import CORPUS, DS_CONFIGS, patched, run_pretrain  # noqa: E402
from truneg.data.masking import default_max_predictions  # noqa: E402
from truneg.model import pretrainers as models  # noqa: E402
from truneg.model.compile import compiled_parts  # noqa: E402
from truneg.train import build, loop  # noqa: E402
from truneg.train.config.memory import micro_for_memory  # noqa: E402

SEQ, MICRO, STEPS = 128, 2, 3  # the last step is counted
# Same depth, heads and parameter tensors as the real presets; 4-8 wide per head.
NARROW_BERT = {"bert-large": dict(hidden_size=64, num_hidden_layers=24, num_attention_heads=16, intermediate_size=256)}
NARROW_ELECTRA = {"electra-base": (
    dict(embedding_size=96, hidden_size=96, num_hidden_layers=12, num_attention_heads=12, intermediate_size=384),
    dict(embedding_size=96, hidden_size=32, num_hidden_layers=12, num_attention_heads=4, intermediate_size=128),
)}
CONFIGS = {"bert-large": "bert_large_a100_bf16_zero1.json", "electra-base": "electra_base_a100_bf16_zero1.json"}
TODAY = {"bert-large": (64, 4), "electra-base": (32, 4)}  # (micro-batch, accumulation) of the H200's figures
# the new recipe: the micro-batch an H200 (141 GiB) takes by memory (truneg.train.config.memory), the same 256
# samples a step
NEW_RECIPE = {"bert-large": (micro_for_memory(141, "bert-large", "bf16", SEQ, default_max_predictions(SEQ))[0], 1)}


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__] += foreach_width(func.__name__, args)
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def foreach_width(name: str, args: tuple) -> int:
    """1, or a mixed-dtype multi-tensor op's number of tensors: on a GPU torch runs those one kernel a tensor
    (its per-tensor path; same-dtype lists take one kernel a chunk)."""
    if name.startswith("_foreach_") and len(args) > 1 and isinstance(args[1], (list, tuple)) and args[1] \
            and isinstance(args[1][0], torch.Tensor) and args[0][0].dtype != args[1][0].dtype:
        return len(args[0])
    return 1


def profiled_ops(run) -> tuple[int, int]:
    """(kernels, other ops) torch.profiler saw in `run()`: Inductor's `cpp_fused_*` kernels, and the ATen ops
    that no other ATen op called (what the compiled wrapper and autograd's engine call; their insides not)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    kernels = ops = 0
    for event in prof.events():
        if "cpp_fused" in event.name:
            kernels += 1
        elif event.name.startswith("aten::"):
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            ops += parent is None
    return kernels, ops


def _grad_inputs(value):
    if isinstance(value, torch.Tensor):
        value = value.detach().clone()
        return value.requires_grad_(True) if value.is_floating_point() else value
    return value


def part_ops(part: torch.nn.Module, args: tuple, kwargs: dict, compiled: bool) -> int:
    """One forward and backward of `part` alone on a step's inputs: ATen ops dispatched (eager), or kernels and
    the ops around them (compiled)."""
    forward = torch.compile(part.forward, fullgraph=True, dynamic=False) if compiled else part.forward

    def once(count) -> int:
        part.zero_grad(set_to_none=True)
        inputs = tree_map(_grad_inputs, (args, kwargs))
        outputs, n = count(lambda: forward(*inputs[0], **inputs[1]))
        leaves = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = [torch.ones_like(t) for t in leaves]
        return n + count(lambda: torch.autograd.backward(leaves, grads))[1]

    def eager_count(fn):
        with OpCounter() as counter:
            result = fn()
        return result, counter.total

    def compiled_count(fn):
        box = []
        kernels, ops = profiled_ops(lambda: box.append(fn()))
        return box[0], kernels + ops

    if not compiled:
        return once(eager_count)
    for _ in range(2):  # compile, then a warm call
        once(lambda fn: (fn(), 0))
    return once(compiled_count)


def count_step(preset: str, accum: int, micro: int, work: Path, fused: bool, parts_too: bool = False) -> dict:
    """truneg's optimizer step (the last of STEPS) counted under OpCounter, with DeepSpeed's bf16 accumulation as it
    was (`fused` False: its per-parameter loop) or in multi-tensor ops (truneg.train.fused_grads); with `parts_too`,
    each compiled part's calls in it and its ops alone, eager and compiled (a fresh model of the same sizes)."""
    config = json.loads((DS_CONFIGS / CONFIGS[preset]).read_text())
    config["optimizer"]["params"].update(torch_adam=True, foreach=True)  # FusedAdam is a CUDA op
    path = work / f"{preset}.json"
    path.write_text(json.dumps(config))
    result: dict = {}
    real_step = loop.train_step

    def counted_step(engine, *args, **kwargs):
        if engine.global_steps + 1 < STEPS:
            return real_step(engine, *args, **kwargs)
        parts = compiled_parts(engine.module)
        calls, inputs = collections.Counter(), {}

        def hook(index):
            def record(module, args, kwargs):
                calls[index] += 1
                inputs.setdefault(index, tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v,
                                                  (args, kwargs)))
            return record

        handles = [p.register_forward_pre_hook(hook(i), with_kwargs=True) for i, p in enumerate(parts)]
        with OpCounter() as counter:
            out = real_step(engine, *args, **kwargs)
        for handle in handles:
            handle.remove()
        result.update(total=counter.total, calls=calls, inputs=inputs, top=counter.ops.most_common(6))
        return out

    fuse = build.fuse_bf16_grad_accumulation if fused else lambda optimizer: False  # today: DeepSpeed's own loop
    with patched(loop, "train_step", counted_step), patched(build, "fuse_bf16_grad_accumulation", fuse):
        run = run_pretrain(["--model", preset, "--deepspeed_config", str(path), "--train-data", str(CORPUS),
                            "--seq-len", str(SEQ), "--micro-batch-size", str(micro), "--gradient-accumulation-steps",
                            str(accum), "--max-steps", str(STEPS), "--log-steps", "1", "--save-steps", "0",
                            "--hc", "wordnet", "--sr", "word", "--overwrite"],
                           work / f"{preset}_{micro}x{accum}_{'fused' if fused else 'today'}")
    if not run.ok:
        raise SystemExit(f"{preset} {micro}x{accum}: {run.error}")
    if parts_too:
        fresh = models.build_pretrainer(preset, models.ObjectiveConfig()).to(torch.bfloat16).train()
        parts = compiled_parts(fresh)
        result["part_ops"] = {i: (part_ops(parts[i], *result["inputs"][i], compiled=False),
                                  part_ops(parts[i], *result["inputs"][i], compiled=True)) for i in result["calls"]}
    return result


def per_sample(micro_ops: float, step_ops: float, micro: int, accum: int) -> float:
    """Operations per sample of an optimizer step of `accum` micro-steps of `micro` samples."""
    return (accum * micro_ops + step_ops) / (micro * accum)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="host_ops_"))
    ratios = {}
    with mock.patch.dict(models.BERT_PRESETS, NARROW_BERT), mock.patch.dict(models.ELECTRA_PRESETS, NARROW_ELECTRA):
        for preset in ("bert-large", "electra-base"):
            four = count_step(preset, 4, MICRO, work, fused=False, parts_too=True)
            one = count_step(preset, 1, MICRO, work, fused=False)
            check = count_step(preset, 1, 2 * MICRO, work, fused=False)
            fused = [count_step(preset, accum, MICRO, work, fused=True)["total"] for accum in (4, 1)]
            eager_micro = (four["total"] - one["total"]) / 3
            eager_step = one["total"] - eager_micro
            fused_micro = (fused[0] - fused[1]) / 3
            fused_step = fused[1] - fused_micro
            # per micro-step, each part's eager ops out, its compiled region's in
            saved = sum(n * (four["part_ops"][i][0] - four["part_ops"][i][1]) for i, n in four["calls"].items()) / 4
            new_micro = fused_micro - saved
            print(f"\n{preset} (narrow), seq {SEQ}, HC + SR, bf16 ZeRO-1: host operations", flush=True)
            print(f"  today: micro-step {eager_micro:.0f} (micro {MICRO}; {check['total'] - eager_step:.0f} at micro "
                  f"{2 * MICRO}), optimizer step's own {eager_step:.0f}; most dispatched: {four['top']}")
            print(f"  DeepSpeed's bf16 accumulation in multi-tensor ops: micro-step {fused_micro:.0f}, optimizer "
                  f"step's own {fused_step:.0f}")
            kinds = collections.defaultdict(lambda: [0, 0, 0])
            with torch.device("meta"):
                narrow = compiled_parts(models.build_pretrainer(preset, models.ObjectiveConfig()))
            names = [f"{type(p).__name__} ({sum(w.numel() for w in p.parameters()):,} parameters)" for p in narrow]
            for i, n in four["calls"].items():
                name = names[i]
                kinds[name][0] += n // 4
                kinds[name][1:] = four["part_ops"][i]
            for name, (n, eager_ops, compiled_ops) in kinds.items():
                print(f"  {name}: {n} call(s) a micro-step, {eager_ops} ops eager, {compiled_ops} compiled")
            print(f"  and --compile layers: micro-step {new_micro:.0f} ({eager_micro / new_micro:.2f}x fewer)")

            micro, accum = TODAY[preset]
            today = per_sample(eager_micro, eager_step, micro, accum)
            new = per_sample(new_micro, fused_step, micro, accum)
            print(f"  per sample at {micro} x {accum}: today {today:.1f}, new {new:.1f}")
            ratios[preset] = today / new
            if preset in NEW_RECIPE:
                recipe = per_sample(new_micro, fused_step, *NEW_RECIPE[preset])
                print(f"  per sample at the new recipe's {NEW_RECIPE[preset][0]} x {NEW_RECIPE[preset][1]}, "
                      f"new: {recipe:.1f}")
                ratios["recipe"] = today / recipe
    print(f"RESULT bert_large_ops_per_sample_vs_today={ratios['bert-large']:.2f} "
          f"bert_large_recipe_ops_per_sample_vs_today={ratios['recipe']:.2f} "
          f"electra_base_ops_per_sample_vs_today={ratios['electra-base']:.2f}", flush=True)


if __name__ == "__main__":
    main()
