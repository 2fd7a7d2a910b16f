"""The artifact records, declared once: every record kind, each field's type, whether every record
carries it, who writes it, and what it means.

Ingest derives its columns from this (`sftaudit.store.rundb.RECORD_COLUMNS`), the shim's writer its file
names (`sftaudit.core.artifacts.RECORD_KINDS`), the dataset path its batch and sample columns, and
``docs/artifacts.md`` its tables (``scripts/gen_artifact_docs.py``); tests/test_record_schema.py
records real runs and fails on a key a writer emits that is not declared here, or a required one
it leaves out. Imported by both halves: no torch, no DuckDB.
"""

from __future__ import annotations

from dataclasses import dataclass

# Who writes records: the shim's Recorder (the plain loop, the Trainer callback, `sftaudit probe`),
# `sftaudit import` (a Trainer output trained without the shim), and the dataset path
# (`sftaudit preflight`, and `sftaudit import --data` for the batches, samples and render failures).
SHIM, IMPORT, DATASET = "shim", "import", "dataset"
ALL = (SHIM, IMPORT, DATASET)

# What an imported run's source can lack, as the manifest's `lacks` names it (kind -> why, in the source's words).
# A check lists the kinds it cannot judge without (`Check.source_needs`): it is then not_run with those words.
LACKS = {
    "grad_norm": "the gradient norm of each step",
    "micro_batch_loss": "the loss of each micro-batch",
    "collator": "the run's collator (packing or not)",
    "tokenizer": "a tokenizer sftaudit can load",
    "planned_length": "the run's planned length (max_steps, or epochs and steps per epoch)",
    "log_end": "the log up to where training stopped",
}


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # the DuckDB type ingest reads the JSON value as (JSON: kept as JSON text)
    doc: str
    writers: tuple[str, ...] = (SHIM,)
    required: bool = False  # every record its writers write carries the key (its value may be null)


@dataclass(frozen=True)
class RecordKind:
    name: str
    per: str  # one record per ...
    fields: tuple[Field, ...]
    # An import writes this kind as `<kind>.parquet` (a column per field it writes, of its type) rather than
    # JSONL: a per-step log of a long run gives millions of its records, which a typed column reads in a fraction
    # of the time JSON takes.
    columnar_import: bool = False

    def columnar_fields(self) -> tuple[Field, ...]:
        """The columns of an import's ``<kind>.parquet``, in their order: the fields an import writes."""
        return tuple(f for f in self.fields if IMPORT in f.writers)

    def names(self, writer: str | None = None, required: bool = False) -> list[str]:
        """The field names (those `writer` writes; only the required ones)."""
        return [f.name for f in self.fields if (writer is None or writer in f.writers) and (f.required or not required)]


def _seg(writers: tuple[str, ...] = ALL) -> Field:
    return Field(
        "seg",
        "INTEGER",
        "the segment: 0 for the first recorder on the rank folder, +1 at each restart (a resumed run)",
        writers,
        required=True,
    )


def _step(doc: str = "the optimizer step", writers: tuple[str, ...] = ALL, required: bool = True) -> Field:
    return Field("step", "BIGINT", doc, writers, required)


