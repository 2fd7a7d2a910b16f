"""Shim overhead per profile, measured side by side in one process.

For each profile, one model trains in alternating blocks: `block` steps bare, then `block`
steps through the Recorder (their step numbers continue, so the probe schedule fires as in
a real run). The ratio of mean step times is the overhead amortised over the schedule;
the ratio of medians is the per-step cost without the probes; "probe steps" is the part of
the amortised overhead spent at the steps where a probe, generation or eval ran (their time
above the median shimmed step, over the bare arm's total).

    python benchmarks/shim_overhead.py                 # bench model (>= 100 ms/step) and tiny model
    python benchmarks/shim_overhead.py --steps 400     # longer, steadier
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Callable

import torch

from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset, load_eval_set
from sftaudit.fixtures.train import PROBE_PROMPTS, batches
from sftaudit.shim import PROFILES, Recorder


def measure(size: str, profile: str, steps: int, block: int, batch_size: int, max_length: int,
            warmup: int = 20) -> dict:
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_model(tok, size=size)
    rows = load_dataset()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batches(rows, batch_size, seed=0)
    prepared = [collate(tok, next(data)[0], max_length=max_length) for _ in range(16)]
    with tempfile.TemporaryDirectory() as run_dir:
        rec = Recorder(run_dir, model, tok, profile=profile, probe_prompts=PROBE_PROMPTS, eval_set=load_eval_set())
        return alternating_blocks(model, opt, rec, prepared, steps, block, warmup)


def alternating_blocks(model, opt, rec: Recorder, prepared: list[dict], steps: int, block: int, warmup: int,
                       before_step: Callable[[], None] | None = None) -> dict:
    """Train `block` steps bare, then `block` through `rec`, and so on (`steps` per arm, after
    `warmup` unmeasured steps that settle allocators and caches); `before_step` runs before each
    step's clock starts (distributed_overhead.py: a barrier, so the slower rank sets the step time).
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
        if shimmed and any(every and shim_step % every == 0 for every in (
                rec.schedule.probe_every, rec.schedule.generate_every, rec.schedule.eval_every)):
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="steps per arm (shimmed and bare)")
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--sizes", nargs="+", default=["bench", "tiny"])
    p.add_argument("--profiles", nargs="+", default=list(PROFILES))
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"{'model':<6} {'profile':<8} {'bare step':>10} {'amortised':>10} {'per step':>9} {'probe steps':>12} {'steps':>6}")
    for size in args.sizes:
        shape = (16, 256) if size == "bench" else (8, 128)
        for profile in args.profiles:
            r = measure(size, profile, args.steps, args.block, *shape)
            print(f"{size:<6} {profile:<8} {r['bare_ms']:>8.1f}ms {r['mean_overhead']:>+9.1%} "
                  f"{r['median_overhead']:>+8.1%} {r['probe_overhead']:>+11.1%} {r['steps']:>6}", flush=True)


if __name__ == "__main__":
    main()
