"""Shim overhead at 2 ranks (gloo, CPU), measured side by side in one launch.

For each framework, the bench model trains in alternating blocks of `block` steps, bare and
through the Recorder (the `prod` profile by default: what a distributed run would use), on both
ranks at once. Rank 0 prints the ratio of mean step times (amortised) and of medians (per step).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/distributed_overhead.py
    ... benchmarks/distributed_overhead.py --modes ddp fsdp2 --steps 100 --profile preprod
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
from shim_overhead import alternating_blocks  # benchmarks/ is on the path when a script there runs

from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset
from sftaudit.fixtures.distributed import process_group, wrap
from sftaudit.shim import Recorder


def measure(mode: str, profile: str, steps: int, block: int, warmup: int = 5) -> dict:
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = wrap(mode, build_model(tok, size="bench"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = load_dataset()
    rank = dist.get_rank()
    prepared = [collate(tok, rows[(8 * i + 4 * rank) % 232:][:4], max_length=256) for i in range(16)]
    with tempfile.TemporaryDirectory() as run_dir:
        rec = Recorder(run_dir, model, tok, profile=profile)
        # Both ranks start each step together: the slower rank sets the step time.
        return alternating_blocks(model, opt, rec, prepared, steps, block, warmup, before_step=dist.barrier)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="steps per arm (shimmed and bare)")
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=["ddp", "fsdp1", "fsdp2"])
    p.add_argument("--profile", default="prod")
    args = p.parse_args()
    with process_group() as (rank, world):
        if rank == 0:
            print(f"{'mode':<6} {'ranks':>5} {'bare step':>10} {'amortised':>10} {'per step':>9} {'steps':>6}")
        for mode in args.modes:
            r = measure(mode, args.profile, args.steps, args.block)
            if rank == 0:
                print(f"{mode:<6} {world:>5} {r['bare_ms']:>8.1f}ms {r['mean_overhead']:>+9.1%} "
                      f"{r['median_overhead']:>+8.1%} {r['steps']:>6}", flush=True)


if __name__ == "__main__":
    main()
