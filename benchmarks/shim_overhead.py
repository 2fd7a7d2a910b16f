"""Shim overhead, interleaved A/B: one training step bare (A) and instrumented (B), in adjacent blocks.

Arms: the sftaudit Recorder in each profile, and at equal evidence the usual alternatives (per-tensor
gradient norms every step, gradient histograms every N steps, N the default profile's
`grad_hist_every`): TensorBoard (`SummaryWriter.add_scalar` per tensor norm, `add_histogram` per
tensor) and W&B offline (`wandb.watch(model, log="all", log_freq=N)` plus a `wandb.log` of the norms).

Per arm, a fresh model (same seed) trains repetitions of an A block and a B block, in random order
within each pair. A block is one settling step (not timed: it absorbs the switch) and then timed
steps. A B block's timed steps are `--base-steps` ordinary steps and one step of each rarer kind its
schedule makes (a probe step, a histogram step, ...), placed by the step numbers given to the
instrumentation, so that every repetition measures them; each is amortised at its share of steps over
the schedule's period. A repetition's ratio is its amortised B step over its own A step; the figure
is the median over repetitions, with a percentile-bootstrap 95% interval (fixed seed). Load that
drifts over minutes moves A and B alike, so the ratio stays put where raw step times do not.

"hooks" is the time spent inside the instrumentation's calls at ordinary steps (the Recorder's
on_batch / on_backward / on_step_end and its forward hook, timed from outside; for TensorBoard and
W&B the loop's norm and logging calls: W&B's own hooks inside forward/backward are not in it), in
the training thread's CPU time (not inflated by waiting for a core) and in wall time; its Python work
is that CPU time less the part spent inside torch._foreach_norm (the norm pass: compute). The ratios
are printed twice: in wall time (what a run pays) and in the process's CPU time (steadier on a
shared machine; it leaves out work done by other processes, such as W&B's service).

    python benchmarks/shim_overhead.py                  # every arm, 9 repetitions (about 6 min idle)
    python benchmarks/shim_overhead.py --quick          # smoke run (1 min idle): not evidence
    python benchmarks/shim_overhead.py --arms preprod tensorboard --reps 15
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import platform
import sys
import tempfile
import time
from fractions import Fraction
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from ab_stats import median_ci, next_step, rep_ratios, step_classes  # benchmarks/ is on the path
from sftaudit.fixtures import build_tokenizer, collate, load_dataset, load_eval_set
from sftaudit.fixtures.train import PROBE_PROMPTS

from sftaudit.shim import PROFILES, Recorder

DEFAULT_PROFILE = inspect.signature(Recorder).parameters["profile"].default
_FOREACH_NORM = torch._foreach_norm


def _timed_foreach_norm(*args, **kwargs):
    """torch._foreach_norm, its thread CPU time added up (every arm's norm pass calls it, looked up at
    call time): the hooks' Python work is their CPU time less the time spent in it during them."""
    start = time.thread_time()
    try:
        return _FOREACH_NORM(*args, **kwargs)
    finally:
        NORM_CPU_S[0] += time.thread_time() - start


NORM_CPU_S = [0.0]
torch._foreach_norm = _timed_foreach_norm
HIST_EVERY = PROFILES[DEFAULT_PROFILE].grad_hist_every  # the alternatives' histogram interval: equal evidence


class Arm:
    """The instrumentation of one B arm; `intervals` names the work it schedules by step number."""

    name = ""
    intervals: ClassVar[dict[str, int]] = {}

    def __init__(self) -> None:
        # (wall, this thread's CPU, CPU inside torch._foreach_norm) seconds inside this arm's calls this step
        self.hook_s = np.zeros(3)

    def timed(self, call, *args):
        start = clocks()
        out = call(*args)
        end = clocks()
        self.hook_s += np.subtract(end, start)
        return out

    def open(self, model, opt, tokenizer, rows, folder: str) -> None: ...
    def begin_block(self, plan: list[tuple[int, frozenset]]) -> None: ...
    def end_block(self) -> None: ...
    def on_batch(self, step: int, batch: dict) -> None: ...
    def on_backward(self, step: int, loss: torch.Tensor) -> None: ...
    def on_step_end(self, step: int, lr: float) -> None: ...
    def close(self) -> None: ...


