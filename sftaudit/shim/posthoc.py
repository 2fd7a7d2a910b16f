"""`sftaudit probe`: run the checkpoints a run left behind on probe prompts and an eval set, after the fact.

Each surviving ``checkpoint-N/`` (full weights, or a PEFT adapter applied to ``--base``) is loaded
on the CPU and probed by the shim's own probe code (a `Recorder` built on the loaded model, its
probes, generations and evals run once at step N); the base model, when given, is step 0. The
records are appended to the run's ``sftaudit/rank-0/{probes,generations,evals}.jsonl`` in the
artifact format, so LOOP-06/07/08 run at checkpoint granularity; the prompts and the eval set go
to ``sftaudit/posthoc.json``, which the import puts in the manifest. Resumable: a checkpoint whose
step already has probe records is skipped.

This is the training side (torch): the analyzer never imports it.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.artifacts import ARTIFACT_DIR, TOKENIZER_DIR, rank_dir
from ..core.safe_io import read_text
from ..core.tokenizer import load_saved_tokenizer
from ..errors import InputError
from .writer import read_jsonl

POSTHOC_FILE = "posthoc.json"
PROBE_KINDS = ("probes", "generations", "evals")


def probe_checkpoints(
    run_dir: str | Path,
    prompts: Sequence[str],
    eval_set: Sequence[dict[str, Any]] = (),
    base: str | Path | None = None,
    progress: bool = True,
    max_new_tokens: int = 32,
    generations_per_prompt: int = 4,
) -> list[dict[str, Any]]:
    """Probe every checkpoint not probed yet; returns [{step, checkpoint, seconds}] for those probed now."""
    from tqdm import tqdm

    run_dir = Path(run_dir)
    folder = rank_dir(run_dir, 0)
    done = {r["step"] for kind in PROBE_KINDS for r in read_jsonl(folder / f"{kind}.jsonl")}
    segments = {r["step"]: r.get("seg", 0) for r in read_jsonl(folder / "checkpoints.jsonl")}
    targets = ([(0, Path(base))] if base else []) + sorted(
        (int(m.group(1)), p)
        for p in run_dir.glob("checkpoint-*")
        if p.is_dir() and (m := re.fullmatch(r"checkpoint-(\d+)", p.name))
    )
    tokenizer = _tokenizer(run_dir, targets)
    timings = []
    for step, path in tqdm([t for t in targets if t[0] not in done], desc="probing checkpoints", disable=not progress):
        start = time.perf_counter()
        model = _load_model(path, base)
        records = _probe(model, tokenizer, step, prompts, eval_set, max_new_tokens, generations_per_prompt)
        for kind, rows in records.items():
            with open(folder / f"{kind}.jsonl", "a", encoding="utf-8") as f:
                f.writelines(json.dumps({**r, "seg": segments.get(step, 0)}) + "\n" for r in rows)
        timings.append(
            {"step": step, "checkpoint": path.name if step else "base", "seconds": time.perf_counter() - start}
        )
    (run_dir / ARTIFACT_DIR / POSTHOC_FILE).write_text(
        json.dumps(
            {
                "probe_prompts": list(prompts),
                "eval_set": [
                    {"id": str(it.get("id", i)), "messages": it["messages"], "reference": it["reference"]}
                    for i, it in enumerate(eval_set)
                ],
            }
        ),
        encoding="utf-8",
    )
    return timings


def _tokenizer(run_dir: Path, targets: list[tuple[int, Path]]) -> Any:
    for path in [run_dir / ARTIFACT_DIR / TOKENIZER_DIR] + [p for _, p in reversed(targets)]:
        if (path / "tokenizer_config.json").is_file():
            return load_saved_tokenizer(path)  # raises TokenizerRefused: remote code, or not whole
    raise InputError(f"{run_dir}: no saved tokenizer to render the probe prompts with")


def _load_model(path: Path, base: str | Path | None) -> Any:
    """A checkpoint's model in float32 on the CPU; a PEFT adapter is applied to the base model."""
    import torch
    from transformers import AutoModelForCausalLM

    if (path / "adapter_config.json").is_file():
        if base is None:
            raise InputError(f"{path.name} holds a PEFT adapter: give the base model with --base")
        base_model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, trust_remote_code=False)
        model = _with_adapter(base_model, path)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=False)
    return model.eval()


def _with_adapter(base_model: Any, path: Path) -> Any:
    """The base model with the checkpoint's PEFT adapter, from its JSON config and safetensors weights alone.
    PeftModel.from_pretrained falls back to a pickled adapter_model.bin and has no remote-code switch; an
    adapter is data, so nothing of the folder runs and nothing is unpickled."""
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise InputError(
            f"{path.name}: the adapter has no adapter_model.safetensors (a pickled adapter_model.bin is not loaded); "
            f"save it with safe_serialization=True"
        )
    settings = json.loads(read_text(path / "adapter_config.json", root=path))  # a regular file, bounded
    model = get_peft_model(base_model, PeftConfig.from_peft_type(**settings))
    set_peft_model_state_dict(model, load_file(str(weights)))
    return model


def _probe(
    model, tokenizer, step: int, prompts, eval_set, max_new_tokens: int, per_prompt: int
) -> dict[str, list[dict]]:
    """The shim's probes at one step, through a throwaway Recorder (its own files, then read back)."""
    from .recorder import Recorder

    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder(
            tmp,
            model,
            tokenizer,
            profile="dev",
            probe_prompts=prompts,
            eval_set=eval_set,
            probe_every=1,
            generate_every=1,
            eval_every=1,
            generations_per_prompt=per_prompt,
            max_new_tokens=max_new_tokens,
        )
        recorder.probes.run(step)  # the same code the shim runs during training
        recorder.close()
        folder = rank_dir(tmp, 0)
        errors = [e for e in read_jsonl(folder / "events.jsonl") if e.get("kind") == "shim_error"]
        if errors:
            raise RuntimeError(f"probing step {step} failed: {errors[0].get('probe')}: {errors[0].get('error')}")
        return {kind: read_jsonl(folder / f"{kind}.jsonl") for kind in PROBE_KINDS}
