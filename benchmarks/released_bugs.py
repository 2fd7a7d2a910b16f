"""Released library bugs, run as released: each case in its own side environment, then audited.

Each case pins the library versions its bug is bound to, installs just those wheels from the
package index (`pip install --no-deps --target` under a `tempfile.mkdtemp()`, removed afterwards)
and trains a tiny fixture model in a child process with `PYTHONPATH` set to that folder, so the
pinned packages shadow the main environment's while torch, numpy and sftaudit come from it. The
child records with `sftaudit.hf.SFTAuditCallback` (under the Trainer or TRL's SFTTrainer); this
process audits the run with the analyzer and prints one line per case: the versions the child
actually imported, the finding expected, what the audit said, PASS or MISS. A case whose
environment cannot be built or whose training fails prints why on its line and the rest go on.

    python benchmarks/released_bugs.py            # all cases
    python benchmarks/released_bugs.py ga-4.45    # one case

Not part of the test suite: it needs the package index and about a minute of CPU per case.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The Hugging Face stack of early 2025, which these transformers/TRL releases were built against
# (huggingface-hub < 1.0, and a datasets that imports with it).
HUB_STACK = ["huggingface-hub==0.36.0", "datasets==3.6.0", "dill==0.3.8", "multiprocess==0.70.16", "fsspec==2025.3.0"]

# packages: the pins of the side environment ([]: the main environment's current releases, the clean
# twins); expect: (code, severity, step, text in the message); absent: (code, severity) that must not appear.
CASES = {
    # Trainer before 4.46 averages each micro-batch's loss, then the micro-batches: rows with fewer
    # trained tokens weigh more than under one big batch (huggingface/trl#2175; fixed in 4.46).
    "ga-4.45": {
        "packages": ["transformers==4.45.2", "tokenizers==0.20.3"],
        "trainer": "trainer",
        "model": "llama",
        "expect": [("LOOP-13", "fail", 1, "")],
        "absent": [],
    },
    # 4.46.x passes num_items_in_batch to the model, which then returns the window's token mean, yet still
    # multiplies the loss by the accumulation steps before backward: the objective is GA (4) x the loss.
    "ga-4.46.3-gpt2": {
        "packages": ["transformers==4.46.3", "tokenizers==0.20.3"],
        "trainer": "trainer",
        "model": "gpt2",
        "expect": [("LOOP-13", "fail", 1, "4 x the trained loss")],
        "absent": [],
    },
    # TRL 0.16.1 renders `messages` with the template (which writes BOS), then tokenizes the text with
    # the tokenizer's special tokens (which prepends BOS again): two BOS (huggingface/trl#3328).
    "double-bos-trl-0.16.1": {
        "packages": ["trl==0.16.1", "transformers==4.50.3", "tokenizers==0.21.1"],
        "trainer": "trl",
        "model": "llama",
        "data": "messages",
        "expect": [("LOOP-02", "fail", 1, "two BOS")],
        "absent": [("LOOP-16", "fail")],
    },
    # 4.47.1 with a model whose forward takes no **kwargs (GPT-2) under gradient accumulation: the
    # logged loss is the accumulation steps (4) x the loss trained. The finding must name that scale.
    "ga-logged-4.47.1-gpt2": {
        "packages": ["transformers==4.47.1", "tokenizers==0.21.0"],
        "trainer": "trainer",
        "model": "gpt2",
        "expect": [("LOOP-13", "fail", 1, "x the trained loss")],
        "absent": [],
    },
    # Not version-bound: any TRL given a `text` column rendered by the template adds BOS again.
    "double-bos-text-trl-current": {
        "packages": [],
        "trainer": "trl",
        "model": "llama",
        "data": "text",
        "expect": [("LOOP-02", "fail", 1, "two BOS")],
        "absent": [("LOOP-16", "fail")],
    },
    # The clean twins on current releases: the same runs, bugs fixed upstream, must stay silent.
    "clean-ga-current": {
        "packages": [],
        "trainer": "trainer",
        "model": "llama",
        "expect": [],
        "absent": [("LOOP-13", "fail"), ("LOOP-13", "warn")],
    },
    "clean-ga-gpt2-current": {
        "packages": [],
        "trainer": "trainer",
        "model": "gpt2",
        "expect": [],
        "absent": [("LOOP-13", "fail"), ("LOOP-13", "warn")],
    },
    "clean-messages-trl-current": {
        "packages": [],
        "trainer": "trl",
        "model": "llama",
        "data": "messages",
        "expect": [],
        "absent": [("LOOP-02", "fail"), ("LOOP-16", "fail")],
    },
}

STEPS = 8
GRAD_ACCUM = 4
MICRO_BATCH = 2


# --------------------------------------------------------------------------- child (side environment)
def child(case: str, run_dir: Path) -> None:
    """Train the case's tiny run with the pinned libraries; print the versions imported as JSON."""
    import accelerate
    import tokenizers
    import torch
    import transformers
    from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset
    from transformers import Trainer, TrainingArguments

    from sftaudit.hf import SFTAuditCallback

    spec = CASES[case]
    versions = {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "accelerate": accelerate.__version__,
        "torch": torch.__version__,
    }
    if spec["trainer"] == "trl":
        import trl

        versions["trl"] = trl.__version__
    print("VERSIONS " + json.dumps(versions), flush=True)

    tokenizer = build_tokenizer()
    if spec["model"] == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=-(-len(tokenizer) // 8) * 8,
                n_positions=512,
                n_embd=64,
                n_layer=2,
                n_head=4,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    else:
        model = build_model(tokenizer)
    rows = load_dataset()[: STEPS * GRAD_ACCUM * MICRO_BATCH]
    common = {
        "output_dir": str(run_dir),
        "max_steps": STEPS,
        "per_device_train_batch_size": MICRO_BATCH,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "learning_rate": 3e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    callback = SFTAuditCallback(run_dir, dataset=rows)
    if spec["trainer"] == "trl":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        # The dataset as a TRL user passes it: conversations, or text already rendered by the template;
        # TRL tokenizes (and renders) it itself.
        dataset = Dataset.from_list(
            [
                {"messages": r["messages"]}
                if spec["data"] == "messages"
                else {"text": tokenizer.apply_chat_template(r["messages"], tokenize=False)}
                for r in rows
            ]
        )
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common, max_length=128),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[callback],
        )
    else:
        # The fixture's completion-only collator (template BOS only); the bug is the Trainer's loss.
        # The Trainer took the tokenizer as `tokenizer` before 4.46, as `processing_class` since.
        tokenizer_arg = (
            "processing_class" if "processing_class" in inspect.signature(Trainer).parameters else "tokenizer"
        )
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**common, remove_unused_columns=False),
            train_dataset=rows,
            data_collator=lambda feats: collate(tokenizer, feats, 128),
            callbacks=[callback],
            **{tokenizer_arg: tokenizer},
        )
    trainer.train()


