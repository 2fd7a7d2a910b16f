"""Detection benchmark: fault shapes injected into clean real training logs, audited as a user audits them.

Each clean log below (real, uninstrumented runs in ``<repo>/../shared/realruns*``, chosen by reading them) is
imported once and rebuilt as a plain ``trainer_state.json``. Into a copy of it each fault shape is injected at a
seeded random position (15-80% into the log) and at several strengths; the copy is written to a temporary folder
and audited by the CLI in its own process (``python -m sftaudit.cli audit RUN --out OUT --no-report``), exactly
as the uninjected log is. Per shape and strength it prints the detection rate, the median latency from the fault
to the first finding (in steps and in logging windows) and the checks that found it; then the false-alarm rate
on the uninjected logs.

"Detected": a warn or fail finding at or after the fault's logging window (its step is that window's first step
or later) that the uninjected log does not have (same check, same step); for a fault injected into an evaluation
(an eval jump), its evaluation window (from the step after the evaluation before it), as finely as any check can
place it. Findings before the fault that the
clean log lacks are counted apart ("early"). A run without a known vocabulary is audited, clean and injected
alike, with a ``config.json`` of a 32,000-token model (the "plateau at chance" shape needs a chance level).

    python benchmarks/detection.py                                   # every shape, run, strength
    python benchmarks/detection.py --shapes spike,creep --runs alpaca-3ep --strengths 0,1
    python benchmarks/detection.py --list                            # the shapes, strengths and runs

This is a benchmark, not a test: about 700 audits, 2-5 s each on 2 cores; run it alone, with ``nice``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# `<repo>/../shared`; from a worktree one level deeper, the nearest `shared/` above the checkout.
SHARED = next((p / "shared" for p in REPO.parents if (p / "shared" / "realruns").is_dir()), REPO / ".." / "shared")
ASSUMED_VOCAB = 32000

# The clean logs: what an engineer reading them calls clean (a loss that falls and settles, nothing non-finite,
# no spike, jump, restart or rise), one line each on why. Not realruns/lf-qwen-medical-eval: its eval loss falls
# 1.641 -> 1.552 (step 4500, the end of epoch 2), jumps to 1.573 at the first evaluation of epoch 3 and stays at
# 1.576-1.578 to the end: a step of 0.021 where epoch 2's evaluations moved 0.002-0.007 apart, four evaluations
# in a row, the last adapter not the best (the third-epoch over-fit that benchmarks/real_runs_reading.toml reads
# it as, a warn): LOOP-26 finding it is right, not a false alarm. Nor realruns/gpt2-ja-tb: 100 epochs over 31
# samples, 0.47 at epoch 16 and 0.026 at epoch 32, memorised as the reading says (a warn), which LOOP-28 finds.
CLEAN = {
    "realruns/alpaca-3ep": "per-step SFT, 3 epochs: the loss falls and drops at each epoch boundary, nothing else",
    "realruns/chatglm2-ptuning": "P-tuning every 10 steps: 2.66 down to ~1.2 and flat, ordinary noise",
    "realruns/hf-baize-perstep": "6,687 per-step logs, loss 2.26 -> 0.09 with epoch drops; noisy per-step, no fault",
    "realruns/lf-luojiu-7b": "LLaMA-Factory, 1,742 logs: 1.75 -> ~1.37, flat and quiet",
    "realruns/lf-mistral-translator": "LLaMA-Factory, 866 logs: 2.5 -> 0.13, gradient norm calm after the start",
    "realruns/lf-nsllm": "LLaMA-Factory, 435 logs: 2.35 -> 1.97, a smooth converged plateau",
    "realruns/lf-orpo": "ORPO preference run, 33 logs: 1.05 -> ~0.1, noisy as preference losses are",
    "realruns/metamath-fullft": "full fine-tune, 128 per-step logs: 1.04 -> ~0.55, noisy per-step",
    "realruns/qlora-25ep-constlr": "QLoRA, 25 epochs at a constant LR: 5.5 -> 0.09, memorising smoothly",
    "realruns/trl-dpo-eval": "TRL DPO with 29 evals: 0.693 -> 0.33, eval 0.67 -> 0.51",
    "realruns/trl-tinyllama-eval": "TRL SFT with 14 evals: 2.08 -> 1.03, eval 1.62 -> 1.12",
    "realruns/whisper-tiny-100k": "Whisper, 2,000 logs and 100 evals over 100k steps: 2.9 -> 0.83, eval falling",
    "realruns/trl-dpo-ckpt-only": "TRL DPO, 200 per-step logs: 0.693 falling with DPO's heavy-tailed noise",
    "realruns2/alpaca-lora-bitcoin-ckpts": "LoRA, 30 logs and 6 evals: 3.24 -> 0.54, eval flat at 0.63",
    "realruns2/alpaca-lora-const-lr": "LoRA at a constant LR, 121 logs: 1.53 -> ~0.95, flat",
    "realruns2/chatglm3-lora-ckpt2000": "ChatGLM3 LoRA, 200 logs: 1.63 -> 0.38, gradient norm 2-10 throughout",
    "realruns2/cpt-seq2seq-predict-rows": "seq2seq, 10 logs every 500 steps and 10 evals: 1.14 -> 0.26",
    "realruns2/lf-tiny-9steps": "9 per-step logs: 3.34 -> 2.40, a short clean start",
    "realruns2/trl-sft-serverlog-3ckpt": "TRL SFT, 120 logs and 60 evals: 1.05 -> 0.06, eval 0.2 -> 0.03",
    "realruns2/unsloth-llama32-300": "Unsloth, 30 logs: 2.58 -> ~0.7 and flat",
    "realruns2/unsloth-max60-demo": "Unsloth demo, 60 per-step logs: 3.6 -> 2.2 with per-step noise",
    "realruns2/whisper-large-flemish-15k": "Whisper, 150 logs and 15 evals: 0.75 -> ~0.02, noisy low loss",
}


@dataclass
class Log:
    """A training log: per logged step loss, lr, grad_norm and other keys; evaluations; the planned length."""

    name: str
    steps: np.ndarray
    loss: np.ndarray
    lr: np.ndarray
    grad_norm: np.ndarray
    keys: dict[str, np.ndarray] = field(default_factory=dict)  # other per-step numbers (rewards/*, ...)
    eval_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, int))
    evals: dict[str, np.ndarray] = field(default_factory=dict)
    max_steps: int = 0
    config: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)  # logging_steps, train_batch_size, ...

    def copy(self) -> Log:
        return replace(
            self,
            steps=self.steps.copy(),
            loss=self.loss.copy(),
            lr=self.lr.copy(),
            grad_norm=self.grad_norm.copy(),
            keys={k: v.copy() for k, v in self.keys.items()},
            eval_steps=self.eval_steps.copy(),
            evals={k: v.copy() for k, v in self.evals.items()},
        )

    @property
    def preference(self) -> bool:
        return any(k.startswith(("rewards/", "logps/")) for k in self.keys)


# ---------------------------------------------------------------------------- reading and writing logs


def read_records(folder: Path, kind: str) -> list[dict]:
    """An imported rank's records of `kind` (steps, metrics), as the import wrote them: typed Parquet, or JSONL
    (none: no file)."""
    rows: list[dict] = []
    if (folder / f"{kind}.parquet").is_file():
        import pyarrow.parquet as pq

        rows += pq.read_table(folder / f"{kind}.parquet").to_pylist()
    if (folder / f"{kind}.jsonl").is_file():
        rows += [json.loads(line) for line in (folder / f"{kind}.jsonl").read_text().splitlines()]
    return rows


def read_log(run: Path) -> Log:
    """A clean run as the importer reads it (trainer_state.json, LLaMA-Factory's log, TensorBoard events)."""
    from sftaudit.core.artifacts import rank_dir
    from sftaudit.imports import import_run

    with tempfile.TemporaryDirectory(prefix="sftaudit-detect-read-") as tmp:
        copy = Path(tmp) / run.name
        shutil.copytree(run, copy, symlinks=True)
        for p in [copy, *copy.rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | 0o200)
        import_run(copy)
        folder = rank_dir(copy, 0)
        manifest = json.loads((folder / "manifest.jsonl").read_text().splitlines()[0])
        steps = read_records(folder, "steps")
        metrics = read_records(folder, "metrics")
    last = {}
    for s in steps:  # the run as it ended: a later segment's step replaces an earlier one's
        last[s["step"]] = s
    rows = [last[k] for k in sorted(last)]
    step = np.array([r["step"] for r in rows])

    def num(v):
        return np.nan if v is None else float(v)

    keys: dict[str, dict[int, float]] = {}
    evals: dict[str, dict[int, float]] = {}
    skip = {"loss", "learning_rate", "grad_norm", "epoch", "total_flos", "train_loss", "train_runtime"}
    for m in metrics:
        name = m["name"]
        if name in skip or name.endswith(("_runtime", "_per_second")):
            continue
        (evals if name.startswith("eval_") else keys).setdefault(name, {})[m["step"]] = m["value"]
    eval_steps = np.array(sorted({s for v in evals.values() for s in v}), dtype=int)
    model = manifest.get("model") or {}
    config = dict(model.get("config") or {})
    if not config.get("vocab_size") and not (config.get("text_config") or {}).get("vocab_size"):
        config["vocab_size"] = manifest.get("vocab_size") or ASSUMED_VOCAB
        config.setdefault("model_type", "llama")
    state = dict((manifest.get("config") or {}).get("trainer_state") or {})
    loss = np.array([num(r.get("loss")) for r in rows])
    # The Trainer logs round(loss, 4): an injected value is logged at the log's own precision, as a real one is.
    from sftaudit.checks.stats.rolling import log_quantum

    quantum = log_quantum(loss)
    state["loss_decimals"] = round(-np.log10(quantum)) if quantum > 0 else None
    return Log(
        name=run.name,
        steps=step,
        loss=loss,
        lr=np.array([num(r.get("lr")) for r in rows]),
        grad_norm=np.array([num(r.get("grad_norm")) for r in rows]),
        keys={k: np.array([v.get(int(s), np.nan) for s in step]) for k, v in keys.items() if len(v) >= len(step) // 2},
        eval_steps=eval_steps,
        evals={k: np.array([v.get(int(s), np.nan) for s in eval_steps]) for k, v in evals.items()},
        max_steps=int(step[-1]),
        config=config,
        state=state,
    )


def write_log(log: Log, run_dir: Path) -> Path:
    """`log` as a Trainer's output folder: trainer_state.json (NaN as the Trainer writes it) and config.json."""
    run_dir.mkdir(parents=True)
    history = []
    n = log.steps.size
    injected = set(log.state.get("nan_keys", ()))  # keys whose NaN the injection put there (else: not logged)
    norms = np.isfinite(log.grad_norm).any()
    decimals = log.state.get("loss_decimals")
    loss = np.round(log.loss, decimals) if decimals is not None else log.loss
    for i in range(n):
        entry = {"epoch": round(float(log.steps[i]) / max(log.max_steps, 1), 6), "loss": float(loss[i])}
        if np.isfinite(log.lr[i]):
            entry["learning_rate"] = float(log.lr[i])
        if norms:
            entry["grad_norm"] = float(log.grad_norm[i])
        entry |= {k: float(v[i]) for k, v in log.keys.items() if np.isfinite(v[i]) or k in injected}
        history.append(entry | {"step": int(log.steps[i])})
    for j, s in enumerate(log.eval_steps):
        entry = {"epoch": round(float(s) / max(log.max_steps, 1), 6)}
        entry |= {k: float(v[j]) for k, v in log.evals.items() if np.isfinite(v[j]) or k in injected}
        history.append(entry | {"eval_runtime": 1.0, "step": int(s)})
    history.sort(key=lambda e: (e["step"], "loss" not in e))
    state = {
        "global_step": int(log.steps[-1]),
        "max_steps": int(log.max_steps),
        "logging_steps": log.state.get("logging_steps") or (int(np.median(np.diff(log.steps))) if n > 1 else 1),
        "eval_steps": log.state.get("eval_steps"),
        "save_steps": log.state.get("save_steps"),
        "train_batch_size": log.state.get("train_batch_size"),
        "num_train_epochs": log.state.get("num_train_epochs") or 1,
        "epoch": 1.0,
        "log_history": history,
    }
    (run_dir / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")
    (run_dir / "config.json").write_text(json.dumps(log.config), encoding="utf-8")
    return run_dir


# ---------------------------------------------------------------------------- fault shapes


@dataclass(frozen=True)
class Shape:
    """A fault shape: `inject(log, row, strength, rng)` returns the injected log and the logged step the fault
    starts at (None: not applicable to this log); `strengths` with the ones an engineer sees by eye (`goal`)."""

    name: str
    inject: Callable
    strengths: tuple
    goal: tuple
    owner: str  # the checks meant to find it
    needs: Callable[[Log], bool] = lambda log: True
    at_evaluation: bool = False  # injected into evaluations: seen at the evaluation window that ends at the fault


def chance_of(log: Log) -> float:
    """The loss of a uniform guess for the log's model (as LOOP-20 reads config.json): ln K labels, else ln V."""
    config = log.config
    if any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return float(np.log(len(config.get("id2label") or {}) or config.get("num_labels") or 2))
    return float(np.log(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")))


def _spike(log, row, factor, rng):
    log.loss[row] *= factor
    return log, int(log.steps[row])


def _dip(log, row, factor, rng):
    log.loss[row] *= factor
    return log, int(log.steps[row])


def _trend(loss: np.ndarray) -> np.ndarray:
    """The clean log's own trend: the centred running median of log loss over a twentieth of the log (odd)."""
    x = np.log(np.where(loss > 0, loss, np.nan))
    half = max(1, loss.size // 40)
    padded = np.concatenate([np.full(half, np.nan), x, np.full(half, np.nan)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1)
    return np.exp(np.nanmedian(windows, axis=1))


def _frozen(log: Log, row: int) -> np.ndarray:
    """Per row from `row` on, the factor that holds the loss's trend at its level there (its noise kept): a
    creep or a rise is a climb from where the loss was, not a slower fall."""
    trend = _trend(log.loss)
    return np.where(np.arange(log.loss.size) >= row, trend[row] / trend, 1.0)


def _creep(log, row, factor, rng):
    """From the row the loss stops falling and creeps up to `factor` x its level there by the end."""
    t = np.arange(log.loss.size)
    ramp = np.clip((t - row) / max(log.loss.size - 1 - row, 1), 0, 1)
    log.loss *= _frozen(log, row) * np.exp(np.log(factor) * ramp)
    return log, int(log.steps[min(row + 1, log.steps.size - 1)])


def _lr_rise(log, row, factor, rng):
    """From the row the LR warms up again, x10 over a fifth of the rest of the run, and the loss rises with it from
    its level there to `factor` x that level, and stays up."""
    n = log.loss.size
    span = max(2, (n - row) // 5)
    ramp = np.clip((np.arange(n) - row) / span, 0, 1)
    base = np.where(np.isfinite(log.lr), log.lr, 0.0)
    peak = np.nanmax(base[: row + 1]) if np.isfinite(log.lr).any() else 1e-4
    log.lr = np.where(np.arange(n) >= row, np.maximum(base, peak) * (1 + 9 * ramp), log.lr)
    log.loss *= _frozen(log, row) * (1 + (factor - 1) * ramp)
    return log, int(log.steps[min(row + 1, log.steps.size - 1)])


def _chance(log, row, length, rng):
    n = log.loss.size
    end = n if length == "to the end" else min(n, row + int(length))
    log.loss[row:end] = chance_of(log) * np.exp(0.01 * rng.standard_normal(end - row))
    return log, int(log.steps[row])


def _nan_metric(log, row, count, rng):
    if log.preference:
        key = (
            "rewards/margins"
            if "rewards/margins" in log.keys
            else next(k for k in log.keys if k.startswith(("rewards/", "logps/")))
        )
        rows = sorted({min(row + 3 * k, log.loss.size - 1) for k in range(count)})
        log.keys[key][rows] = np.nan
        log.state = log.state | {"nan_keys": (key,)}
        return log, int(log.steps[rows[0]])
    j = int(np.searchsorted(log.eval_steps, log.steps[row]))
    if j >= log.eval_steps.size:
        return None, None
    rows = list(range(j, min(j + count, log.eval_steps.size)))
    log.evals["eval_loss"][rows] = np.nan
    log.state = log.state | {"nan_keys": ("eval_loss",)}
    return log, int(log.eval_steps[j])


def _zero(log, row, length, rng):
    n = log.loss.size
    end = n if length == "to the end" else min(n, row + int(length))
    log.loss[row:end] = 0.0
    return log, int(log.steps[row])


def _gn_spike(log, row, factor, rng):
    log.grad_norm[row] *= factor
    return log, int(log.steps[row])


def _eval_jump(log, row, factor, rng):
    j = int(np.searchsorted(log.eval_steps, log.steps[row]))
    if j >= log.eval_steps.size - 1:
        return None, None
    log.evals["eval_loss"][j:] *= factor
    return log, int(log.eval_steps[j])


def _scale(log, row, factor, rng):
    log.loss[row:] *= factor
    return log, int(log.steps[row])


def _restart(log, row, windows, rng):
    """The scheduler restarts at the row: the LR drops to 0 and warms up again over `windows` logged steps, then
    decays as it did from the start."""
    n = log.loss.size
    w = int(windows) if windows != "10%" else max(2, n // 10)
    rest = log.lr[: n - row].copy()
    peak = np.nanmax(log.lr)
    warm = peak * np.arange(w) / w
    log.lr[row:] = np.r_[warm, rest][: n - row]
    return log, int(log.steps[row])


def _stop(log, row, keep, rng):
    cut = max(2, int(round(log.loss.size * keep)))
    if cut >= log.loss.size:
        return None, None
    for name in ("loss", "lr", "grad_norm"):
        setattr(log, name, getattr(log, name)[:cut])
    log.keys = {k: v[:cut] for k, v in log.keys.items()}
    last = log.steps[cut - 1]
    log.steps = log.steps[:cut]
    inside = log.eval_steps <= last
    log.eval_steps = log.eval_steps[inside]
    log.evals = {k: v[inside] for k, v in log.evals.items()}
    return log, int(last)


def _glued(log, row, share, rng):
    """A second run appended after the row with the steps running on: the run's own first `share` again."""
    n = log.loss.size
    second = max(2, int(n * share))
    take = min(second, n - row - 1)
    if take < 2:
        return None, None
    for name in ("loss", "lr", "grad_norm"):
        values = getattr(log, name)
        values[row + 1 : row + 1 + take] = values[:take].copy()
    for v in log.keys.values():
        v[row + 1 : row + 1 + take] = v[:take].copy()
    return log, int(log.steps[row + 1])


def has_gn(log: Log) -> bool:
    return int(np.isfinite(log.grad_norm).sum()) >= 3


def has_evals(log: Log) -> bool:
    return "eval_loss" in log.evals and log.eval_steps.size >= 3


def decays(log: Log) -> bool:
    lr = log.lr[np.isfinite(log.lr)]
    return lr.size >= 4 and lr[-1] < 0.5 * lr.max()


SHAPES = [
    Shape("spike", _spike, (1.5, 2.0, 3.0, 5.0), (3.0, 5.0), "LOOP-10"),
    Shape("creep", _creep, (1.5, 2.0, 4.0), (2.0, 4.0), "LOOP-19", lambda log: log.loss.size >= 8),
    Shape("lr_rise", _lr_rise, (1.5, 2.0, 3.0), (2.0, 3.0), "LOOP-19", lambda log: log.loss.size >= 8),
    Shape("chance", _chance, (3, "to the end"), (3, "to the end"), "LOOP-20", lambda log: not log.preference),
    Shape("nan_metric", _nan_metric, (1, 3), (1, 3), "LOOP-25", lambda log: log.preference or has_evals(log)),
    Shape("zero_loss", _zero, (2, 3, "to the end"), (3, "to the end"), "LOOP-21"),
    Shape("gn_spike", _gn_spike, (5.0, 10.0, 20.0, 50.0), (20.0, 50.0), "LOOP-27", has_gn),
    Shape("eval_jump", _eval_jump, (1.2, 1.5, 2.0), (1.5, 2.0), "LOOP-26 / LOOP-10", has_evals, at_evaluation=True),
    Shape("scale_mismatch", _scale, (2.0, 4.0, 8.0), (4.0, 8.0), "LOOP-19 / LOOP-23"),
    Shape("scheduler_restart", _restart, (1, "10%"), (1, "10%"), "LOOP-14 / LOOP-10", decays),
    Shape("stopped_early", _stop, (0.5, 0.8), (0.5, 0.8), "LOOP-24"),
    Shape("glued", _glued, (0.3, 0.6), (0.3, 0.6), "runs in a folder / LOOP-19"),
    Shape("dip", _dip, (0.5,), (), "control: never a finding"),
]


# ---------------------------------------------------------------------------- auditing


def audit(log: Log, timeout: float) -> list[dict] | None:
    """The warn/fail findings of the CLI's audit of `log` (None: no verdict)."""
    with tempfile.TemporaryDirectory(prefix="sftaudit-detect-") as tmp:
        run = write_log(log, Path(tmp) / log.name)
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "sftaudit.cli", "audit", str(run), "--out", str(out), "--no-report"]
        try:
            subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            verdict = json.loads((out / "verdict.json").read_text(encoding="utf-8"))
        except (subprocess.TimeoutExpired, OSError, ValueError):
            return None
    return [
        {"code": f["code"], "severity": f["severity"], "step": f["step"]}
        for f in verdict["findings"]
        if f["severity"] in ("warn", "fail")
    ]


def window_start(steps: np.ndarray, step: int) -> int:
    """The first step of the window (logging or evaluation, as `steps` are) that holds `step`."""
    i = int(np.searchsorted(steps, step))
    return int(steps[i - 1]) + 1 if 0 < i <= steps.size else 1


def judge(clean: list[dict], found: list[dict], log: Log, fault_step: int, at_evaluation: bool = False) -> dict:
    """Whether the fault was detected, by which checks, and how late. A fault injected into an evaluation can be
    placed no closer than the evaluation window that ends at it (from the step after the evaluation before)."""
    known = {(f["code"], f["step"]) for f in clean}
    new = [f for f in found if (f["code"], f["step"]) not in known]
    start = window_start(log.eval_steps if at_evaluation else log.steps, fault_step)
    after = sorted((f for f in new if f["step"] is not None and f["step"] >= start), key=lambda f: f["step"])
    run_level = [f for f in new if f["step"] is None]
    early = [f for f in new if f["step"] is not None and f["step"] < start]
    if after:
        first = after[0]
        windows = int(np.searchsorted(log.steps, first["step"]) - np.searchsorted(log.steps, start))
        return {
            "detected": True,
            "codes": sorted({f["code"] for f in after}),
            "steps": first["step"] - start,
            "windows": max(windows, 0),
            "early": bool(early),
        }
    if run_level:
        return {
            "detected": True,
            "codes": sorted({f["code"] for f in run_level}),
            "steps": None,
            "windows": None,
            "early": bool(early),
        }
    return {"detected": False, "codes": [], "steps": None, "windows": None, "early": bool(early)}


def seed_of(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", help="comma-separated shape names (default: all)")
    parser.add_argument("--runs", help="comma-separated run names (default: all clean runs)")
    parser.add_argument("--strengths", help="comma-separated strength indices per shape (default: all)")
    parser.add_argument("--positions", type=int, default=1, help="random positions per run, shape and strength")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--list", action="store_true", help="list the shapes, strengths and clean runs")
    args = parser.parse_args()
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes.split(",")]
    if args.list:
        for s in SHAPES:
            print(f"{s.name:<18} strengths {s.strengths} (goal {s.goal}) - {s.owner}")
        for name, why in CLEAN.items():
            print(f"{name:<42} {why}")
        return 0
    runs = [r for r in CLEAN if not args.runs or Path(r).name in args.runs.split(",")]
    missing = [r for r in runs if not (SHARED / r).is_dir()]
    if missing:
        print(f"{SHARED}: {', '.join(missing)} not found", file=sys.stderr)
        return 2
    picked = [int(i) for i in args.strengths.split(",")] if args.strengths else None
    logs = {r: read_log(SHARED / r) for r in runs}
    clean, results = {}, []
    for r, log in logs.items():
        clean[r] = audit(log, args.timeout)
        print(f"clean {log.name:<32} {len(clean[r] or [])} warn/fail: {clean[r]}", flush=True)
    for shape in shapes:
        for si, strength in enumerate(shape.strengths):
            if picked is not None and si not in picked:
                continue
            for r, log in logs.items():
                if clean[r] is None or not shape.needs(log):
                    continue
                for k in range(args.positions):
                    # One position per shape, run and draw whatever the strength: the strengths' rows compare.
                    rng = np.random.default_rng(seed_of(args.seed, shape.name, r, k))
                    n = log.loss.size
                    lo, hi = max(1, int(0.15 * n)), max(2, int(0.8 * n))
                    row = int(rng.integers(lo, hi)) if hi > lo else lo
                    injected, fault = shape.inject(log.copy(), min(row, n - 1), strength, rng)
                    if injected is None:
                        continue
                    found = audit(injected, args.timeout)
                    if found is None:
                        continue
                    result = {
                        "shape": shape.name,
                        "strength": strength,
                        "goal": strength in shape.goal,
                        "run": r,
                        "row": row,
                        "fault_step": fault,
                    } | judge(clean[r], found, injected, fault, shape.at_evaluation)
                    results.append(result)
                    print(json.dumps(result), flush=True)
    print(table(results, shapes, clean))
    if args.json:
        args.json.write_text(json.dumps({"clean": clean, "results": results}, indent=1))
    return 0


def table(results: list[dict], shapes: list[Shape], clean: dict) -> str:
    lines = [
        "| shape | strength | runs | detected | median latency (steps / windows) | found by | early | meant for |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape in shapes:
        for strength in shape.strengths:
            rs = [r for r in results if r["shape"] == shape.name and r["strength"] == strength]
            if not rs:
                continue
            hit = [r for r in rs if r["detected"]]
            steps = [r["steps"] for r in hit if r["steps"] is not None]
            windows = [r["windows"] for r in hit if r["windows"] is not None]
            codes: dict[str, int] = {}
            for r in hit:
                for c in r["codes"]:
                    codes[c] = codes.get(c, 0) + 1
            by = ", ".join(f"{c} {n}" for c, n in sorted(codes.items(), key=lambda kv: -kv[1])[:3])
            latency = f"{np.median(steps):.0f} / {np.median(windows):.0f}" if steps else "-"
            goal = " (goal)" if strength in shape.goal else ""
            lines.append(
                f"| {shape.name} | {strength}{goal} | {len(rs)} | {len(hit) / len(rs):.0%} | {latency} | {by or '-'} | "
                f"{sum(r['early'] for r in rs)} | {shape.owner} |"
            )
    judged = [v for v in clean.values() if v is not None]
    alarms = sum(bool(v) for v in judged)
    lines.append("")
    lines.append(
        f"False alarms on the uninjected logs: {alarms} of {len(judged)} ({alarms / max(len(judged), 1):.0%})."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
