"""Runs that had no shim: what a trainer left on disk, imported into the artifact format.

`trainer.import_run` reads a Hugging Face Trainer / TRL ``output_dir`` (``trainer_state.json``
logs, ``checkpoint-*/`` folders, the tokenizer saved with them) and writes the same
``RUN_DIR/sftaudit/rank-0/*.jsonl`` files the shim writes, with a manifest that says where
each kind of evidence came from and at which granularity. A training log kept per (re)start
(LLaMA-Factory's, TensorBoard's, ...) is read by a log source: one module of `sources` each,
found by content (`sources.find_log`). Nothing here needs torch.
"""

from .trainer import ensure_artifacts, import_run, is_trainer_output, recorded_by_shim

__all__ = ["ensure_artifacts", "import_run", "is_trainer_output", "recorded_by_shim"]