# --------------------------------------------------------------------------- parent
def side_env(packages: list[str], target: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--disable-pip-version-check",
        "--target",
        str(target),
        *packages,
        *HUB_STACK,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError("pip: " + (proc.stderr.strip().splitlines() or ["failed"])[-1])


def run_case(name: str) -> str:
    spec = CASES[name]
    expected = ", ".join(
        f"{c} {s} at step {st}" + (f" saying '{say}'" if say else "") for c, s, st, say in spec["expect"]
    )
    expected = "; ".join([expected] * bool(expected) + [f"no {c} {s}" for c, s in spec["absent"]])
    tmp = Path(tempfile.mkdtemp(prefix="sftaudit-released-"))
    started = time.perf_counter()
    try:
        env_dir, run_dir = tmp / "env", tmp / "run"
        env = {
            **os.environ,
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        }
        env.pop("PYTHONPATH", None)
        if spec["packages"]:
            try:
                side_env(spec["packages"], env_dir)
            except Exception as exc:  # noqa: BLE001 - one case's environment must not stop the others
                return f"{name} | could not build its environment: {exc} | expected {expected} | SKIP"
            env["PYTHONPATH"] = str(env_dir)
        proc = subprocess.run(
            [sys.executable, __file__, "--child", name, str(run_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        versions = next(
            (json.loads(line[len("VERSIONS ") :]) for line in proc.stdout.splitlines() if line.startswith("VERSIONS ")),
            {},
        )
        shown = " ".join(f"{k} {v}" for k, v in versions.items()) or "not imported"
        pinned = {p.split("==")[0]: p.split("==")[1] for p in spec["packages"]}
        wrong = {k: v for k, v in versions.items() if k in pinned and pinned[k] != v}
        if wrong:
            return f"{name} | {shown} | pinned versions not the ones imported: {wrong} | expected {expected} | SKIP"
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return f"{name} | {shown} | training failed: {last} | expected {expected} | SKIP"

        from sftaudit.verdict.audit import audit

        verdict = audit(run_dir)
        findings = verdict["findings"]
        said, ok = [], True
        for code, severity, step, says in spec["expect"]:
            hits = [f for f in findings if f["code"] == code]
            said += [f"{f['code']} {f['severity']} step {f['step']}: {f['message'].split(' (')[0]}" for f in hits] or [
                f"no {code} finding"
            ]
            ok &= any(f["severity"] == severity and f["step"] == step and says in f["message"] for f in hits)
        # Silence proves nothing from a check that did not run on this run's evidence.
        status = {c["code"]: (c["status"], c["reason"]) for c in verdict["checks"]}
        for code, severity in spec["absent"]:
            bad = [f for f in findings if f["code"] == code and f["severity"] == severity]
            said += [f"{f['code']} {f['severity']} step {f['step']}" for f in bad] or [f"no {code} {severity}"]
            ran, reason = status.get(code, ("absent", None))
            if ran != "ran":
                said.append(f"{code} {ran}" + (f": {reason}" if reason else ""))
            ok &= not bad and ran == "ran"
        seconds = time.perf_counter() - started
        return (
            f"{name} | {shown} | expected {expected} | audit: {'; '.join(said)} "
            f"(verdict {verdict['verdict']}) | {'PASS' if ok else 'MISS'} | {seconds:.0f} s"
        )
    except subprocess.TimeoutExpired:
        return f"{name} | timed out | expected {expected} | SKIP"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="*", help=f"cases to run (default: all): {', '.join(CASES)}")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; known: {', '.join(CASES)}")
    for name in args.cases or CASES:
        print(run_case(name), flush=True)


if __name__ == "__main__":
    main()
