"""Shim overhead at 2 ranks (gloo, CPU), measured side by side in one launch.

For each framework, the bench model trains in alternating blocks of `block` steps, bare and
through the Recorder (the `prod` profile by default: what a distributed run would use), on both
ranks at once. Rank 0 prints the ratio of mean step times (amortised), of medians (per step) and
the share of the amortised overhead spent at the steps where a probe, generation or eval ran.
By default each rank takes 8 rows of 256 tokens: two ranks train shim_overhead.py's global batch
(16 x 256) on the same two cores; `--rows 4` halves the work per step, so the shim's fixed
per-step cost weighs twice as much.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/distributed_overhead.py
    ... benchmarks/distributed_overhead.py --modes ddp fsdp2 --steps 100 --profile preprod --rows 4
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
from shim_overhead import alternating_blocks  # benchmarks/ is on the path when a script there runs

from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset, load_eval_set
from sftaudit.fixtures.train import PROBE_PROMPTS
from sftaudit.fixtures.distributed import process_group, wrap
from sftaudit.shim import Recorder


def measure(mode: str, profile: str, steps: int, block: int, rows_per_rank: int, warmup: int = 5) -> dict:
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = wrap(mode, build_model(tok, size="bench"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = load_dataset()
    rank = dist.get_rank()
    world, n = dist.get_world_size(), rows_per_rank
    prepared = [collate(tok, rows[(world * n * i + n * rank) % (len(rows) - n):][:n], max_length=256) for i in range(16)]
    with tempfile.TemporaryDirectory() as run_dir:
        # The probes of shim_overhead.py: rank 0 alone runs them under DDP, every rank under FSDP.
        rec = Recorder(run_dir, model, tok, profile=profile, probe_prompts=PROBE_PROMPTS, eval_set=load_eval_set())
        # Both ranks start each step together: the slower rank sets the step time.
        return alternating_blocks(model, opt, rec, prepared, steps, block, warmup, before_step=dist.barrier)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="steps per arm (shimmed and bare)")
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=["ddp", "fsdp1", "fsdp2"])
    p.add_argument("--profile", default="prod")
    p.add_argument("--rows", type=int, default=8, help="rows of 256 tokens per rank and step")
    args = p.parse_args()
    with process_group() as (rank, world):
        if rank == 0:
            print(f"{'mode':<6} {'ranks':>5} {'rows':>5} {'bare step':>10} {'amortised':>10} {'per step':>9} {'probe steps':>12} {'steps':>6}")
        for mode in args.modes:
            r = measure(mode, args.profile, args.steps, args.block, args.rows)
            if rank == 0:
                print(f"{mode:<6} {world:>5} {args.rows:>5} {r['bare_ms']:>8.1f}ms {r['mean_overhead']:>+9.1%} "
                      f"{r['median_overhead']:>+8.1%} {r['probe_overhead']:>+11.1%} {r['steps']:>6}", flush=True)


if __name__ == "__main__":
    main()