MANIFEST = RecordKind(
    "manifest",
    "recorder start (segment)",
    (
        Field(
            "schema_version",
            "INTEGER",
            "the artifact format's version (`sftaudit.core.artifacts.SCHEMA_VERSION`)",
            ALL,
            True,
        ),
        _seg(),
        Field("run_id", "VARCHAR", "the run's name (the run folder's, unless given)", ALL, True),
        Field("rank", "INTEGER", "this rank", ALL, True),
        Field("world_size", "INTEGER", "the number of ranks (null on an imported run)", ALL, True),
        Field(
            "profile",
            "VARCHAR",
            "the recording profile (`dev`, `preprod`, `prod`), or `imported`, `preflight`",
            ALL,
            True,
        ),
        Field(
            "schedule",
            "JSON",
            "the profile's intervals in optimizer steps (`sftaudit.shim.profiles.Schedule`; empty on an imported run)",
            (SHIM, IMPORT),
            True,
        ),
        Field(
            "started", "DOUBLE", "when the recorder started (seconds since 1970; null on an imported run)", ALL, True
        ),
        Field(
            "versions",
            "JSON",
            "versions of sftaudit, torch and the training libraries installed "
            "(an imported run: the transformers its config names)",
            (SHIM, IMPORT),
            True,
        ),
        Field(
            "unsupported_versions",
            "JSON",
            "the recording's libraries older than sftaudit supports: name -> `installed`, `oldest_supported` "
            "(empty: none)",
            (SHIM,),
            True,
        ),
        Field("instance_id", "VARCHAR", "a random id of this recorder (one per process and segment)", (SHIM,), True),
        Field("argv", "VARCHAR[]", "the command that ran, for `sftaudit replay`'s resume command", (SHIM,), True),
        Field(
            "orig_argv",
            "VARCHAR[]",
            "the command line as typed: the interpreter and its options (`python -m pkg.train`) before argv's "
            "arguments (Python's `sys.orig_argv`); `sftaudit replay` resumes with it",
        ),
        Field(
            "model",
            "JSON",
            "`class`, `config`, `tie_word_embeddings`, `generation_eos`, `attn_implementation`, `dropout`",
            ALL,
            True,
        ),
        Field(
            "params",
            "JSON[]",
            "the unique parameters in `named_parameters()` order (an imported run: the "
            "checkpoint's file order), each with the fields of the parameter table below",
            ALL,
            True,
        ),
        Field(
            "framework",
            "VARCHAR",
            "`plain`, `fsdp1`, `fsdp2`, `deepspeed`: where the shim read the local pieces (`sftaudit.shim.pieces`)",
            (SHIM,),
            True,
        ),
        Field("tied", "MAP(VARCHAR, VARCHAR)", "tied parameters: alias -> canonical name", (SHIM, IMPORT), True),
        Field(
            "grad_norm_source",
            "VARCHAR",
            "`pre_clip` or `post_clip`: what `steps.grad_norms` hold",
            (SHIM, IMPORT),
            True,
        ),
        Field(
            "grad_norm_read",
            "VARCHAR",
            "`on_backward`: where the loop called the recorder; `backward_end`: read by "
            "the shim at the end of the window's last backward pass, before the Trainer's clip, with the post-clip "
            "norms in `steps.grad_norms_post_clip`",
            (SHIM,),
            True,
        ),
        Field(
            "tokenizer",
            "JSON",
            "`fingerprint` (`v2:` and a hash of `identity`), `identity` (a hash per part of what the tokenizer is: "
            "vocabulary, merges, model, added_tokens, normalizer, pre_tokenizer, post_processor, decoder, "
            "special_tokens, chat_template; never its truncation or padding state), `class`, `length`, "
            "`special_tokens` {bos,eos,pad,unk: {token,id}}, "
            "`added_tokens`, `padding_side`, `truncation_side`, `chat_template` (null or empty: none given)",
            ALL,
            True,
        ),
        Field(
            "marker_rows",
            "JSON",
            "embedding and output row norms (and the median row norm) of the added tokens the "
            "chat template writes, at start (`ids`, `tokens`, `embed_norm`, `embed_median`, `embed_trainable`, "
            "`output_norm`, `output_median`, `output_trainable`); with a tokenizer, on a plain model",
            (SHIM,),
        ),
        Field(
            "dataset", "JSON", "`rows`, `fields`, `message_fields` of the training data (null: not given)", ALL, True
        ),
        Field("probe_prompts", "VARCHAR[]", "the probe prompts (`probes.prompt` indexes them)", (SHIM, IMPORT), True),
        Field("eval_set", "JSON[]", "the eval items: `id`, `messages`, `reference`", (SHIM, IMPORT), True),
        Field(
            "config",
            "JSON",
            "the run's configuration as given, with `max_steps` (the planned length) when the loop "
            "or the Trainer gave it and `resume_from` (an imported run's segment 1: the checkpoint on disk a resume "
            "can have started from)",
            (SHIM, IMPORT),
            True,
        ),
        Field(
            "param_norms", "DOUBLE[]", "float64 per-tensor weight norms of this rank's pieces at start", (SHIM,), True
        ),
        Field(
            "scheduler",
            "JSON",
            "when given: `class`, `state` (numeric state_dict), `lr_lambda` ({function, "
            "arguments} for a LambdaLR over a `functools.partial`), `lr` (the LR after 0, 1, 2, ... scheduler steps "
            "from `trace_start`, up to `config.max_steps` or the scheduler's horizon)",
            (SHIM,),
            True,
        ),
        Field(
            "optimizer",
            "JSON",
            "when given: the optimizer that updates the weights, read through its wrappers: `class`, `module`, "
            "`wrappers` (the wrappers' classes, outermost first: accelerate's `AcceleratedOptimizer`, DeepSpeed's "
            "ZeRO optimizers), `groups` (per parameter group: `lr`, `initial_lr`, `betas`, `eps`, `weight_decay`, "
            "... as the group has them, `params`, `numel`)",
            (SHIM,),
        ),
        Field(
            "loss_scaler",
            "JSON",
            "whether a step with non-finite gradients can have been skipped: `present`, `skips_nonfinite_steps`, "
            "and for a scaler found `class`, `source` (`recorder`: given as `grad_scaler`; `accelerate`: its "
            "optimizer wrapper's, the Trainer's fp16; `deepspeed`: its optimizer's overflow check), `enabled` "
            "(absent: not known, as in older recordings)",
            (SHIM,),
        ),
        Field("imported", "BOOLEAN", "true: written by `sftaudit import`", (IMPORT,), True),
        Field(
            "source",
            "VARCHAR",
            "where the history came from (`imported logs: trainer_state.json`, ...)",
            (IMPORT,),
            True,
        ),
        Field("granularity", "JSON", "`logging_steps`, `save_steps`, `eval_steps`", (IMPORT,), True),
        Field("sources", "JSON", "evidence kind -> where it came from", (IMPORT,), True),
        Field(
            "lacks",
            "JSON",
            "evidence the run's source cannot hold (a kind of `LACKS`: grad_norm, planned_length, ...) -> "
            "why, in words; the checks that need it report `not_run` with them",
            (IMPORT,),
            True,
        ),
        Field(
            "vocab_size",
            "BIGINT",
            "the vocabulary size from the model config, the checkpoint's embedding or the "
            "saved tokenizer (null: none of them)",
            (IMPORT,),
            True,
        ),
        Field("lfs_pointers", "VARCHAR[]", "log files that are Git LFS pointers", (IMPORT,), True),
        Field(
            "final_model",
            "JSON",
            "the model the Trainer saved into the output folder itself when training ended (`save_model`): "
            "`{step, files}`, its weight files at the folder's top (null: none there); judged for integrity as a "
            "checkpoint's weights are (LOOP-09), never a checkpoint to resume from or roll back to",
            (IMPORT,),
            True,
        ),
        Field(
            "notes",
            "JSON[]",
            "what the logs cannot show and what else the folder holds, once per run: `{key, text, ...}` under a "
            "stable `key`: `other_runs` (`runs`: other runs' checkpoints in the folder), `earlier_run_in_log` "
            "(another run's log before this one's), `lfs_pointers` (`files`), `nothing_logged`, "
            "`log_ends_at_checkpoint` (`checkpoint`), `logging_window` (`logging_steps`), `nan_inf_filter`, "
            "`no_grad_norm`, `no_evaluation`, `fp16_skipped_steps` (`checkpoints`)",
            (IMPORT,),
            True,
        ),
        Field(
            "import_notes",
            "VARCHAR[]",
            "the `notes`' texts, in order (the verdict's `resolution.notes`)",
            (IMPORT,),
            True,
        ),
        Field(
            "task",
            "JSON",
            "what the run trained: `kind` (`causal_lm`, `seq2seq`, `sequence_classification`, "
            "`token_classification`, `question_answering`, `multiple_choice`, `masked_lm`, `ctc`; null: unknown), "
            "`architecture`, `model_type`, `is_encoder_decoder`, `num_labels` / `labels` / `problem_type` (a "
            "classifier), `vocab_size`, `adapter` (PEFT `task_type`, `base_model`), `objective` (`dpo`, `orpo`, "
            "`kto`, `cpo`, `grpo`, `ppo`; null: supervised), `family` (`sft`, `preference`, `rl`) and "
            "`objective_keys` (the logged keys that named it)",
            (IMPORT,),
            True,
        ),
        Field(
            "selection",
            "JSON",
            "the metric the run chose its best checkpoint on, from trainer_state.json: `metric` (the eval key equal "
            "to `best_metric` at the best step; null: not told), `greater_is_better` (null: not told), "
            "`best_metric`, `best_global_step`, `best_model_checkpoint` (null: the run tracked no best metric)",
            (IMPORT,),
            True,
        ),
        Field(
            "preflight",
            "JSON",
            "the preflight's inputs: `data`, `tokenizer`, `template`, `collator`, `batch_size`, `max_length`",
            (DATASET,),
            True,
        ),
        Field(
            "preview", "JSON", "the rendered, tokenized and masked samples the dataset report shows", (DATASET,), True
        ),
    ),
)

