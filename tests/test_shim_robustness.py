"""The shim never crashes or stalls training: a failing component is recorded and switched off."""

import json

import torch
from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset

from sftaudit.core.artifacts import rank_dir
from sftaudit.shim import Recorder


def events(run):
    return [json.loads(line) for line in (rank_dir(run, 0) / "events.jsonl").read_text().splitlines()]


def test_failing_probe_is_switched_off_and_training_goes_on(tmp_path, tokenizer_cache):
    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    rows = load_dataset()[:8]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class BrokenGenerate(Exception):
        pass

    def broken_generate(*args, **kwargs):
        raise BrokenGenerate("generation exploded")

    model.generate = broken_generate
    with Recorder(tmp_path, model, tok, probe_prompts=["hi"], generate_every=1, probe_every=1) as rec:
        for step in (1, 2, 3):
            batch = collate(tok, rows)
            rec.on_batch(step, batch)
            loss = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
            ).loss
            loss.backward()
            rec.on_backward(step, loss)
            opt.step()
            rec.on_step_end(step, lr=0.1)
            opt.zero_grad()
    kinds = [(e["kind"], e.get("probe")) for e in events(tmp_path)]
    assert kinds.count(("shim_error", "generations")) == 1  # reported once, then switched off
    assert next(e for e in events(tmp_path) if e["kind"] == "shim_error")["step"] == 1
    assert ("probe_disabled", "generations") in kinds
    steps = (rank_dir(tmp_path, 0) / "steps.jsonl").read_text().splitlines()
    assert len(steps) == 3  # training and the other probes went on
    assert len((rank_dir(tmp_path, 0) / "probes.jsonl").read_text().splitlines()) == 3


def test_bad_batch_does_not_raise(tmp_path, tokenizer_cache):
    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    with Recorder(tmp_path, model, tok) as rec:
        rec.on_batch(1, {"not_input_ids": 1})  # a malformed batch: recorded as a shim error
        rec.on_step_end(1, lr=None)
    assert any(e["kind"] == "shim_error" and e["probe"] == "batches" for e in events(tmp_path))


def test_resumed_recorder_starts_a_new_segment(tmp_path, tokenizer_cache):
    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    Recorder(tmp_path, model, tok).close()
    steps = rank_dir(tmp_path, 0) / "steps.jsonl"
    steps.write_text('{"seg":0,"step":1,"loss":1.0')  # a line torn by a crash
    with Recorder(tmp_path, model, tok) as rec:
        assert rec.segment == 1
        rec.on_backward(2, torch.tensor(1.5))
        rec.on_step_end(2)
    lines = steps.read_text().splitlines()
    assert json.loads(lines[-1])["seg"] == 1 and json.loads(lines[-1])["step"] == 2


def test_batched_probes_match_each_prompt_alone(tmp_path, tokenizer_cache):
    """Probe prompts run as one left-padded batch: padding must not change any distribution."""
    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok).eval()
    prompts = ["Hi", "Explain in two sentences why the sky looks blue at noon and red at sunset."]
    with Recorder(tmp_path, model, tok, probe_prompts=prompts, probe_every=1, probe_top_k=5) as rec:
        rec.on_step_end(1)
    probes = [json.loads(line) for line in (rank_dir(tmp_path, 0) / "probes.jsonl").read_text().splitlines()]
    for record, prompt in zip(probes, prompts):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
        top = probs.topk(5)
        assert record["top_ids"] == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(record["top_probs"], top.values.tolist())) < 1e-5
