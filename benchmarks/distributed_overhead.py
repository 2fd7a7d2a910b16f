"""Shim overhead at 2 ranks (gloo, CPU), measured side by side in one launch.

For each framework, the bench model trains in alternating blocks of `block` steps, bare and
through the Recorder (the `prod` profile by default: what a distributed run would use), on both
ranks at once. Rank 0 prints the ratio of mean step times (amortised), of medians (per step) and
the share of the amortised overhead spent at the steps where a probe, generation or eval ran.
By default each rank takes 8 rows of 256 tokens: two ranks train a 16 x 256 global batch
on the same two cores; `--rows 4` halves the work per step, so the shim's fixed
per-step cost weighs twice as much.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/distributed_overhead.py
    ... benchmarks/distributed_overhead.py --modes ddp fsdp2 --steps 100 --profile preprod --rows 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset, load_eval_set
from sftaudit.fixtures.distributed import process_group, wrap
from sftaudit.fixtures.train import PROBE_PROMPTS

from sftaudit.shim import Recorder


def alternating_blocks(
    model,
    opt,
    rec: Recorder,
    prepared: list[dict],
    steps: int,
    block: int,
    warmup: int,
    before_step: Callable[[], None] | None = None,
) -> dict:
    """Train `block` steps bare, then `block` through `rec`, and so on (`steps` per arm, after
    `warmup` unmeasured steps that settle allocators and caches); `before_step` runs before each
    step's clock starts (here a barrier, so the slower rank sets the step time).
    The recorder's step numbers continue across its blocks, so its schedule fires as in a real run."""
    times = {"bare": [], "shim": []}
    probe_steps = []  # indices into times["shim"] of the steps where a probe ran
    shim_step = 0
    for i in range(-warmup, 2 * steps):
        shimmed = i >= 0 and (i // block) % 2 == 1
        batch = prepared[i % len(prepared)]
        if before_step is not None:
            before_step()
        start = time.perf_counter()
        if shimmed:
            shim_step += 1
            rec.on_batch(shim_step, batch)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
        loss.backward()
        if shimmed:
            rec.on_backward(shim_step, loss)
        opt.step()
        if shimmed:
            rec.on_step_end(shim_step, lr=opt.param_groups[0]["lr"])
        opt.zero_grad(set_to_none=True)
        if i >= 0:
            times["shim" if shimmed else "bare"].append(time.perf_counter() - start)
        if shimmed and any(
            every and shim_step % every == 0
            for every in (rec.schedule.probe_every, rec.schedule.generate_every, rec.schedule.eval_every)
        ):
            probe_steps.append(len(times["shim"]) - 1)
    rec.close()
    bare, shim = times["bare"], times["shim"]
    typical = statistics.median(shim)
    return {
        "bare_ms": 1000 * statistics.median(bare),
        "mean_overhead": statistics.fmean(shim) / statistics.fmean(bare) - 1,
        "median_overhead": typical / statistics.median(bare) - 1,
        "probe_overhead": sum(shim[j] - typical for j in probe_steps) / sum(bare),
        "steps": len(shim),
    }


def measure(mode: str, profile: str, steps: int, block: int, rows_per_rank: int, warmup: int = 5) -> dict:
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = wrap(mode, build_model(tok, size="bench"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = load_dataset()
    rank = dist.get_rank()
    world, n = dist.get_world_size(), rows_per_rank
    prepared = [
        collate(tok, rows[(world * n * i + n * rank) % (len(rows) - n) :][:n], max_length=256) for i in range(16)
    ]
    with tempfile.TemporaryDirectory() as run_dir:
        # The probes of a one-process run: rank 0 alone runs them under DDP, every rank under FSDP.
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
            print(
                f"{'mode':<6} {'ranks':>5} {'rows':>5} {'bare step':>10} {'amortised':>10} {'per step':>9} {'probe steps':>12} {'steps':>6}"
            )
        for mode in args.modes:
            r = measure(mode, args.profile, args.steps, args.block, args.rows)
            if rank == 0:
                print(
                    f"{mode:<6} {world:>5} {args.rows:>5} {r['bare_ms']:>8.1f}ms {r['mean_overhead']:>+9.1%} "
                    f"{r['median_overhead']:>+8.1%} {r['probe_overhead']:>+11.1%} {r['steps']:>6}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
