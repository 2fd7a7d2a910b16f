"""An axolotl run: its YAML config (``config.yml``, or the copy axolotl writes into the model card
``<output_dir>/README.md``) and the Hugging Face Trainer output it names (``output_dir``, default
``./model-out``). axolotl trains with the Trainer, so the log is the Trainer's; the config is the plan.

The config's keys (axolotl 0.19's schema): ``max_steps``, ``num_epochs``, ``learning_rate`` (PyYAML reads ``2e-5``,
without a dot, as text), ``warmup_steps``, ``save_steps``, ``eval_steps``, ``logging_steps``, ``micro_batch_size``
(the per-device batch), ``output_dir``; ``base_model`` and ``datasets`` say it is axolotl's. axolotl never calls
``trainer.save_state()``: the only ``trainer_state.json`` are in ``<output_dir>/checkpoint-<N>/``, the newest holding
the history up to it; what was logged after the last checkpoint is lost. The history read is the newest state's (a
``trainer_state.json`` at the top of the output, where a script saved one, else the highest checkpoint's). The
checkpoints themselves stay the output folder's: auditing that folder checks them, its model card giving the plan.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ...core.safe_io import UnsafeFile, inside, read_text
from ..logs import number
from ..source import PLAN_KEYS, LogSource, SourceLog, numbers_only
from .trainer_state import TRAINER_STATE, TrainerState

MAX_CONFIG_BYTES = 1 << 20
DEFAULT_OUTPUT_DIR = "./model-out"
# The block axolotl writes into the model card.
CARD_CONFIG = re.compile(r"<summary>See axolotl config</summary>.*?```yaml\n(.*?)```", re.DOTALL)
# axolotl's names -> the Trainer's.
PLAN_NAMES = {
    "max_steps": "max_steps",
    "num_epochs": "num_train_epochs",
    "learning_rate": "learning_rate",
    "warmup_steps": "warmup_steps",
    "save_steps": "save_steps",
    "eval_steps": "eval_steps",
    "logging_steps": "logging_steps",
    "micro_batch_size": "train_batch_size",
}
LOGS_LOST = (
    "axolotl saves no trainer_state.json when training ends: what was logged after the last checkpoint "
    "(step {step}) is lost, so where training stopped is unknown"
)


class AxolotlConfig(LogSource):
    name = "axolotl"
    provenance = "imported logs: axolotl config and its output_dir's trainer_state.json"
    patterns = ("*.yml", "*.yaml", "*/*.yml", "*/*.yaml", "README.md")
    what = "the axolotl config"
    rank = 70

    def detect(self, path: Path) -> bool:
        """A YAML mapping with axolotl's ``base_model`` and ``datasets`` and a batch or length key, or a model card
        holding one."""
        return bool(_config(path))

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        path = files[0]
        config = _config(path.absolute(), run_dir)
        card = path.name == "README.md"  # the card lies in output_dir itself
        output = path.parent if card else path.parent / str(config.get("output_dir") or DEFAULT_OUTPUT_DIR)
        raw = {PLAN_NAMES[k]: v for k, v in config.items() if k in PLAN_NAMES}
        if isinstance(raw.get("learning_rate"), str):
            raw["learning_rate"] = number(raw["learning_rate"])  # "2e-5": text to PyYAML
        plan, ignored = numbers_only(raw, PLAN_KEYS)
        state, step = _newest_state(output, run_dir)
        log = TrainerState().read([state], run_dir) if state else None
        lacks = {}
        if log and step is not None and not (isinstance(plan.get("max_steps"), int) and step >= plan["max_steps"]):
            lacks["log_end"] = LOGS_LOST.format(step=step)
        return self.log(
            files[:1],
            run_dir,
            segments=log.segments if log else [],
            plan=plan,
            identity={
                "config": config,
                "model_config": None,
                "output_dir": str(config.get("output_dir") or DEFAULT_OUTPUT_DIR),
            },
            fields=log.fields if log else {},
            lacks=lacks,
            skipped=log.skipped if log else [],
            records=log.records if log else 0,
            ignored=ignored | (log.ignored if log else {}),
        )


def _config(path: Path, run_dir: Path | None = None) -> dict[str, Any]:
    """The axolotl config the file is or holds ({}: none)."""
    import yaml  # here, not at module level: the log-source registry imports every source, most runs have no YAML

    try:
        text = read_text(path, run_dir, MAX_CONFIG_BYTES)
    except UnsafeFile:
        return {}
    if path.name == "README.md":
        match = CARD_CONFIG.search(text)
        if not match:
            return {}
        text = match.group(1)
    try:
        config = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        return {}
    if not isinstance(config, dict) or not {"base_model", "datasets"} <= config.keys():
        return {}
    return config if config.keys() & {"micro_batch_size", "num_epochs", "max_steps", "sequence_len"} else {}


def _newest_state(output: Path, run_dir: Path) -> tuple[Path | None, int | None]:
    """The output's newest trainer_state.json: the top-level one (step None: the end of training), else the
    highest checkpoint's (and its step). None when the output is not inside the run or holds none."""
    try:
        inside(run_dir, output)
    except UnsafeFile:
        return None, None
    top = output / TRAINER_STATE
    if top.is_file():
        return top, None
    numbered = []
    for folder in output.glob("checkpoint-*"):
        match = re.fullmatch(r"checkpoint-(\d+)", folder.name)
        if match and (folder / TRAINER_STATE).is_file():
            numbered.append((int(match.group(1)), folder / TRAINER_STATE))
    if not numbered:
        return None, None
    step, path = max(numbered)
    return path, step
