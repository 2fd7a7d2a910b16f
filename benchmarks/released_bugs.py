"""Released library bugs, run as released: each case in its own side environment, then audited.

Each case pins the library versions its bug is bound to, installs just those wheels from the
package index (`pip install --no-deps --target` under a `tempfile.mkdtemp()`, removed afterwards)
and trains a tiny fixture model in a child process with `PYTHONPATH` set to that folder, so the
pinned packages shadow the main environment's while torch, numpy and sftaudit come from it. The
child records with `sftaudit.hf.SFTAuditCallback` (under the Trainer or TRL's SFTTrainer); this
process audits the run with the analyzer and prints one line per case: the versions the child
actually imported, the finding expected, what the audit said, PASS or MISS. A case whose
environment cannot be built or whose training fails prints why on its line and the rest go on.

The `newcomer-*` cases are a newcomer's own TRL script as the docs describe it (a tiny Llama from a config,
a BPE tokenizer trained with ChatML markers, completion-only loss, checkpoints every 20 steps, the callback
with probe prompts and an eval set) on the oldest supported stack (TRL 0.11.4 / transformers 4.45.2) and the
current one: clean 20- and 80-step runs must PASS with their probes and evals recorded, the same at LR 0.3
must FAIL at the step the loss jumps with LOOP-22 naming the learning rate, pad == eos must fail at step 1.
A case may also expect a line on the child's stderr, the verdict, the first anomalous step and checks that
ran; `audit_in_side_env` audits in the side environment too (a transformers the analyzer does not support).

    python benchmarks/released_bugs.py            # all cases
    python benchmarks/released_bugs.py ga-4.45    # one case
    python benchmarks/released_bugs.py newcomer   # every case whose name starts so

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

OLDEST_STACK = ["trl==0.11.4", "transformers==4.45.2", "tokenizers==0.20.3"]
# The checks a newcomer's clean run must have judged on recorded evidence, probes and evals included.
NEWCOMER_RAN = ("LOOP-01", "LOOP-02", "LOOP-04", "LOOP-05", "LOOP-06", "LOOP-07", "LOOP-08", "LOOP-13", "LOOP-22")
# The step whose loss jumps at LR 0.3 (AdamW, no warmup: the first update wrecks the weights).
LR_JUMP_STEP = 2
for stack, packages in (("oldest", OLDEST_STACK), ("current", [])):
    for steps in (20, 80):
        CASES[f"newcomer-clean-{steps}-{stack}"] = {
            "packages": packages,
            "trainer": "newcomer",
            "steps": steps,
            "lr": 5e-4,
            "expect": [],
            "absent": [],
            "verdict": "pass",
            "ran": NEWCOMER_RAN,
        }
    CASES[f"newcomer-lr-0.3-{stack}"] = {
        "packages": packages,
        "trainer": "newcomer",
        "steps": 20,
        "lr": 0.3,
        "expect": [("LOOP-22", None, None, "0.3")],
        "absent": [],
        "verdict": "fail",
        "first_step": LR_JUMP_STEP,
    }
    # pad == eos: the oldest stack's collator (transformers' DataCollatorForLanguageModeling) masks every pad id
    # in the labels, so no end-of-turn marker is trained: fail at step 1. TRL 1.16's masks padding by position
    # and keeps the assistant's end marker trained: nothing to fail, and LOOP-02/04 must say so by running.
    CASES[f"newcomer-pad-eos-{stack}"] = {
        "packages": packages,
        "trainer": "newcomer",
        "steps": 20,
        "lr": 5e-4,
        "pad_is_eos": True,
        # A configuration (the collator masks the marker) found at step 1: it fails the run and dates no anomaly.
        **(
            {"expect": [("LOOP-04", "fail", 1, "")], "absent": [], "verdict": "fail", "first_step": None}
            if packages
            else {"expect": [], "absent": [("LOOP-02", "fail"), ("LOOP-04", "fail")], "verdict": "pass"}
        ),
    }
# transformers 4.44 is below the oldest supported release: the callback says so at start and records what it
# can (4.44 calls no on_pre_optimizer_step: no learning rate); audited there, the chat-template checks are not
# run, naming the version, and the rest judge the run: never "a bug in sftaudit".
CASES["unsupported-transformers-4.44.2"] = {
    "packages": ["transformers==4.44.2", "tokenizers==0.19.1"],
    "trainer": "trainer",
    "model": "llama",
    "expect": [],
    "absent": [],
    "stderr": "sftaudit: transformers 4.44.2 is older than 4.45, the oldest sftaudit supports",
    "audit_in_side_env": True,
    "not_run": {code: "transformers 4.44.2 is older than 4.45" for code in ("LOOP-01", "LOOP-02", "LOOP-04")},
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
    if spec["trainer"] == "newcomer":
        newcomer(spec, run_dir)
        return
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


# A ChatML template whose assistant turns are marked for completion-only loss ({% generation %}: TRL's
# assistant_only_loss); older TRL takes the assistant header as its collator's response template.
CHATML = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def newcomer(spec: dict, run_dir: Path) -> None:
    """A newcomer's TRL script, written from the docs: everything built locally, the callback added."""
    import inspect

    import tokenizers
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from sftaudit.fixtures import CORPUS_PATH, load_dataset, load_eval_set
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from sftaudit.hf import SFTAuditCallback

    print("VERSIONS " + json.dumps({"transformers": transformers.__version__, "trl": trl.__version__}), flush=True)
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    markers = ["<|im_start|>", "<|im_end|>", "<|pad|>"]
    bpe.train_from_iterator(
        [CORPUS_PATH.read_text(encoding="utf-8")],
        trainers.BpeTrainer(
            vocab_size=1024,
            special_tokens=markers,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>" if spec.get("pad_is_eos") else "<|pad|>",
        chat_template=CHATML,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=512,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    rows = [{"messages": r["messages"]} for r in load_dataset()]
    config = {
        "output_dir": str(run_dir),
        "max_steps": spec["steps"],
        "per_device_train_batch_size": 4,
        "learning_rate": spec["lr"],
        "logging_steps": 1,
        "save_steps": 20,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
    }
    options = {}
    if "assistant_only_loss" in inspect.signature(SFTConfig).parameters:
        config.update(max_length=128, assistant_only_loss=True)
        options["processing_class"] = tokenizer
    else:  # TRL before 0.19: the completion-only collator, on the template's assistant and user headers
        from trl import DataCollatorForCompletionOnlyLM

        config.update(max_seq_length=128)
        options["tokenizer"] = tokenizer
        options["data_collator"] = DataCollatorForCompletionOnlyLM(
            response_template="<|im_start|>assistant\n",
            instruction_template="<|im_start|>user\n",
            tokenizer=tokenizer,
        )
    trainer = SFTTrainer(model=model, args=SFTConfig(**config), train_dataset=Dataset.from_list(rows), **options)
    eval_set = [{"id": e["id"], "messages": e["messages"], "reference": e["reference"]} for e in load_eval_set()[:8]]
    trainer.add_callback(
        SFTAuditCallback(
            run_dir, probe_prompts=["What is the capital of France?", "How do I boil an egg?"], eval_set=eval_set
        )
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


def describe_expected(spec: dict) -> str:
    parts = [
        f"{c} {s or 'any severity'}"
        + (f" at step {st}" if st is not None else "")
        + (f" saying '{say}'" if say else "")
        for c, s, st, say in spec["expect"]
    ]
    parts += [f"no {c} {s}" for c, s in spec["absent"]]
    if "verdict" in spec:
        parts.append(
            f"verdict {spec['verdict']}"
            + (
                ""
                if "first_step" not in spec
                else " dating no anomaly (a configuration)"
                if spec["first_step"] is None
                else f" from step {spec['first_step']}"
            )
        )
    parts += [f"{c} not run saying '{why}'" for c, why in spec.get("not_run", {}).items()]
    parts += [f"{', '.join(spec['ran'])} ran"] if spec.get("ran") else []
    parts += [f"stderr saying '{spec['stderr']}'"] if spec.get("stderr") else []
    return "; ".join(parts)


def run_case(name: str, envs: Path | None = None) -> str:
    """Build the case's environment (reused from `envs` when given), train in a child, audit, judge."""
    spec = CASES[name]
    expected = describe_expected(spec)
    tmp = Path(tempfile.mkdtemp(prefix="sftaudit-released-"))
    started = time.perf_counter()
    try:
        run_dir = tmp / "run"
        env_dir = (envs / "-".join(sorted(spec["packages"]))) if envs else tmp / "env"
        env = {
            **os.environ,
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        }
        env.pop("PYTHONPATH", None)
        if spec["packages"]:
            if not (env_dir / ".complete").exists():
                try:
                    side_env(spec["packages"], env_dir)
                except Exception as exc:  # noqa: BLE001 - one case's environment must not stop the others
                    return f"{name} | could not build its environment: {exc} | expected {expected} | SKIP"
                (env_dir / ".complete").touch()
            env["PYTHONPATH"] = str(env_dir)
        proc = subprocess.run(
            [sys.executable, __file__, "--child", name, str(run_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
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
        verdict = audited(run_dir, env if spec.get("audit_in_side_env") else None)
        said, ok = judge(spec, verdict)
        if spec.get("stderr"):
            told = [line for line in proc.stderr.splitlines() if line.startswith(spec["stderr"])]
            said += told or [f"stderr lacks '{spec['stderr']}'"]
            ok &= len(told) == 1
        seconds = time.perf_counter() - started
        return (
            f"{name} | {shown} | expected {expected} | audit: {'; '.join(said)} "
            f"(verdict {verdict['verdict']}, first anomalous step {verdict['first_anomalous_step']}) | "
            f"{'PASS' if ok else 'MISS'} | {seconds:.0f} s"
        )
    except subprocess.TimeoutExpired:
        return f"{name} | timed out | expected {expected} | SKIP"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def audited(run_dir: Path, side_env: dict | None) -> dict:
    """The verdict: audited here, or in the side environment (`sftaudit audit` there, as its user would)."""
    if side_env is None:
        from sftaudit.verdict.audit import audit

        return audit(run_dir)
    out = run_dir.parent / "audit"
    cmd = [sys.executable, "-m", "sftaudit.cli", "audit", str(run_dir), "--no-report", "--out", str(out)]
    subprocess.run(cmd, env=side_env, capture_output=True, text=True, timeout=600, check=False)
    return json.loads((out / "verdict.json").read_text())


def judge(spec: dict, verdict: dict) -> tuple[list[str], bool]:
    """What the audit said about each expectation, and whether all were met."""
    findings = verdict["findings"]
    status = {c["code"]: (c["status"], c["reason"]) for c in verdict["checks"]}
    said, ok = [], True
    for code, severity, step, says in spec["expect"]:
        hits = [f for f in findings if f["code"] == code]
        said += [f"{f['code']} {f['severity']} step {f['step']}: {f['message'].split(' (')[0]}" for f in hits] or [
            f"no {code} finding"
        ]
        ok &= any(
            severity in (None, f["severity"]) and step in (None, f["step"]) and says in f["message"] for f in hits
        )
    # Silence proves nothing from a check that did not run on this run's evidence.
    for code, severity in spec["absent"]:
        bad = [f for f in findings if f["code"] == code and f["severity"] == severity]
        said += [f"{f['code']} {f['severity']} step {f['step']}" for f in bad] or [f"no {code} {severity}"]
        ran, reason = status.get(code, ("absent", None))
        if ran != "ran":
            said.append(f"{code} {ran}" + (f": {reason}" if reason else ""))
        ok &= not bad and ran == "ran"
    if "verdict" in spec:
        ok &= verdict["verdict"] == spec["verdict"]
        if verdict["verdict"] != spec["verdict"]:
            said += [f"{f['code']} {f['severity']} step {f['step']}: {f['message'][:160]}" for f in findings]
            said += [f"{e['code']} raised {e['error'][:160]}" for e in verdict.get("check_errors", [])]
    if "first_step" in spec:
        ok &= verdict["first_anomalous_step"] == spec["first_step"]
    for code, why in spec.get("not_run", {}).items():
        ran, reason = status.get(code, ("absent", None))
        said.append(f"{code} {ran}" + (f": {reason[:120]}" if reason else ""))
        ok &= ran == "not_run" and why in (reason or "")
    if spec.get("not_run"):
        ok &= not verdict.get("check_errors") and verdict["verdict"] != "unjudged"
    lacking = [
        f"{code} {status.get(code, ('absent', None))[0]}"
        for code in spec.get("ran", ())
        if status.get(code, ("",))[0] != "ran"
    ]
    said += lacking
    ok &= not lacking
    return said, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="*", help=f"cases to run (default: all): {', '.join(CASES)}")
    parser.add_argument(
        "--envs", type=Path, help="keep each side environment in this folder and reuse it (default: built per case)"
    )
    parser.add_argument("--child", nargs=2, metavar=("CASE", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    chosen = [c for prefix in args.cases for c in CASES if c == prefix or c.startswith(prefix)]
    unknown = [p for p in args.cases if not any(c == p or c.startswith(p) for c in CASES)]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; known: {', '.join(CASES)}")
    if args.envs:
        args.envs.mkdir(parents=True, exist_ok=True)
    for name in dict.fromkeys(chosen or CASES):
        print(run_case(name, args.envs), flush=True)


if __name__ == "__main__":
    main()