# The entries of `manifest.params` (ingest reads them into the `params` table).
PARAM_FIELDS = (
    Field("name", "VARCHAR", "the parameter's name", ALL, True),
    Field("shape", "INTEGER[]", "its full shape, as a checkpoint of the whole model has it", ALL, True),
    Field("dtype", "VARCHAR", "its dtype", ALL, True),
    Field("numel", "BIGINT", "its number of elements", ALL, True),
    Field("requires_grad", "BOOLEAN", "trainable (null on an imported run: not on disk)", ALL, True),
    Field(
        "kind",
        "VARCHAR",
        "this rank's layout of it: `local` (one process); `replicated` (the rank holds the "
        "whole tensor, as every replica does: DDP, FSDP `NO_SHARD`); `sharded` (the rank holds `local_numel` of "
        "the `numel` elements); `partial` (a DTensor `Partial` placement, not reducible)",
    ),
    Field("start", "BIGINT", "a sharded piece's flattened range, when contiguous: first element"),
    Field("stop", "BIGINT", "... and the element after its last"),
    Field("local_numel", "BIGINT", "the elements this rank holds"),
    Field("replica", "INTEGER", "the replica group of a sharded piece; the rank for a replicated one"),
)

STEPS = RecordKind(
    "steps",
    "optimizer step",
    (
        _seg((SHIM, IMPORT)),
        _step(writers=(SHIM, IMPORT)),
        Field("time", "DOUBLE", "when the step's record was written (seconds since 1970)", (SHIM,), True),
        Field("dt", "DOUBLE", "seconds the step took (since the previous step's record)", (SHIM,), True),
        Field(
            "loss",
            "DOUBLE",
            "the step's loss: the mean over its micro-batches (an imported run: the Trainer's mean "
            "over the logging window)",
            (SHIM, IMPORT),
            True,
        ),
        Field("lr", "DOUBLE", "the learning rate", (SHIM, IMPORT), True),
        Field(
            "grad_norm",
            "DOUBLE",
            "the global L2 gradient norm of this rank's pieces (an imported run: the Trainer's "
            "pre-clip norm of the window's last step)",
            (SHIM, IMPORT),
            True,
        ),
        # Schema version 1 only: since version 2 the per-tensor norms are the `grad_norms` series (below).
        Field(
            "grad_norms",
            "DOUBLE[]",
            "schema version 1: per-tensor L2 norm of this rank's piece, aligned with "
            "`manifest.params`; null where a tensor had no gradient (version 2: the `grad_norms` series)",
            (),
        ),
        Field(
            "nonfinite_grads",
            "MAP(VARCHAR, BIGINT)",
            "{tensor: count of non-finite elements}; empty at a finite step",
            (SHIM,),
            True,
        ),
        Field("micro_batches", "INTEGER", "micro-batches in the step", (SHIM,), True),
        Field("tokens", "BIGINT", "attended tokens in the step", (SHIM,), True),
        # Under the Trainer: the norms after its clipping (grad_norms holds the pre-clip ones), and a step whose
        # norms could only be read after the clip.
        Field(
            "grad_norm_post_clip",
            "DOUBLE",
            "under the Trainer (`grad_norm_read: backward_end`): the global norm "
            "after its clip (what the optimizer stepped with)",
        ),
        Field(
            "grad_norms_post_clip",
            "DOUBLE[]",
            "schema version 1: ... and the per-tensor norms after it "
            "(version 2: `norm_post_clip` of the `grad_norms` series)",
            (),
        ),
        Field("grad_norm_source", "VARCHAR", "`post_clip` at a step whose norms could only be read after the clip"),
    ),
    columnar_import=True,
)

