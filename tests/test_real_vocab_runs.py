"""Recorded runs on released vocabularies and chat templates: clean multi-turn chats (with and without
system prompts, English and Chinese) trained through a plain loop (Recorder), the Trainer and TRL's
SFTTrainer (SFTAuditCallback), each with a tiny model built from a config whose vocabulary is the real
tokenizer's, give no warn or fail from LOOP-01..04 and no failing check at all.

The runs are two steps of a one-layer model with a hidden size of 16 (the logits over a 128k-151k
vocabulary are what costs): enough to record batches, samples, the tokenizer and the model's marker
rows the way a real run does."""

from __future__ import annotations

import copy

import pytest
import torch

from sftaudit.verdict.audit import audit

from .corpus import CLEAN_CHATS, real_tokenizer, template, tokenizer_cache
from .test_corpus import incremental_collator

pytestmark = pytest.mark.slow  # Trainer / TRL runs on released vocabularies

STEPS, BATCH = 2, 2
QUIET = dict(probe_every=0, generate_every=0, eval_every=0)  # no probes: the data layer is under test
ROWS = [{"id": f"chat-{i}", "messages": chat} for i, chat in enumerate(CLEAN_CHATS)]  # STEPS x BATCH


def released(family: str, name: str):
    tokenizer = copy.deepcopy(real_tokenizer(family, tokenizer_cache()))
    tokenizer.chat_template = template(name)
    return tokenizer


def tiny_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def collate(tokenizer, rows):
    """A correct assistant-only collator (each assistant turn trained through its end-of-turn marker)."""
    batch = {k: torch.as_tensor(v, dtype=torch.long) for k, v in incremental_collator(tokenizer, rows).items()}
    return {**batch, "sample_ids": [row["id"] for row in rows]}


def train_plain(run_dir, tokenizer):
    from sftaudit.shim import Recorder

    model = tiny_model(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recorder = Recorder(
        run_dir,
        model,
        tokenizer,
        dataset=ROWS,
        optimizer=optimizer,
        config={"lr": 1e-3, "batch_size": BATCH, "max_steps": STEPS},
        **QUIET,
    )
    try:
        for step in range(1, STEPS + 1):
            batch = collate(tokenizer, ROWS[(step - 1) * BATCH : step * BATCH])
            recorder.on_batch(step, batch)
            loss = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
            ).loss
            loss.backward()
            recorder.on_backward(step, loss)
            optimizer.step()
            recorder.on_step_end(step, lr=1e-3)
            optimizer.zero_grad(set_to_none=True)
    finally:
        recorder.close()


def train_hf(run_dir, tokenizer, trl: bool):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from sftaudit.hf import SFTAuditCallback

    common = dict(
        output_dir=str(run_dir),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    options = dict(
        model=tiny_model(tokenizer),
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tokenizer,
        data_collator=lambda rows: collate(tokenizer, rows),
        callbacks=[SFTAuditCallback(run_dir, dataset=ROWS, **QUIET)],
    )
    if trl:
        from trl import SFTConfig, SFTTrainer

        SFTTrainer(args=SFTConfig(**common, dataset_kwargs={"skip_prepare_dataset": True}), **options).train()
    else:
        Trainer(args=TrainingArguments(**common), **options).train()


@pytest.mark.parametrize(
    "loop,family,name",
    [
        ("plain", "llama3", "meta-llama-Llama-3.1-8B-Instruct"),
        ("trainer", "qwen2", "Qwen-Qwen2.5-7B-Instruct"),
        ("trl", "llama3", "meta-llama-Llama-3.1-8B-Instruct"),
    ],
)
def test_clean_recorded_run_on_a_released_tokenizer_has_no_data_finding(tmp_path, loop, family, name):
    tokenizer = released(family, name)
    if tokenizer.pad_token is None:  # Llama 3.1 ships none; its reserved pad token is the usual choice
        tokenizer.pad_token = "<|finetune_right_pad_id|>"
    run_dir = tmp_path / loop
    if loop == "plain":
        train_plain(run_dir, tokenizer)
    else:
        train_hf(run_dir, tokenizer, trl=loop == "trl")
    verdict = audit(run_dir)
    data = [
        (f["code"], f["severity"], f["message"])
        for f in verdict["findings"]
        if f["code"] in ("LOOP-01", "LOOP-02", "LOOP-03", "LOOP-04") and f["severity"] != "info"
    ]
    assert data == [] and not [e for e in verdict["check_errors"] if e["code"] <= "LOOP-04"], data
    assert [f for f in verdict["findings"] if f["severity"] == "fail"] == [], verdict["findings"]