class SftauditArm(Arm):
    def __init__(self, profile: str):
        super().__init__()
        self.profile = profile
        self.name = f"sftaudit {profile}" + (" (default)" if profile == DEFAULT_PROFILE else "")
        s = PROFILES[profile]
        self.intervals = {
            "samples": s.samples_every,
            "histograms": s.grad_hist_every,
            "probes": s.probe_every,
            "generations": s.generate_every if s.generations_per_prompt else 0,
            "evals": s.eval_every,
        }

    def open(self, model, opt, tokenizer, rows, folder):
        self.rec = Recorder(
            folder,
            model,
            tokenizer,
            profile=self.profile,
            probe_prompts=PROBE_PROMPTS,
            eval_set=load_eval_set(),
            dataset=rows,
            optimizer=opt,
        )
        # The Recorder's forward hook runs inside forward: timed by a hook just before it and one after.
        self._timers = [
            model.register_forward_hook(self._forward_started, prepend=True),
            model.register_forward_hook(self._forward_hooked),
        ]
        self._forward_end = None
        self.active = False  # within a B block: the timers run in A blocks too, and count nothing there

    def _forward_started(self, *_):
        self._forward_end = clocks()

    def _forward_hooked(self, *_):
        if self._forward_end is not None and self.active:
            end = clocks()
            self.hook_s += np.subtract(end, self._forward_end)
        self._forward_end = None

    def begin_block(self, plan):
        self.active = True

    def end_block(self):
        self.active = False

    def on_batch(self, step, batch):
        self.timed(self.rec.on_batch, step, batch)

    def on_backward(self, step, loss):
        self.timed(self.rec.on_backward, step, loss)

    def on_step_end(self, step, lr):
        self.timed(self.rec.on_step_end, step, lr)

    def close(self):
        self.rec.close()
        for handle in self._timers:
            handle.remove()


class NormsArm(Arm):
    """Per-tensor gradient norms every step, computed as the shim does (one vectorised pass)."""

    intervals: ClassVar[dict[str, int]] = {"histograms": HIST_EVERY}

    def open(self, model, opt, tokenizer, rows, folder):
        self.model = model
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]

    def norms(self) -> list[float]:
        return torch.stack(torch._foreach_norm([p.grad for _, p in self.named])).tolist()


class TensorBoardArm(NormsArm):
    name = "TensorBoard"

    def open(self, model, opt, tokenizer, rows, folder):
        from torch.utils.tensorboard import SummaryWriter

        super().open(model, opt, tokenizer, rows, folder)
        self.writer = SummaryWriter(folder)

    def on_backward(self, step, loss):
        self.timed(self._log_gradients, step, loss)

    def _log_gradients(self, step, loss):
        self.writer.add_scalar("train/loss", loss.item(), step)
        for (name, _), norm in zip(self.named, self.norms()):
            self.writer.add_scalar(f"grad_norm/{name}", norm, step)
        if step % HIST_EVERY == 0:
            for name, p in self.named:
                self.writer.add_histogram(f"grad/{name}", p.grad, step)

    def on_step_end(self, step, lr):
        self.timed(self.writer.add_scalar, "train/lr", lr, step)

    def close(self):
        self.writer.close()


class WandbArm(NormsArm):
    name = "W&B offline"

    def open(self, model, opt, tokenizer, rows, folder):
        import wandb

        super().open(model, opt, tokenizer, rows, folder)
        self.run = wandb.init(project="sftaudit-shim-overhead", dir=folder, mode="offline")

    def begin_block(self, plan):
        # watch's hooks count calls from the watch on and log at the log_freq-th: re-armed per block,
        # they log at the block's last step, the histogram step of its plan (amortised at 1/HIST_EVERY).
        self.run.watch(self.model, log="all", log_freq=len(plan), idx=0)

    def end_block(self):
        self.run.unwatch(self.model)

    def on_backward(self, step, loss):
        self._row = self.timed(
            lambda: {
                "train/loss": loss.item(),
                **{f"grad_norm/{name}": n for (name, _), n in zip(self.named, self.norms())},
            }
        )

    def on_step_end(self, step, lr):
        self.timed(self.run.log, {**self._row, "train/lr": lr})  # commits the step's row (with watch's histograms)

    def close(self):
        self.run.finish()