BATCHES = RecordKind(
    "batches",
    "micro-batch",
    (
        _seg((SHIM, DATASET)),
        _step(writers=(SHIM, DATASET)),
        Field(
            "micro",
            "INTEGER",
            "the micro-batch's index in the step (the dataset path: the batch number)",
            (SHIM, DATASET),
            True,
        ),
        Field("rows", "INTEGER", "rows in the batch", (SHIM, DATASET), True),
        Field("seq_len", "INTEGER", "the padded sequence length", (SHIM, DATASET), True),
        Field(
            "sample_ids",
            "VARCHAR[]",
            "per row, the id given by the batch, else `h:` + a hash of the row's attended input_ids (padding left out)",
            (SHIM, DATASET),
            True,
        ),
        Field("lengths", "INTEGER[]", "per row, the attention-mask sum", (SHIM, DATASET), True),
        Field("label_tokens", "INTEGER[]", "per row, positions with label != -100", (SHIM, DATASET), True),
        Field("padding_trained", "INTEGER[]", "per row, padding positions with a label", (SHIM, DATASET), True),
        Field("left_padded_rows", "INTEGER", "rows whose first position is padding", (SHIM, DATASET), True),
        Field(
            "tokenizer_length",
            "INTEGER",
            "`len(tokenizer)` when the batch was made (LOOP-02 compares it with the model's vocabulary)",
            (SHIM, DATASET),
            True,
        ),
        Field(
            "template_fingerprint",
            "VARCHAR",
            "a short hash of the chat template in use "
            "(`sftaudit.core.artifacts.template_fingerprint`; LOOP-01 compares it across the run)",
            (SHIM, DATASET),
            True,
        ),
        # Loss normalisation (LOOP-13).
        Field("target_tokens", "INTEGER[]", "per row, labels != -100 after the causal shift", (SHIM,), True),
        Field("model_loss", "DOUBLE", "the loss the model returned (when seen)"),
        Field(
            "loss_weight",
            "DOUBLE",
            "the gradient that reached `model_loss` in backward: its weight in the optimised objective (when seen)",
        ),
        Field(
            "num_items",
            "DOUBLE",
            "the Trainer's `num_items_in_batch`, when given: the model's loss is then a sum over that many tokens",
        ),
        Field("backprop", "DOUBLE", "the scalar given to `on_backward` (when seen)"),
        # Packing (LOOP-16).
        Field("bos_starts", "INTEGER[]", "per row, attended BOS tokens: one per packed sample"),
        Field(
            "position_resets",
            "INTEGER[]",
            "per row, positions > 0 where `position_ids` restart at 0; only when the batch gives `position_ids`",
        ),
        Field(
            "varlen",
            "BOOLEAN",
            "the batch gave per-sample boundaries: `cu_seq_lens_*`, `cu_seqlens`, `seq_lens`, "
            "`seq_idx`, `block_mask` or a 4-D attention mask",
            (SHIM,),
            True,
        ),
        Field(
            "attention_mask_kind",
            "VARCHAR",
            "the mask the model's forward got: `none`, `padding` (2-D) or `custom` "
            "(4-D, block mask or other); null unless the shim's forward hook saw that forward",
            (SHIM,),
            True,
        ),
        Field(
            "cache_built",
            "BOOLEAN",
            "that forward built a KV cache (the output carried one, else the effective "
            "`use_cache`); null as `attention_mask_kind`",
            (SHIM,),
            True,
        ),
    ),
)

