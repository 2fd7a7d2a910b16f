"""Batch statistics: per micro-batch, shape, sample ids, lengths, padding and label counts, the rows kept
whole as evidence, and the model's own loss with its weight in the objective.

`capture` builds a micro-batch's device tensors (no host read); the recorder moves them with the rest
of the step in its one transfer, and `write` turns the host values into ``batches`` and ``samples``
records.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..core.artifacts import template_fingerprint
from .profiles import Schedule
from .sink import Sink

IGNORE_INDEX = -100
# Batch keys through which a loop hands the model per-sample boundaries (varlen / packed attention).
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_lens", "seq_idx", "block_mask")


class Batches:
    def __init__(self, tokenizer: Any, schedule: Schedule, sink: Sink):
        self._tokenizer = tokenizer
        self._schedule = schedule
        self._sink = sink
        self._template: tuple[Any, str | None] = (None, None)  # (template object, its fingerprint)
        self._bos: tuple[Any, int | None] = (None, None)  # ((length, template), BOS id)

    def capture(self, step: int, batch: Mapping[str, Any], micro: int, first_step: bool) -> dict:
        """One micro-batch's record in the making: its device tensors under ``parts``."""
        input_ids = batch["input_ids"]
        given = batch.get("attention_mask")
        # A 2-D padding mask; a 4-D or block mask carries sample boundaries (varlen), not padding.
        padding_mask = torch.is_tensor(given) and given.shape == input_ids.shape
        labels = batch.get("labels")
        trained = labels != IGNORE_INDEX if labels is not None else torch.zeros_like(input_ids, dtype=torch.bool)
        rows, length = input_ids.shape
        sample_ids = batch.get("sample_ids")
        keep_rows = self._rows_to_keep(step, rows, first_step)
        # Every per-row count is one sum over a stack of token flags, built from few kinds of op (ne, and): at
        # this size an op costs its first call's cold code, not its arithmetic. The host derives the rest.
        attended = given != 0 if padding_mask else torch.ones_like(input_ids, dtype=torch.bool)
        flags = [attended, trained, trained & attended]  # padding_trained = label_tokens - trained & attended
        names = ["attended", "label_tokens", "trained_attended"]
        bos = self._bos_token_id()
        if bos is not None:  # sequence starts: attended BOS tokens (a packed row holds one per sample)
            flags.append(attended & (input_ids != bos))  # bos_starts = attended - this
            names.append("attended_not_bos")
        flags = torch.stack(flags)
        # The per-row counts travel as one tensor (cat promotes the bool columns): fewer pieces at the transfer;
        # last, after the named rows, the first token's flags (attended, trained) as sums over one column.
        counts = [flags.sum(-1)]
        if padding_mask:  # lengths: the mask's sum (without one, every position: the host fills it in)
            counts.append(given.sum(-1).reshape(1, -1))
            names.append("lengths")
        positions = batch.get("position_ids")
        if torch.is_tensor(positions) and positions.shape[-1] == length:  # how often they restart at 0 (LOOP-16)
            positions = positions.reshape(-1, length).expand(rows, -1)
            counts.append((positions[:, 1:] == 0).sum(1).reshape(1, -1))
            names.append("position_resets")
        counts.append(flags[:2, :, :1].sum(-1))
        parts = {"row_counts": torch.cat(counts)}
        # Rows are kept whole as evidence on schedule; when no ids were given, a hash of the
        # row's attended tokens (padding dropped: -1) serves as its sample id.
        if sample_ids is None:
            parts["hashed_ids"] = input_ids.masked_fill(~attended, -1) if padding_mask else input_ids
        if keep_rows:
            parts["input_ids"] = input_ids
            parts["labels"] = (
                labels[:keep_rows] if labels is not None else torch.full_like(input_ids[:keep_rows], IGNORE_INDEX)
            )
            parts["attention_mask"] = given[:keep_rows] if padding_mask else attended[:keep_rows]
        if sample_ids is not None:
            sample_ids = [str(s) for s in (sample_ids.tolist() if torch.is_tensor(sample_ids) else sample_ids)]
        varlen = any(k in batch for k in VARLEN_KEYS) or (torch.is_tensor(given) and given.dim() == 4)
        return {
            "micro": micro,
            "shape": [rows, length],
            "sample_ids": sample_ids,
            "varlen": varlen,
            "keep_rows": keep_rows,
            "parts": parts,
            "row_counts": names,
            **self._tokenizer_state(),
        }

    def after_forward(self, m: dict, kwargs: Mapping[str, Any], output: Any) -> None:
        """The model's returned loss for micro-batch `m`, and (through a gradient hook on it)
        d(backpropagated objective)/d(that loss): its weight in what the optimizer minimised. A loop that
        computes its own loss from the per-token log-probabilities (TRL's fused LM head: the model's
        `loss` then never reaches backward) gives the weight through them: with every trained token
        weighted alike, d(objective)/d(loss) = -sum of the gradient on the trained tokens' log-probs x
        (the tokens the loss divides by) / (the trained tokens)."""
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if not torch.is_tensor(loss) or loss.numel() != 1:
            return
        parts = m["parts"]
        parts["model_loss"] = loss.detach()  # converted at the step's one transfer, with everything else
        items = kwargs.get("num_items_in_batch")  # HF: the loss is then a sum over this many tokens
        if items is not None:
            parts["num_items"] = items.detach() if torch.is_tensor(items) else torch.tensor(float(items))
        if loss.requires_grad:

            def weight(grad: torch.Tensor) -> None:
                parts["loss_weight"] = grad.detach()

            # On the node that made the loss (its one output's gradient): cheaper to register than a tensor hook.
            node, nr = loss.grad_fn, loss.output_nr
            if node is not None:
                node.register_prehook(lambda grads: weight(grads[nr]) if grads[nr] is not None else None)
            else:  # a leaf
                loss.register_hook(weight)
        log_probs = getattr(output, "log_probs", None)
        mask = getattr(output, "label_mask", None)
        if (
            torch.is_tensor(log_probs)
            and log_probs.requires_grad
            and torch.is_tensor(mask)
            and mask.shape == log_probs.shape
        ):
            trained = mask.sum().clamp(min=1)
            divides_by = parts.get("num_items", trained)

            def token_weight(grad: torch.Tensor) -> None:
                parts["loss_weight"] = -(grad.detach() * mask).sum() * divides_by / trained

            log_probs.register_hook(token_weight)

    def _bos_token_id(self) -> int | None:
        """The tokenizer's BOS id, looked up again only when its length or template changes (`_tokenizer_state`
        notices a swap): the property is a token-to-id conversion at every call."""
        tok = self._tokenizer
        if tok is None:
            return None
        key = (len(tok), getattr(tok, "chat_template", None))
        if self._bos[0] != key:
            self._bos = (key, getattr(tok, "bos_token_id", None))
        return self._bos[1]

    def _tokenizer_state(self) -> dict[str, Any]:
        """Cheap per-batch identity of the tokenizer (vocabulary size, chat template): a tokenizer
        or template swapped mid-run shows at the step it happened, not only at the next checkpoint."""
        tok = self._tokenizer
        if tok is None:
            return {"tokenizer_length": None, "template_fingerprint": None}
        template = getattr(tok, "chat_template", None)
        if template is not self._template[0]:  # hash only when the template object changes
            self._template = (template, template_fingerprint(template))
        return {"tokenizer_length": len(tok), "template_fingerprint": self._template[1]}

    def _rows_to_keep(self, step: int, rows: int, first_step: bool) -> int:
        """Rows kept whole as evidence: on the schedule, and every row of each segment's first step (a
        run's start or a resume), so a data bug present from the first batch is dated there in any profile."""
        if "samples" in self._sink.disabled:
            return 0
        if first_step:
            return rows
        every = self._schedule.samples_every
        return min(rows, self._schedule.samples_per_batch) if every and step % every == 0 else 0

    @staticmethod
    def unpack(micro: list[dict], values: dict) -> None:
        """Each micro-batch's per-row count columns as values of their own (lists of ints), and its target
        tokens. Plain Python from here on: at a few rows, each numpy call would cost more than its work."""
        for m in micro:
            key, names = m["micro"], m["row_counts"]
            counts = [[int(v) for v in row] for row in values[key, "row_counts"].tolist()]  # exact below 2**24
            values.update(zip([(key, name) for name in names], counts))
            attended, labelled = values.pop((key, "attended")), values[key, "label_tokens"]
            rows, length = m["shape"]
            values.setdefault((key, "lengths"), [length] * rows)  # no padding mask: every position attended
            first_attended, first_trained = counts[len(names)], counts[len(names) + 1]
            values[key, "padding_trained"] = [a - b for a, b in zip(labelled, values.pop((key, "trained_attended")))]
            if (key, "attended_not_bos") in values:
                values[key, "bos_starts"] = [a - b for a, b in zip(attended, values.pop((key, "attended_not_bos")))]
            values[key, "left_padded"] = [1 - v for v in first_attended]
            # A causal LM's shifted loss averages over the labels after the first.
            values[key, "target_tokens"] = [a - b for a, b in zip(labelled, first_trained)]

    @staticmethod
    def window_loss(micro: list[dict], values: dict, recorded: float | None) -> float | None:
        """The step's loss: the token mean of the model's own losses over the optimizer window when
        every micro-batch returned one. With gradient accumulation what each backward receives is a
        share of the objective (the loss / the accumulation steps, or a sum over the Trainer's
        `num_items_in_batch`), so the mean of those is 1/GA of the trained loss. Otherwise the mean
        of the recorded losses; a non-finite recorded loss (corrupted after the model) stays."""
        if not micro or (recorded is not None and not math.isfinite(recorded)):
            return recorded
        if any((m["micro"], "model_loss") not in values for m in micro):
            return recorded
        n = [sum(values[m["micro"], "target_tokens"]) for m in micro]
        # The model's loss is its summed token loss / num_items_in_batch when the Trainer passes it, else / n.
        summed = [
            float(values[m["micro"], "model_loss"]) * float(values.get((m["micro"], "num_items"), k))
            for m, k in zip(micro, n)
        ]
        # A micro-batch without target tokens adds nothing (its own mean is 0/0).
        trained = [(x, k) for x, k in zip(summed, n) if k > 0]
        return sum(x for x, _ in trained) / sum(k for _, k in trained) if trained else recorded

    def write(self, step: int, m: dict, values: dict) -> None:
        micro = m["micro"]
        rows, length = m["shape"]
        ids = m["sample_ids"]
        if ids is None:
            hashed = values[micro, "hashed_ids"].reshape(rows, length).astype("int64")
            ids = ["h:" + hashlib.blake2b(row[row >= 0].tobytes(), digest_size=8).hexdigest() for row in hashed]
        self._sink.write(
            "batches",
            {
                "step": step,
                "micro": micro,
                "rows": rows,
                "seq_len": length,
                "sample_ids": ids,
                "lengths": values[micro, "lengths"],
                "label_tokens": values[micro, "label_tokens"],
                "padding_trained": values[micro, "padding_trained"],
                "left_padded_rows": sum(values[micro, "left_padded"]),
                "target_tokens": values[micro, "target_tokens"],
                **{key: values[micro, key] for key in ("bos_starts", "position_resets") if (micro, key) in values},
                "varlen": m["varlen"],
                "attention_mask_kind": m.get("attention_mask_kind"),
                "cache_built": m.get("cache_built"),
                **{
                    key: float(values[micro, key])
                    for key in ("model_loss", "loss_weight", "num_items", "backprop")
                    if (micro, key) in values
                },
                "tokenizer_length": m["tokenizer_length"],
                "template_fingerprint": m["template_fingerprint"],
            },
        )
        keep = m["keep_rows"]
        if keep:
            full_ids = values[micro, "input_ids"].reshape(rows, length).astype("int64")
            labels = values[micro, "labels"].reshape(keep, length).astype("int64")
            mask = values[micro, "attention_mask"].reshape(keep, length).astype("int64")
            for r in range(keep):
                self._sink.write(
                    "samples",
                    {
                        "step": step,
                        "micro": micro,
                        "row": r,
                        "sample_id": ids[r],
                        "input_ids": full_ids[r].tolist(),
                        "labels": labels[r].tolist(),
                        "attention_mask": mask[r].tolist(),
                    },
                )


def attention_inputs(module, args, kwargs, output) -> dict:
    """What decides whether packed samples attend to each other in a transformers forward (LOOP-16): the
    attention mask handed to the model ("none", a 2-D "padding" mask, or a "custom" 4-D / block mask) and
    whether the forward built a KV cache. With a 2-D mask or a cache, sdpa and eager attention ignore
    position_ids restarts (masking_utils only reads them when both are absent). No tensor is read."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    kind = "none" if mask is None else "padding" if torch.is_tensor(mask) and mask.dim() == 2 else "custom"
    if isinstance(output, Mapping) and hasattr(type(output), "past_key_values"):  # a transformers ModelOutput
        # Its fields are keys only when not None; transformers 5 renamed past_key_values (which then warns).
        cache = ("cache" if hasattr(type(output), "cache") else "past_key_values") in output
    else:
        cache = kwargs.get("use_cache", getattr(getattr(module, "config", None), "use_cache", None))
    return {"attention_mask_kind": kind, "cache_built": cache}