def make_arm(name: str) -> Arm | None:
    if name in PROFILES:
        return SftauditArm(name)
    if name == "tensorboard":
        return TensorBoardArm()
    try:
        import wandb  # noqa: F401  (a benchmark-only dependency)
    except ImportError:
        print("W&B arm skipped: wandb is not importable (pip install wandb to run it)", flush=True)
        return None
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbArm()


def build_model(tokenizer, args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=-(-len(tokenizer) // 8) * 8,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        intermediate_size=args.intermediate,
        max_position_embeddings=max(512, args.seq),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    return model


def make_batches(tokenizer, rows: list[dict], batch: int, seq: int, count: int = 16) -> list[dict]:
    """`count` batches of `batch` rows padded to `seq` tokens (padding="max_length"): every step does the same work."""
    out = []
    for i in range(count):
        b = collate(tokenizer, rows[i * batch : (i + 1) * batch], max_length=seq)
        pad = (0, seq - b["input_ids"].shape[1])
        out.append(
            {
                "input_ids": F.pad(b["input_ids"], pad, value=tokenizer.pad_token_id),
                "attention_mask": F.pad(b["attention_mask"], pad, value=0),
                "labels": F.pad(b["labels"], pad, value=-100),
                "sample_ids": b["sample_ids"],
            }
        )
    return out


def clocks() -> tuple[float, float, float]:
    """Wall time, this thread's CPU time (the hooks run on the training thread: CPU time is not
    inflated by the thread waiting for a core on a shared machine) and its CPU time in the norm pass.
    A tuple: the arithmetic on them runs after the second reading, outside the timed call."""
    return time.perf_counter(), time.thread_time(), NORM_CPU_S[0]


def train_step(model, opt, batch: dict, arm: Arm | None, step: int) -> tuple[float, float]:
    """The step's wall time and the process's CPU time (every thread of this process: TensorBoard's
    writer thread is in it, W&B's service process is not)."""
    start, cpu = time.perf_counter(), time.process_time()
    if arm:
        arm.on_batch(step, batch)
    loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    loss.backward()
    if arm:
        arm.on_backward(step, loss)
    opt.step()
    if arm:
        arm.on_step_end(step, opt.param_groups[0]["lr"])
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, time.process_time() - cpu


def measure(arm: Arm, tokenizer, rows, batches: list[dict], args, rng: np.random.Generator) -> dict:
    base_class, shares = step_classes(arm.intervals)
    classes = list(shares)
    model = build_model(tokenizer, args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cycle = itertools.count()
    a, b_base, b_events, hooks = [], [], [], []
    step = 0  # the B arm's step numbers: they run on across its blocks, jumping to place the rarer steps
    with tempfile.TemporaryDirectory() as folder:
        arm.open(model, opt, tokenizer, rows, folder)
        for rep in range(-args.warmup_reps, args.reps):
            plan = [
                (step := next_step(arm.intervals, step, base_class), base_class) for _ in range(1 + args.base_steps)
            ]
            plan += [(step := next_step(arm.intervals, step, cls), cls) for cls in classes]
            for kind in rng.permutation(["A", "B"]):
                if kind == "A":
                    times = [train_step(model, opt, batches[next(cycle) % len(batches)], None, 0) for _ in plan]
                    if rep >= 0:
                        a.append(times[1:])
                    continue
                arm.begin_block(plan)
                times, hook = [], []
                for s, _ in plan:
                    arm.hook_s = np.zeros(3)
                    times.append(train_step(model, opt, batches[next(cycle) % len(batches)], arm, s))
                    hook.append(arm.hook_s)
                arm.end_block()
                if rep >= 0:
                    b_base.append(times[1 : 1 + args.base_steps])
                    b_events.append(times[1 + args.base_steps :])
                    hooks.extend(hook[1 : 1 + args.base_steps])
        arm.close()
    a, b_base, b_events, hooks = np.array(a), np.array(b_base), np.array(b_events), 1000 * np.array(hooks)
    out = {
        "hooks_cpu_ms": np.percentile(hooks[:, 1], [50, 10, 90]),
        "hooks_wall_ms": float(np.median(hooks[:, 0])),
        "norm_cpu_ms": float(np.median(hooks[:, 2])),
        "python_ms": float(np.median(hooks[:, 1] - hooks[:, 2])),  # per step, then the median
    }
    for clock, name in enumerate(("wall", "cpu")):  # the same statistics on each clock
        ta, tb, te = a[..., clock], b_base[..., clock], b_events[..., clock]
        r = rep_ratios(ta, tb, te, np.array([shares[c] for c in classes]))
        out[name] = {
            "a_ms": 1000 * np.median(ta.mean(axis=1)),
            "b_ms": 1000 * np.median(tb.mean(axis=1)),
            "per_step": median_ci(r["per_step"]),
            "probe_share": float(np.median(r["probe_share"])),
            "amortised": median_ci(r["amortised"]),
            "classes": [
                ("+".join(sorted(c)), shares[c], 1000 * float(np.median(te[:, j] - tb.mean(axis=1))))
                for j, c in enumerate(classes)
            ],
        }
    return out


def norm_pass_ms(model, batch: dict, repeats: int = 15) -> float:
    """Median CPU time of the per-step norm pass over one step's gradients: on a CPU it is compute
    the hooks wait for (on a GPU, kernels queued behind the step's), a floor under any arm's hooks."""
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        torch.stack(torch._foreach_norm(grads)).tolist()
        times.append(time.thread_time() - start)
    model.zero_grad(set_to_none=True)
    return 1000 * float(np.median(times))


def versions() -> str:
    out = [f"torch {torch.__version__}"]
    for name in ("transformers", "tensorboard", "wandb"):
        try:
            out.append(f"{name} {__import__(name).__version__}")
        except ImportError:
            out.append(f"{name} absent")
    return ", ".join(out) + f"; Python {platform.python_version()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--arms",
        nargs="+",
        help=f"profiles ({', '.join(PROFILES)}), tensorboard, wandb (default: all; "
        f"--quick: {DEFAULT_PROFILE}, tensorboard, wandb)",
    )
    p.add_argument("--reps", type=int, default=9, help="A/B repetitions per arm (after the warmup)")
    p.add_argument("--warmup-reps", type=int, default=1, help="repetitions run first and left out")
    p.add_argument("--base-steps", type=int, default=4, help="timed ordinary steps per block")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="the A/B order within each pair")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: default profile, tensorboard, wandb; 3 reps, 2 steps"
    )
    args = p.parse_args()
    started = time.time()
    if args.quick:
        args.reps, args.base_steps = 3, 2
    args.arms = args.arms or (
        [DEFAULT_PROFILE, "tensorboard", "wandb"] if args.quick else [*PROFILES, "tensorboard", "wandb"]
    )
    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer()
    rows = load_dataset()
    batches = make_batches(tokenizer, rows, args.batch, args.seq)
    model = build_model(tokenizer, args)
    params = list(model.parameters())
    c = model.config
    print(
        f"sftaudit shim overhead, interleaved A/B ({'--quick smoke run: too few repetitions to be evidence' if args.quick else 'benchmarks/shim_overhead.py'})"
    )
    print(
        f"model: LlamaForCausalLM from a config: hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
        f"{c.num_attention_heads} heads ({c.num_key_value_heads} kv), intermediate {c.intermediate_size}, "
        f"vocab {c.vocab_size}: {sum(x.numel() for x in params) / 1e6:.1f}M parameters in {len(params)} tensors; AdamW"
    )
    print(
        f"step: {args.batch} x {args.seq} tokens (rows padded to {args.seq}); torch threads {args.threads} "
        f"(torch.set_num_threads) on {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at start"
    )
    print(f"versions: {versions()}")
    print(
        f"protocol: per arm {args.warmup_reps} warmup + {args.reps} repetitions of an A and a B block in random order; "
        f"a block = 1 settling step + {args.base_steps} ordinary steps + 1 step of each rarer kind (B; A as many bare)"
    )
    print(
        f"TensorBoard, W&B: per-tensor gradient norms every step, histograms every {HIST_EVERY} steps "
        f'(the {DEFAULT_PROFILE} profile\'s grad_hist_every); W&B watch(log="all") also histograms the weights'
    )
    print(
        f"the per-tensor norm pass alone (one torch._foreach_norm over the gradients, as every arm computes it): "
        f"{norm_pass_ms(model, batches[0]):.2f} ms CPU warm; part of each arm's hooks (compute: on a GPU, kernels "
        f"queued behind the step's); the hooks' Python work is their CPU time less their time inside it"
    )
    print()
    rng = np.random.default_rng(args.seed)
    results = []
    print("wall time")
    print(
        f"{'arm':<26} {'A ms':>7} {'B ms':>7}  {'per step [95% CI]':<24} {'probes':>7}  "
        f"{'amortised [95% CI]':<24} hooks ms/step: CPU (p10-p90), wall; norm pass, Python work (CPU)"
    )
    for name in args.arms:
        arm = make_arm(name)
        if arm is None:
            continue
        r = measure(arm, tokenizer, rows, batches, args, rng)
        results.append((arm, r))
        h50, h10, h90 = r["hooks_cpu_ms"]
        print(
            f"{row(arm.name, r['wall'])} {h50:.2f} ({h10:.2f}-{h90:.2f}), {r['hooks_wall_ms']:.2f}; "
            f"{r['norm_cpu_ms']:.2f}, {r['python_ms']:.2f}",
            flush=True,
        )
    print("\nprocess CPU time (every thread of this process; W&B's service process not in it)")
    for arm, r in results:
        print(row(arm.name, r["cpu"]))
    print("\nrarer steps, wall: each kind's share of steps and its median excess over the arm's ordinary B step")
    for arm, r in results:
        parts = [
            f"{cls} {Fraction(share).limit_denominator(10_000)}: {ms:+.0f} ms"
            for cls, share, ms in r["wall"]["classes"]
        ]
        print(f"  {arm.name:<24} {'; '.join(parts)}")
    for arm, r in results:
        if isinstance(arm, SftauditArm) and arm.profile == DEFAULT_PROFILE:
            hi, cpu_hi, hooks = r["wall"]["amortised"][2], r["cpu"]["amortised"][2], r["hooks_cpu_ms"][0]
            work = r["python_ms"]
            print(
                f"\ngoal, {arm.name}: amortised upper bound {hi:.3f}x (CPU time {cpu_hi:.3f}x) vs 1.030x: "
                f"{'met' if hi <= 1.03 else 'missed'}; hooks' Python work {work:.2f} ms/step (CPU: hooks {hooks:.2f} "
                f"less the norm pass in them {r['norm_cpu_ms']:.2f}) vs 1 ms: {'met' if work <= 1 else 'missed'}"
            )
    print(f"\n{time.time() - started:.0f} s; load average {os.getloadavg()[0]:.1f} at the end")


def row(name: str, r: dict) -> str:
    (pm, plo, phi), (am, alo, ahi) = r["per_step"], r["amortised"]
    return (
        f"{name:<26} {r['a_ms']:>7.1f} {r['b_ms']:>7.1f}  {pm:.3f}x [{plo:.3f}, {phi:.3f}]{'':<4} "
        f"{r['probe_share']:>+7.2%}  {am:.3f}x [{alo:.3f}, {ahi:.3f}]{'':<4}"
    )


if __name__ == "__main__":
    sys.exit(main())
