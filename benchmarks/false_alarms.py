"""False-alarm budget and fault table: clean runs that must raise nothing, planted zoo faults that
must be found at their exact step.

The sweep trains clean CPU runs of the tiny fixture model (200+ steps each) across the three
integration paths (plain loop, Trainer, TRL SFTTrainer), AdamW / SGD (momentum 0.9 in the loop, the
Trainer's plain SGD otherwise) / Adafactor,
constant / linear / cosine schedules with warmup, learning rates 1e-5..3e-3, gradient
accumulation 1 and 4, two seeds, with and without a resume; then audits each and counts, per
check, the runs that got a warn or fail (the target is 0). The fault table plants each zoo entry
sftaudit claims to catch, as its repro describes, and reports the step it was found at.

    python benchmarks/false_alarms.py --out /tmp/false-alarms          # train and audit everything
    python benchmarks/false_alarms.py --out /tmp/false-alarms --audit-only   # re-audit kept runs

Runs are kept under --out (delete it to retrain); the tables print as markdown (docs/benchmarks.md).
This is a benchmark, not a test: it takes tens of minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

PATHS = ("loop", "trainer", "trl")
OPTIMIZERS = ("adamw", "sgd", "adafactor")
SCHEDULES = ("constant_with_warmup", "linear", "cosine")
LRS = (1e-5, 1e-4, 1e-3, 3e-3)
HF_OPTIM = {"adamw": "adamw_torch", "sgd": "sgd", "adafactor": "adafactor"}
COMMON = dict(batch_size=4, max_length=96, tokenizer_cache=None)


def sweep(steps: int) -> list[dict]:
    """24 clean configurations covering every level of every factor (a cyclic design, not a grid), and
    TRL's packing."""
    runs = []
    for i in range(24):
        runs.append(
            {
                "name": f"clean-{i:02d}",
                "path": PATHS[i % 3],
                "optimizer": OPTIMIZERS[(i // 3) % 3],
                "lr_schedule": SCHEDULES[(i // 9 + i) % 3],
                "lr": LRS[i % 4],
                "grad_accum": (1, 4)[(i // 2) % 2],
                "seed": i // 12,
                "resume": i % 6 == 3,
                "steps": steps,  # resumes: plain-loop runs
            }
        )
    # Real packing: TRL packs the dataset and flattens it padding-free (per-sample position_ids, no mask).
    runs.append(
        {
            "name": "clean-24",
            "path": "trl",
            "packing": True,
            "optimizer": "adamw",
            "lr_schedule": "cosine",
            "lr": 1e-3,
            "grad_accum": 1,
            "seed": 0,
            "resume": False,
            "steps": steps,
        }
    )
    return runs


# zoo id, what is planted, the check expected, the step it must be found at, and the run.
FAULTS = [
    (
        "Z18",
        "NaN loss at step 30 under the Trainer's default logging_nan_inf_filter",
        "LOOP-13",
        30,
        dict(path="trainer", steps=40, faults={"nan_at": 30}),
    ),
    (
        "Z22",
        "GA 4, mean of micro-batch means from step 40",
        "LOOP-13",
        40,
        dict(path="loop", steps=50, grad_accum=4, faults={"loss_mean_of_means_from": 40}),
    ),
    (
        "Z23",
        "Trainer GA 4, logged loss x GA from step 1",
        "LOOP-13",
        1,
        dict(path="trainer", steps=20, grad_accum=4, faults={"logged_loss_times_accumulation": True}),
    ),
    (
        "Z28",
        "cosine over 120 steps, warmup 12, scheduler stepped 4x per optimizer step",
        "LOOP-14",
        1,
        dict(path="loop", steps=120, lr_schedule="cosine", warmup_steps=12, faults={"scheduler_steps_per_step": 4}),
    ),
    (
        "Z36",
        "checkpoint at 60, killed at 63, resumed from 60 with a fresh scheduler",
        "LOOP-14",
        61,
        dict(
            path="loop",
            steps=80,
            lr_schedule="cosine",
            warmup_steps=12,
            resume_at=60,
            resume_fault="resume_restarts_warmup",
        ),
    ),
    (
        "Z16",
        "3 samples packed per row from step 5, positions running on, plain causal attention",
        "LOOP-16",
        5,
        dict(path="loop", steps=20, batch_size=6, faults={"packed_from": 5}),
    ),
    (
        "Z26",
        "frozen embeddings, decoder layers under reentrant checkpointing: layers get grad None",
        "LOOP-15",
        3,
        dict(path="loop", steps=30, faults={"reentrant_checkpointing": True}),
    ),
    (
        "Z27",
        "lm_head declared trainable, frozen",
        "LOOP-15",
        1,
        dict(path="loop", steps=30, trainable=["lm_head.*"], faults={"frozen_module": "lm_head.*"}),
    ),
    (
        "Z29",
        "layer-1 gradients of step 2 copied back from step 3 (stale bucket)",
        "LOOP-15",
        3,
        dict(path="loop", steps=30, faults={"stale_grads_from": 3}),
    ),
    (
        "Z25",
        "one layer's gradient x100 from step 37 (a broken layer; the zoo's trigger is one batch)",
        "LOOP-05",
        37,
        dict(path="loop", steps=60, faults={"grad_scale_from": 37}),
    ),
]


def train(out: Path, spec: dict) -> Path:
    import torch

    torch.set_num_threads(1)
    from sftaudit.fixtures.train import train_hf, train_plain

    run_dir = out / spec["name"]
    if (run_dir / "sftaudit" / "rank-0" / "events.jsonl").exists() and "close" in (
        run_dir / "sftaudit" / "rank-0" / "events.jsonl"
    ).read_text():
        return run_dir  # kept from an earlier invocation
    # GA 4 runs take micro-batches of 2 rows (8 rows per step), the others 4.
    options = dict(
        COMMON,
        batch_size=spec.get("batch_size", 2 if spec.get("grad_accum", 1) > 1 else 4),
        tokenizer_cache=str(out / "tokenizer"),
        seed=spec.get("seed", 0),
        lr=spec.get("lr", 3e-3),
        grad_accum=spec.get("grad_accum", 1),
        faults=spec.get("faults"),
        generate_every=50,
        eval_every=50,
        probe_every=spec.get("probe_every", 10),
    )
    steps = spec["steps"]
    if spec["path"] == "loop":
        loop = dict(
            options,
            lr_schedule=spec.get("lr_schedule", "cosine"),
            warmup_steps=spec.get("warmup_steps", 10),
            optimizer=spec.get("optimizer", "adamw"),
            trainable=spec.get("trainable"),
        )
        resume_at = spec.get("resume_at") or (steps // 2 if spec.get("resume") else None)
        if resume_at:
            train_plain(
                run_dir, steps=steps, stop_after=resume_at + 3, checkpoint_every=resume_at, **loop
            )  # killed 3 steps after the save
            fault = spec.get("resume_fault")
            train_plain(
                run_dir,
                steps=steps,
                checkpoint_every=resume_at,
                resume_from=run_dir / f"checkpoint-{resume_at}",
                **{**loop, "faults": {fault: True} if fault else loop["faults"]},
            )
        else:
            train_plain(run_dir, steps=steps, checkpoint_every=100, **loop)
    else:
        hf = dict(
            options,
            lr_schedule=spec.get("lr_schedule", "linear"),
            warmup_steps=spec.get("warmup_steps", 10),
            optimizer=HF_OPTIM[spec.get("optimizer", "adamw")],
            trl=spec["path"] == "trl",
            packing=spec.get("packing", False),
        )
        train_hf(run_dir, steps=steps, save_steps=100, **hf)
    return run_dir


def judge(run_dir: Path, spec: dict) -> dict:
    from sftaudit.verdict.audit import audit
    from sftaudit.verdict.config import AuditConfig

    # TRL's packing of a `messages` dataset trains every token (its default): declared, as its user would.
    declared = {"LOOP-04": {"expect": "all_tokens"}} if spec.get("packing") else {}
    verdict = audit(run_dir, AuditConfig(check_options=declared))
    return {
        "check_errors": verdict["check_errors"],
        "findings": [{k: f[k] for k in ("code", "severity", "step", "message")} for f in verdict["findings"]],
    }


def work(args: tuple[Path, dict]) -> tuple[str, dict, float]:
    out, spec = args
    started = time.perf_counter()
    try:
        result = judge(train(out, spec), spec)
    except Exception as exc:  # noqa: BLE001 - one broken run must not lose the others' figures
        result = {"check_errors": [{"code": "run", "error": f"{type(exc).__name__}: {exc}"}], "findings": []}
    return spec["name"], result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", choices=("sweep", "faults", "all"), default="all")
    parser.add_argument("--audit-only", action="store_true", help="re-audit the runs kept under --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    clean = sweep(args.steps) if args.only in ("sweep", "all") else []
    faults = [{"name": f"fault-{z}", **spec} for z, _, _, _, spec in FAULTS] if args.only in ("faults", "all") else []
    specs = faults + clean  # the fault table first: shorter runs
    if args.audit_only:
        results = {s["name"]: (judge(args.out / s["name"], s), 0.0) for s in specs if (args.out / s["name"]).exists()}
    else:
        with ProcessPoolExecutor(args.workers) as pool:
            results = {name: (res, dt) for name, res, dt in pool.map(work, [(args.out, s) for s in specs])}
    (args.out / "results.json").write_text(json.dumps({k: v[0] for k, v in results.items()}, indent=1))
    print_tables(clean, results)


def print_tables(clean: list[dict], results: dict) -> None:
    from sftaudit.checks import registered_checks

    if clean:
        print(f"\nClean sweep: {len(clean)} runs\n")
        print("| run | path | optimizer | schedule | lr | GA | seed | resume | warn/fail findings |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for s in clean:
            res = results.get(s["name"], ({"findings": []}, 0))[0]
            bad = [f"{f['code']} {f['severity']} @{f['step']}" for f in res["findings"] if f["severity"] != "info"]
            print(
                f"| {s['name']} | {s['path']}{' (packing)' if s.get('packing') else ''} | {s['optimizer']} | {s['lr_schedule']} | {s['lr']:g} | {s['grad_accum']} "
                f"| {s['seed']} | {'yes' if s['resume'] else 'no'} | {', '.join(bad) or '-'} |"
            )
        print("\n| check | runs with warn/fail (of %d) |" % len(clean))
        print("| --- | --- |")
        for check in registered_checks():
            n = sum(
                any(f["code"] == check.code and f["severity"] != "info" for f in results[s["name"]][0]["findings"])
                for s in clean
                if s["name"] in results
            )
            print(f"| {check.code} {check.name} | {n} |")
    names = {f"fault-{z}" for z, *_ in FAULTS}
    if names & set(results):
        print("\nFault table\n")
        print("| zoo | planted | expected | found at | exact |")
        print("| --- | --- | --- | --- | --- |")
        for z, what, code, step, _ in FAULTS:
            res = results.get(f"fault-{z}")
            if res is None:
                continue
            hits = [f for f in res[0]["findings"] if f["code"] == code and f["severity"] != "info"]
            found = min((f["step"] for f in hits if f["step"] is not None), default=None)
            exact = found is not None and (step is None or found == step)
            print(
                f"| {z} | {what} | {code}{f' at {step}' if step else ''} | {found if found is not None else 'not found'} "
                f"| {'yes' if exact else 'NO'} |"
            )


if __name__ == "__main__":
    main()