SAMPLES = RecordKind(
    "samples",
    "evidence row (on the profile's schedule; every row of each segment's first step)",
    (
        _seg((SHIM, DATASET)),
        _step(writers=(SHIM, DATASET)),
        Field("micro", "INTEGER", "its micro-batch (`batches.micro`)", (SHIM, DATASET), True),
        Field("row", "INTEGER", "its row in the micro-batch", (SHIM, DATASET), True),
        Field("sample_id", "VARCHAR", "its id (as in `batches.sample_ids`)", (SHIM, DATASET), True),
        Field("input_ids", "INTEGER[]", "the row's token ids, padding included", (SHIM, DATASET), True),
        Field("labels", "INTEGER[]", "its labels (-100: not trained)", (SHIM, DATASET), True),
        Field("attention_mask", "INTEGER[]", "its attention mask", (SHIM, DATASET), True),
    ),
)

GRAD_HISTS = RecordKind(
    "grad_hists",
    "tensor at a histogram step",
    (
        _seg((SHIM,)),
        _step(writers=(SHIM,)),
        Field("tensor", "VARCHAR", "the parameter's name", (SHIM,), True),
        Field("reason", "VARCHAR", "`scheduled`, `nonfinite` or `spike`", (SHIM,), True),
        Field("zeros", "BIGINT", "elements exactly zero", (SHIM,), True),
        Field("nonfinite", "BIGINT", "elements NaN or infinite", (SHIM,), True),
        Field(
            "counts",
            "BIGINT[]",
            "log10|g| in half-decade bins from 1e-12 to 1e2 (`sftaudit.core.artifacts.GRAD_HIST_EDGES`)",
            (SHIM,),
            True,
        ),
    ),
)

