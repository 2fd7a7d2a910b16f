"""LOOP-18 names the optimizer entries that shape alone leaves ambiguous by the weights' own movement: in a
real Trainer run without the shim whose output head gets zero gradients, the head's entry (all-zero moments)
is the tensor that never moved, not the input embedding of the same shape, which did."""

from __future__ import annotations

import pytest

from sftaudit.imports import import_run
from sftaudit.readers.optimizer_state import checkpoint_weights, map_names, read_adam_state
from sftaudit.verdict.audit import audit

from ..shared import shared_dir
from .dynamics_runs import of

VOCAB, HIDDEN = 531, 64  # untied: model.embed_tokens.weight and lm_head.weight are both [531, 64]


def _train(run_dir, zero_head: bool):
    """8 AdamW steps of a tiny untied Llama on random tokens, checkpoints every 4 (no sftaudit callback);
    with zero_head the head's gradient is zeroed before every optimizer step (a loss that never reaches it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    )
    rows = [{"input_ids": torch.randint(0, VOCAB, (32,)).tolist()} for _ in range(64)]

    def collate(batch):
        ids = torch.tensor([r["input_ids"] for r in batch])
        return {"input_ids": ids, "labels": ids.clone()}

    class ZeroHead(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if zero_head:
                model.lm_head.weight.grad.zero_()

    args = TrainingArguments(
        output_dir=str(run_dir),
        max_steps=8,
        save_steps=4,
        logging_steps=1,
        learning_rate=3e-3,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        save_strategy="steps",
    )
    Trainer(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[ZeroHead()]).train()
    return run_dir


@pytest.fixture(scope="module")
def head_runs(tmp_path_factory):
    names = {True: "zero-head", False: "clean"}
    base = shared_dir(
        tmp_path_factory, "loop18-names", lambda folder: [_train(folder / names[zero], zero) for zero in names]
    )
    return {zero: base / name for zero, name in names.items()}


def test_the_entry_that_never_updated_is_the_tensor_that_never_moved(head_runs):
    run = head_runs[True]
    state = read_adam_state(run / "checkpoint-8" / "optimizer.pt")
    weights, before = checkpoint_weights(run / "checkpoint-8"), checkpoint_weights(run / "checkpoint-4")
    same_shape = [i for i, e in state.entries.items() if e.exp_avg.shape == (VOCAB, HIDDEN)]
    assert len(same_shape) == 2
    names = map_names(state, weights, before)
    idle = next(i for i in same_shape if not state.entries[i].exp_avg_sq.any())
    assert names[idle] == "lm_head.weight"
    assert names[next(i for i in same_shape if i != idle)] == "model.embed_tokens.weight"  # by movement or elimination

    import_run(run)
    verdict = audit(run)
    never = [f for f in of(verdict, "LOOP-18") if "never updated" in f["message"]]
    assert len(never) == 1 and never[0]["severity"] == "fail"
    assert never[0]["evidence"]["tensors"] == [
        {"tensor": "lm_head.weight", "index": idle, "reason": "all-zero second moment", "step": 8.0}
    ]
    assert "lm_head.weight: all-zero second moment" in never[0]["message"]


def test_silent_when_every_tensor_trained(head_runs):
    run = head_runs[False]
    import_run(run)
    verdict = audit(run)
    assert not [f for f in of(verdict, "LOOP-18") if "never updated" in f["message"]], verdict["findings"]
