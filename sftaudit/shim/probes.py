"""Probes on the profile's schedule: next-token distributions on the probe prompts, sampled generations
on them, greedy generations on the eval set.

Each runs in eval mode, without gradients and with the training RNG untouched, on this rank's share of
the rows (data-parallel ranks probe in parallel). `PROBES` names them: the record kind each writes
(also its component name for the guard) and the method that computes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .pieces import Pieces
from .profiles import Schedule
from .sink import Sink

GENERATION_CHUNK = 32  # rows per generate() call: large eval sets are split to bound probe memory

Batch = tuple[torch.Tensor, torch.Tensor]  # left-padded input ids and attention mask


class Probes:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        schedule: Schedule,
        pieces: Pieces,
        sink: Sink,
        rank: int,
        world_size: int,
        probe_prompts: Sequence[str],
        eval_set: list[dict],
    ):
        self._model = model
        self._tokenizer = tokenizer
        self._schedule = schedule
        self._pieces = pieces
        self._sink = sink
        self._rank, self._world_size = rank, world_size
        self._eval_set = eval_set
        self.active = False  # while probing: the recorder's training hooks stand aside
        probe_inputs = self._encode_prompts([[{"role": "user", "content": p}] for p in probe_prompts])
        eval_inputs = self._encode_prompts([it["messages"] for it in eval_set])
        per_prompt = schedule.generations_per_prompt
        # Per probe kind: this rank's rows (global indices), their left-padded batch, its generate() calls.
        self._shares = {
            "probes": self._share(probe_inputs),
            "generations": self._share([p for p in probe_inputs for _ in range(per_prompt)]),
            "evals": self._share(eval_inputs),
        }
        s = schedule
        # When each is due: its interval, and whether it has prompts at all.
        self._every = {
            "probes": s.probe_every if probe_inputs else 0,
            "generations": s.generate_every if s.generations_per_prompt and probe_inputs else 0,
            "evals": s.eval_every if eval_inputs else 0,
        }
        self._ran: dict[str, int] = {}  # probe -> the last step it ran at

    def run(self, step: int, every_probe: bool = False) -> None:
        """The probes due at `step` (every one switched on, with `every_probe`: the run's end, a save), each
        under its own guard, none twice at one step."""
        due = [
            name
            for name, every in self._every.items()
            if every
            and (every_probe or step % every == 0)
            and self._ran.get(name) != step
            and name not in self._sink.disabled
            and self._shares[name][1] is not None
        ]
        if not due:
            return
        with self._probe_mode():
            for name in due:
                self._ran[name] = step
                with self._sink.guard(name, step):
                    for record in PROBES[name](self, step, *self._shares[name]):
                        self._sink.write(name, record)

    def _share(self, prompts: list[list[int]]) -> tuple[list[int], Batch | None, int]:
        """This rank's rows of a probe batch: every world_size-th from its rank, so data-parallel ranks
        probe in parallel, each writing its own rows (batch None: nothing to run). A sharded model's
        forward gathers its weights from every rank, so there every rank runs each probe the same
        number of times: one with no rows of its own runs row 0 and writes nothing, and generation is
        split into as many chunks as the largest share needs. Built once: the prompts never change."""
        rows = list(range(self._rank, len(prompts), self._world_size))
        largest = -(-len(prompts) // self._world_size)  # rows of the largest share (ceil)
        chunks = max(1, -(-largest // GENERATION_CHUNK))
        if not rows and self._pieces.shards_weights and prompts:
            return [], self._left_padded(prompts[:1]), chunks
        return rows, self._left_padded([prompts[i] for i in rows]) if rows else None, chunks

    @contextmanager
    def _probe_mode(self):
        """Eval mode, no grad, and the training RNG untouched: probing must not change the run."""
        was_training = self._model.training
        devices = [self._device().index] if self._device().type == "cuda" else []
        self.active = True
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                self._model.eval()
                yield
        finally:
            self._model.train(was_training)
            self.active = False

    def next_token(self, step: int, rows: list[int], batch: Batch, _chunks: int) -> list[dict]:  # one forward
        ids, mask = self._on_device(batch)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift the positions
        logp = torch.log_softmax(
            self._model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float(), dim=-1
        )
        entropy = -(logp.exp() * logp).sum(-1)
        top = logp.exp().topk(min(self._schedule.probe_top_k, logp.shape[-1]), dim=-1)
        probs, top_ids, entropy = (t.cpu().tolist() for t in (top.values, top.indices, entropy))
        return [
            {"step": step, "prompt": i, "entropy": entropy[k], "top_ids": top_ids[k], "top_probs": probs[k]}
            for k, i in enumerate(rows)
        ]

    def generations(self, step: int, rows: list[int], batch: Batch, chunks: int) -> list[dict]:
        n = self._schedule.generations_per_prompt
        torch.manual_seed(0)  # the same sampling noise at every step: differences are the model's
        texts, lengths, stopped = self._generate(batch, chunks, sample=True)
        return [
            {
                "step": step,
                "prompt": r // n,
                "sample": r % n,
                "text": texts[k],
                "new_tokens": lengths[k],
                "stopped": stopped[k],
            }
            for k, r in enumerate(rows)
        ]

    def evals(self, step: int, rows: list[int], batch: Batch, chunks: int) -> list[dict]:
        texts, lengths, stopped = self._generate(batch, chunks, sample=False)
        return [
            {
                "step": step,
                "item": i,
                "id": str(self._eval_set[i].get("id", i)),
                "prediction": texts[k],
                "reference": self._eval_set[i]["reference"],
                "new_tokens": lengths[k],
                "stopped": stopped[k],
            }
            for k, i in enumerate(rows)
        ]

    def _generate(self, batch: Batch, chunks: int, sample: bool) -> tuple[list[str], list[int], list[bool]]:
        """Batched generation on left-padded prompts, in `chunks` calls of at most GENERATION_CHUNK rows
        so a large eval set fits in memory; with sharded weights every rank generates to the last rank's
        last token (synced_gpus)."""
        tok = self._tokenizer
        eos = tok.eos_token_id
        texts, lengths, stopped = [], [], []
        sharded = self._pieces.shards_weights
        for ids, mask in zip(*(t.tensor_split(chunks) for t in self._on_device(batch))):
            with self._pieces.generation_context():
                out = self._model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=sample,
                    max_new_tokens=self._schedule.max_new_tokens,
                    pad_token_id=self._pad_id(),
                    eos_token_id=eos,
                    synced_gpus=sharded,  # every rank to the last token
                    **({"top_k": 0, "top_p": 1.0, "temperature": 1.0} if sample else {}),
                )[:, ids.shape[1] :].cpu()
            ended = (out == eos).any(1) if eos is not None else torch.zeros(len(out), dtype=torch.bool)
            length = torch.where(ended, (out == eos).int().argmax(1) + 1, out.shape[1]).tolist()
            texts += tok.batch_decode([row[:k] for row, k in zip(out, length)], skip_special_tokens=True)
            lengths += length
            stopped += ended.tolist()
        return texts, lengths, stopped

    def _left_padded(self, prompts: list[list[int]], repeat: int = 1) -> Batch:
        """Prompts as one left-padded batch (built once: the prompts never change)."""
        rows = [p for p in prompts for _ in range(repeat)]
        width = max((len(r) for r in rows), default=0)
        ids = torch.full((len(rows), width), self._pad_id() if rows else 0, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[r, width - len(row) :] = 1
        return ids, mask

    def _on_device(self, batch: Batch) -> Batch:
        device = self._device()
        return batch[0].to(device), batch[1].to(device)

    def _device(self) -> torch.device:
        return next((w.device for w in self._pieces.weights()[:1]), torch.device("cpu"))

    def _pad_id(self) -> int:
        tok = self._tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def _encode_prompts(self, conversations: list[list[dict]]) -> list[list[int]]:
        if not conversations:
            return []
        if self._tokenizer is None:
            self._sink.write("events", {"kind": "probe_disabled", "probe": "prompts", "error": "no tokenizer given"})
            return []
        with self._sink.guard("prompts"):
            return [
                list(
                    self._tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)[
                        "input_ids"
                    ]
                )
                for c in conversations
            ]
        return []


# Probe name (its record kind and guard component) -> the method computing its records at a step.
PROBES: dict[str, Callable[..., list[dict]]] = {
    "probes": Probes.next_token,
    "generations": Probes.generations,
    "evals": Probes.evals,
}