PROBES = RecordKind(
    "probes",
    "probe prompt at a probe step",
    (
        _seg((SHIM,)),
        _step("the optimizer step (`sftaudit probe`: the checkpoint's, 0 for the base model)", (SHIM,)),
        Field("prompt", "INTEGER", "index into `manifest.probe_prompts`", (SHIM,), True),
        Field("entropy", "DOUBLE", "entropy of the next-token distribution (nats)", (SHIM,), True),
        Field("top_ids", "INTEGER[]", "its top-k token ids", (SHIM,), True),
        Field("top_probs", "DOUBLE[]", "... and their probabilities", (SHIM,), True),
    ),
)

GENERATIONS = RecordKind(
    "generations",
    "sampled generation",
    (
        _seg((SHIM,)),
        _step("the optimizer step (`sftaudit probe`: the checkpoint's)", (SHIM,)),
        Field("prompt", "INTEGER", "index into `manifest.probe_prompts`", (SHIM,), True),
        Field("sample", "INTEGER", "the sample's number for that prompt", (SHIM,), True),
        Field("text", "VARCHAR", "the generated text", (SHIM,), True),
        Field("new_tokens", "INTEGER", "tokens generated", (SHIM,), True),
        Field("stopped", "BOOLEAN", "it emitted eos", (SHIM,), True),
    ),
)

EVALS = RecordKind(
    "evals",
    "eval item at an eval step",
    (
        _seg((SHIM,)),
        _step("the optimizer step (`sftaudit probe`: the checkpoint's)", (SHIM,)),
        Field("item", "INTEGER", "index into `manifest.eval_set`", (SHIM,), True),
        Field("id", "VARCHAR", "the eval item's id", (SHIM,), True),
        Field("prediction", "VARCHAR", "the greedy generation", (SHIM,), True),
        Field("reference", "VARCHAR", "the item's reference answer", (SHIM,), True),
        Field("new_tokens", "INTEGER", "tokens generated", (SHIM,), True),
        Field("stopped", "BOOLEAN", "it emitted eos", (SHIM,), True),
    ),
)

# The logged keys a `steps` record holds as its own columns: an import writes them as the training log's `steps`
# record only (not a metric too: two copies of a million-step log), and the checks judge them there.
STEP_METRICS = ("loss", "grad_norm")

METRICS = RecordKind(
    "metrics",
    "logged scalar",
    (
        _seg((SHIM, IMPORT)),
        _step("the step it was logged at", (SHIM, IMPORT)),
        Field(
            "name",
            "VARCHAR",
            "the metric (e.g. the Trainer's pre-clip `grad_norm`, `eval_loss`); an import: every logged number but "
            "a training log's `loss` and `grad_norm`, which are its `steps` record's",
            (SHIM, IMPORT),
            True,
        ),
        Field("value", "DOUBLE", "its value", (SHIM, IMPORT), True),
    ),
    columnar_import=True,
)

CHECKPOINTS = RecordKind(
    "checkpoints",
    "saved checkpoint, then its hashes",
    (
        _seg((SHIM, IMPORT)),
        Field(
            "event",
            "VARCHAR",
            "`saved` (at the save), then `hashed` (when its files are hashed; the shim only); `kept` (the shim's "
            "guard, when it stopped the run: the last checkpoint before the first bad step, copied out of the "
            "trainer's rotation)",
            (SHIM, IMPORT),
            True,
        ),
        _step("the step it was saved at", (SHIM, IMPORT)),
        Field("path", "VARCHAR", "the checkpoint, relative to RUN_DIR", (SHIM, IMPORT), True),
        Field("files", "JSON", "`saved`: its files, [{name, bytes}]", (SHIM, IMPORT)),
        Field(
            "training_state",
            "JSON",
            "`saved`: an outline of the training state saved with it (scalars kept, tensors as {type, shape, dtype})",
            (SHIM, IMPORT),
        ),
        Field(
            "tokenizer_fingerprint",
            "VARCHAR",
            "`saved`: the tokenizer's fingerprint (as the manifest's `tokenizer.fingerprint`; one without the `v2:` "
            "prefix was recorded with the tokenizer's truncation and padding state)",
            (SHIM, IMPORT),
        ),
        Field("param_norms", "DOUBLE[]", "`saved`: float64 per-tensor weight norms of this rank's pieces"),
        Field(
            "param_fingerprints",
            "BIGINT[]",
            "`saved`: per tensor, the int64 sum of the bit patterns of this rank's "
            "piece: equal on replicas holding equal weights",
        ),
        Field(
            "time", "DOUBLE", "`saved`: when (seconds since 1970; an imported run: the folder's mtime)", (SHIM, IMPORT)
        ),
        Field("sha256", "JSON", "`hashed`: {file: hex digest}"),
        Field(
            "kept_path",
            "VARCHAR",
            "`kept`: where the guard kept it, relative to RUN_DIR (`sftaudit/kept/<name>`: hard links to its files)",
        ),
    ),
)

