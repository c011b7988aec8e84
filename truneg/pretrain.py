"""Pre-train BERT (MLM) or ELECTRA (RTD) on DeepSpeed, with the paper's hard correction and soft regularization.

    deepspeed truneg/pretrain.py                                  # electra-tiny on the shipped corpus
    deepspeed --num_gpus 2 truneg/pretrain.py --model bert-tiny --hc wordnet --sr word
    deepspeed --hostfile launch/hosts truneg/pretrain.py --model bert-large \\
        --deepspeed_config ds_configs/bert_large_v100_fp16_zero2.json --train-data /data/corpus

Output (under --output-dir): checkpoints/ (DeepSpeed's layout, `latest`), tensorboard/, metrics.jsonl.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script by the deepspeed launcher: import truneg from the repo, and keep this folder's
    # module names (data, model, ...) from shadowing installed packages.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from truneg.errors import exit_on_user_error  # noqa: E402  (after the sys.path line above)
from truneg.model.pretrainers import architecture  # noqa: E402
from truneg.train import build, heldout, loop  # noqa: E402
from truneg.train.checkpointing import checkpoint, run_dir  # noqa: E402
from truneg.train.checkpointing.export import frozen_weights, save_hf_configs  # noqa: E402
from truneg.train.ranks import distributed  # noqa: E402


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    # 1. Checks that need no process group: the DeepSpeed config for this world size, the resume point,
    #    the synonym table, and the corpus (prepared once per node, before any collective could time out).
    cfg, start = build.checked_start(argv)
    eval_prepared = heldout.prepare_eval_data(cfg, start, distributed.launch_world_size())

    # 2. Processes: one per device, gloo on the CPU; every node must see the same output folder.
    rank, world_size = distributed.init_distributed(cfg.output_dir)
    run_dir.check_shared_output_dir(cfg.output_dir, rank, world_size,
                                    checkpoint.step_of_tag(start.resume.tag) if start.resume else -1)

    # 3. Data: the memory-mapped blocks on every rank.
    blocks, data_record = build.open_blocks(cfg, start)
    eval_blocks = heldout.open_eval_blocks(cfg, start, eval_prepared)  # --eval-data's, if any

    # 4. The model; then claim the output folder for this run (refuse to mix two runs in one folder).
    #    A hub name in --init-from is resolved by rank 0 first, then at its commit by each other node's local
    #    rank 0 (downloading what that node's HF cache lacks), then read from the node's cache by the others.
    init = build.locate_init(cfg)
    model = build.build_model(cfg, start.table, vocab_size=len(start.tokenizer), init=init,
                              reach_table=start.table or start.eval_table)
    identity = run_dir.run_identity(cfg, start.ds_config, {"architecture": architecture(model),
                                                           "synonym_table": build.table_fingerprint(start.table),
                                                           **data_record, **build.init_record(init),
                                                           **(start.phase1.run_record() if start.phase1 else {})})
    run_dir.claim_output_dir(cfg, identity, rank)
    tag = checkpoint.prepare_universal(start.resume, world_size) if start.resume else None
    frozen = frozen_weights(model) if rank == 0 else {}  # (--train-only head's, while whole and in fp32)

    # 5. The DeepSpeed engine (ZeRO, precision, optimizer and scheduler from the config).
    engine = build.build_engine(cfg, model, start.ds_config)
    if rank == 0:
        save_hf_configs(model, cfg.checkpoint_dir, start.tokenizer, resumed=start.resume is not None, frozen=frozen)
        heldout.save_eval_table(cfg, start)

    # 6. Resume: weights, optimizer, scheduler, step, data position and RNG states (phase 2's start: the phase-1
    #    tag's weights, optimizer and counters, all else fresh).
    state = loop.start_state(cfg, engine, blocks, start.tokenizer, start.resume, tag, start.phase1)
    if eval_blocks is not None:
        state.heldout = heldout.HeldOut.for_run(cfg, engine, eval_blocks, start.tokenizer, start.eval_table,
                                                state.first_step)

    # 7. Train, log, checkpoint; stop cleanly on SIGTERM/SIGINT.
    try:
        loop.train(cfg, engine, state)
    finally:  # its ZeRO optimizer's gradient hooks, held by autograd, keep it (and DeepSpeed's group) past gc
        engine.destroy()


if __name__ == "__main__":
    # The process's end, not main's (benchmarks and tests call main() several times in one process group): its
    # groups destroyed on every way out, as a gloo group alive in the interpreter's teardown aborts a rank now and
    # then (exit -6 where a diverged run's rank says its line and exits 2).
    distributed.run_then_exit(main)