EVENTS = RecordKind(
    "events",
    "lifecycle event or error",
    (
        _seg(),
        Field(
            "kind",
            "VARCHAR",
            "`start`, `segment_start` (at a segment's first batch), `close` (the loop ended; none "
            "when the process was killed), `shim_error`, `probe_disabled`, `grad_hists_not_recorded` (a suspicious "
            "step whose gradients the optimizer step freed or changed before its histograms), `halted` (the guard "
            "stopped the run), `stop_request_ignored` (a stop request older than the segment, or not one); the "
            "dataset path: "
            "`render_failed`, `content_dropped`",
            ALL,
            True,
        ),
        Field("probe", "VARCHAR", "the component that failed or was switched off", (SHIM,)),
        _step("the step it happened at (`close`: the last recorded step)", (SHIM,), required=False),
        Field("time", "DOUBLE", "when (seconds since 1970; the dataset path: the failure's number)", ALL),
        Field(
            "error",
            "VARCHAR",
            "what went wrong (`close`: the exception that ended the loop, if one did; `stop_request_ignored`: why)",
            (SHIM, DATASET),
        ),
        Field("traceback", "VARCHAR", "`shim_error`: the traceback", (SHIM,)),
        Field(
            "halted",
            "JSON",
            "`halted`, and `close` of a run the guard stopped (never a complete run): {source (`nonfinite_loss`, "
            "`nonfinite_grad`, `skipped_steps`, `stop_request`), reason, step (where it stopped), anomaly_step (the "
            "first bad step, or null), code (a stop request's finding code), kept and kept_from (the kept copy of "
            "the last checkpoint before anomaly_step, and that checkpoint, relative to RUN_DIR)}",
            (SHIM,),
        ),
        Field("sample_id", "VARCHAR", "the dataset path: the sample that failed", (DATASET,)),
        Field("param_norms", "DOUBLE[]", "`segment_start`: float64 per-tensor weight norms", (SHIM,)),
        Field(
            "optimizer_step",
            "BIGINT",
            "`segment_start`: the Adam-style step count (0 if its state is empty, null if unknown)",
            (SHIM,),
        ),
    ),
)

# Every record kind, one file each, in ingest order (the manifests first: the other kinds refer to them).
RECORDS: dict[str, RecordKind] = {
    k.name: k
    for k in (MANIFEST, STEPS, BATCHES, SAMPLES, GRAD_HISTS, PROBES, GENERATIONS, EVALS, METRICS, CHECKPOINTS, EVENTS)
}


# The columnar series (schema version 2): Parquet parts under RUN_DIR/sftaudit/series/<name>/rank=<r>/seg=<s>/
# (the layout: `sftaudit.core.artifacts`); `rank` and `seg` are the hive partitions, not columns.
GRAD_NORM_SERIES = RecordKind(
    "grad_norms",
    "tensor with a gradient at an optimizer step (a Parquet row)",
    (
        Field("step", "BIGINT", "the optimizer step", (SHIM,), True),
        Field("idx", "INTEGER", "the tensor's index in that rank's `manifest.params`", (SHIM,), True),
        Field(
            "norm",
            "FLOAT",
            "the L2 norm of this rank's piece of the tensor's gradient (pre-clip under the Trainer; NaN and inf kept)",
            (SHIM,),
            True,
        ),
        Field(
            "norm_post_clip",
            "FLOAT",
            "the same after the Trainer's clip (null unless it was read: `manifest.grad_norm_read: backward_end`)",
            (SHIM,),
            True,
        ),
    ),
)
SERIES: dict[str, RecordKind] = {GRAD_NORM_SERIES.name: GRAD_NORM_SERIES}
