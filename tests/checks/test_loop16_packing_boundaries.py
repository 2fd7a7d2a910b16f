"""LOOP-16: three samples packed per row with positions running on under plain causal attention (Z16)
fail at the first packed step; unpacked rows (one BOS each) raise nothing."""

from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

from .dynamics_runs import PACKED_STEP, of, recorded_loop, run


def test_packed_rows_without_boundaries_fail_at_the_first_packed_step(runs, tmp_path):
    run_dir = run(runs, "packed")
    [finding] = of(audit(run_dir), "LOOP-16")
    assert (finding["severity"], finding["step"]) == ("fail", PACKED_STEP)
    evidence = finding["evidence"]
    assert evidence["rows_affected"] == 2 * (4 - PACKED_STEP + 1) and evidence["steps_affected"] == 4 - PACKED_STEP + 1
    first = evidence["rows"][0]
    assert first["samples"] == 3 and first["sample_id"].count("+") == 2 and not first["resets"]
    # The fixture loop hands the model its 2-D padding mask and builds a cache (config.use_cache).
    assert first["causes"] == [
        "positions do not restart",
        "attention_mask given",
        "a KV cache was built (use_cache=True): pass use_cache=False",
    ]
    assert evidence["attn_implementation"] in ("sdpa", "eager")
    # Before the fault every row held one sample.
    con = connect(run_dir, read_only=True)
    starts = con.execute("SELECT flatten(list(bos_starts)) FROM batches WHERE step < ?", [PACKED_STEP]).fetchall()[0][0]
    assert set(starts) == {1}
    # Under flash attention the cache does not matter, the padded mask still does.
    [flash] = of(audit(under_flash_attention(run_dir, tmp_path / "flash")), "LOOP-16")
    assert flash["step"] == PACKED_STEP and flash["evidence"]["rows"][0]["causes"] == [
        "attention_mask given (with padding)",
        "positions do not restart",
    ]


def test_clean_runs_raise_nothing(clean_run, nan_run):
    for run_dir in (clean_run, nan_run):
        assert of(audit(run_dir), "LOOP-16") == []


def flattened(data, **options):
    """Each micro-batch's rows packed into one row by transformers' DataCollatorWithFlattening (padding-free)."""
    from transformers import DataCollatorWithFlattening

    keep = data["attention_mask"].bool()
    features = [
        {"input_ids": ids[m].tolist(), "labels": labels[m].tolist()}
        for ids, labels, m in zip(data["input_ids"], data["labels"], keep)
    ]
    return DataCollatorWithFlattening(**options)(features)


def kept_apart(tokenizer_cache, packed, forward) -> bool:
    """Ground truth from the real model: the packed row's last sample gets the logits it gets alone, when
    the model is called as `forward(model, inputs)` calls it (train mode, as in the recorded loop)."""
    import torch
    from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset

    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok).train()
    clean = flattened(collate(tok, load_dataset()[:4]))
    batch = packed(collate(tok, load_dataset()[:4]))
    start = int((clean["position_ids"][0] == 0).nonzero()[-1])
    with torch.no_grad():
        together = forward(model, {k: v for k, v in batch.items() if k not in ("labels", "sample_ids")}).logits[
            0, start:
        ]
        alone = model(input_ids=batch["input_ids"][:, start:], use_cache=False).logits[0]
    return torch.allclose(together, alone, atol=1e-5)


def without_cache(model, inputs):
    return model(**inputs, use_cache=False)


def with_cache(model, inputs):  # the config's use_cache=True: the forward builds a DynamicCache
    return model(**inputs)


def with_flash_kwargs(data):
    return flattened(data, return_flash_attn_kwargs=True)


def with_ones_mask(data):
    batch = flattened(data)
    return {**batch, "attention_mask": batch["input_ids"].new_ones(batch["input_ids"].shape)}


def without_positions(data):
    return {k: v for k, v in flattened(data).items() if k != "position_ids"}


# (packed batch, forward, the cause LOOP-16 must name or None when the samples are kept apart)
PACKINGS = {
    # The collator's per-sample position_ids (and cu_seq_lens, read by flash attention only), no mask, no cache.
    "restarts": (with_flash_kwargs, without_cache, None),
    # The same, with a cache built: masking_utils then reads no position_ids restarts.
    "cache": (with_flash_kwargs, with_cache, "a KV cache was built (use_cache=True): pass use_cache=False"),
    # A 2-D all-ones mask handed to the model: the restarts are ignored too.
    "mask": (with_ones_mask, without_cache, "attention_mask given"),
    # No position_ids: positions run on across the samples.
    "running": (without_positions, without_cache, "positions do not restart"),
}


def test_packing_judged_as_the_real_model_attends(tmp_path, tokenizer_cache):
    for name, (packed, forward, cause) in PACKINGS.items():
        assert kept_apart(tokenizer_cache, packed, forward) == (cause is None), name  # the ground truth
        run_dir = recorded_loop(
            tmp_path / name, tokenizer_cache, batch=packed, loss=lambda model, inputs: forward(model, inputs).loss
        )
        findings = of(audit(run_dir), "LOOP-16")
        if cause is None:
            assert findings == [], name
            rows = (
                connect(run_dir, read_only=True)
                .execute("SELECT bos_starts, position_resets, varlen, attention_mask_kind, cache_built FROM batches")
                .fetchall()
            )
            assert rows == [([4], [3], True, "none", False)]
        else:
            [finding] = findings
            assert (finding["severity"], finding["step"]) == ("fail", 1), name
            assert (
                finding["evidence"]["rows"][0]["causes"] == [cause] and finding["evidence"]["rows"][0]["samples"] == 4
            )
            assert cause in finding["message"]


def under_flash_attention(run_dir, copy_dir):
    """The run's artifacts as if its model had used flash-attention 2 (not installable on this CPU box)."""
    import json
    import shutil

    shutil.copytree(run_dir / "sftaudit", copy_dir / "sftaudit", ignore=shutil.ignore_patterns("audit.duckdb"))
    manifest = copy_dir / "sftaudit" / "rank-0" / "manifest.jsonl"
    records = [json.loads(line) for line in manifest.read_text().splitlines()]
    for r in records:
        r["model"]["attn_implementation"] = "flash_attention_2"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    return copy_dir


def test_flash_attention_reads_restarts_despite_a_cache_or_an_unpadded_mask(tmp_path, tokenizer_cache):
    # transformers' flash path: varlen from cu_seq_lens or position_ids whatever the cache; an all-ones
    # 2-D mask is dropped (flash_attention_mask), a padded one unpads by the mask and crosses the samples.
    for name, (packed, forward, _) in PACKINGS.items():
        run_dir = recorded_loop(
            tmp_path / name, tokenizer_cache, batch=packed, loss=lambda model, inputs: forward(model, inputs).loss
        )
        findings = of(audit(under_flash_attention(run_dir, tmp_path / f"flash-{name}")), "LOOP-16")
        if name == "running":
            assert [f["evidence"]["rows"][0]["causes"] for f in findings] == [["positions do not restart"]]
        else:
            assert findings == [], name


def without_mask_and_cache_fields(run_dir, copy_dir):
    """The run's artifacts as a shim that did not yet record the attention mask and the cache wrote them."""
    import json
    import shutil

    shutil.copytree(run_dir / "sftaudit", copy_dir / "sftaudit", ignore=shutil.ignore_patterns("audit.duckdb"))
    batches = copy_dir / "sftaudit" / "rank-0" / "batches.jsonl"
    records = [json.loads(line) for line in batches.read_text().splitlines()]
    batches.write_text(
        "".join(
            json.dumps({k: v for k, v in r.items() if k not in ("attention_mask_kind", "cache_built")}) + "\n"
            for r in records
        )
    )
    return copy_dir


def test_runs_recorded_without_the_mask_and_cache_keep_the_older_rule(tmp_path, tokenizer_cache):
    # Varlen keys count as boundaries; restarts under sdpa/eager do not.
    restarts = recorded_loop(tmp_path / "restarts", tokenizer_cache, batch=with_flash_kwargs)
    assert of(audit(without_mask_and_cache_fields(restarts, tmp_path / "old-restarts")), "LOOP-16") == []
    mask = recorded_loop(tmp_path / "mask", tokenizer_cache, batch=with_ones_mask)
    [finding] = of(audit(without_mask_and_cache_fields(mask, tmp_path / "old-mask")), "LOOP-16")
    assert finding["step"] == 1 and finding["evidence"]["rows"][0]["causes"] == [
        f"positions restart but {finding['evidence']['attn_implementation']} ignores them"
    ]


def test_trl_packing_raises_nothing(trl_packing_run):
    # TRL's padding-free packing keeps the samples apart under sdpa: restarts, no mask, no cache.
    assert of(audit(trl_packing_run), "LOOP-16") == []
    rows = (
        connect(trl_packing_run, read_only=True)
        .execute("SELECT bos_starts[1], position_resets[1], attention_mask_kind, cache_built FROM batches")
        .fetchall()
    )
    assert len(rows) == 3 and all(
        starts >= 4 and resets == starts - 1 and (mask, cache) == ("none", False)
        for starts, resets, mask, cache in rows
    )


def doubled_bos(data):
    """Each row with a second BOS in front of the template's own (TRL 0.16.1 on `messages`, any TRL on a
    pre-rendered `text` column: the template writes BOS and the tokenizer call adds another)."""
    import torch

    first = torch.full_like(data["input_ids"][:, :1], int(data["input_ids"][0, 0]))
    return {
        **data,
        "input_ids": torch.cat([first, data["input_ids"]], 1),
        "labels": torch.cat([torch.full_like(first, -100), data["labels"]], 1),
        "attention_mask": torch.cat([torch.ones_like(first), data["attention_mask"]], 1),
    }


def recorded_rows_loop(run_dir, tokenizer_cache, batch):
    """One real step of the tiny model through the Recorder with every row recorded (what a default-profile
    run records from its first batch): `batch(data)` is the collator's output the model is handed."""
    import torch
    from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset

    from sftaudit.shim import Recorder

    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Recorder(run_dir, model, tok, profile="dev", probe_every=0, generate_every=0, eval_every=0) as rec:
        b = batch(collate(tok, load_dataset()[:4]))
        rec.on_batch(1, b)
        value = model(**{k: v for k, v in b.items() if k != "sample_ids"}, use_cache=False).loss
        value.backward()
        rec.on_backward(1, value)
        opt.step()
        rec.on_step_end(1, lr=1e-3)
    return run_dir


def test_a_doubled_bos_is_no_packing_boundary(tmp_path, tokenizer_cache):
    """Rows that start with two BOS hold one sample each: LOOP-02's double BOS, no LOOP-16 finding. Packed
    rows of such samples count one sample per doubled BOS, so their boundaries are judged as without it."""
    run_dir = recorded_rows_loop(tmp_path / "doubled", tokenizer_cache, doubled_bos)
    verdict = audit(run_dir)
    assert of(verdict, "LOOP-16") == []
    [double] = [f for f in of(verdict, "LOOP-02") if f["evidence"].get("kind") == "double_bos"]
    assert (double["severity"], double["step"]) == ("fail", 1)
    assert connect(run_dir, read_only=True).execute("SELECT bos_starts FROM batches").fetchall() == [([2, 2, 2, 2],)]
    # Packed without restarting positions: still a fail, naming the 4 samples of the row (not 8).
    packed = recorded_rows_loop(tmp_path / "packed", tokenizer_cache, lambda d: without_positions(doubled_bos(d)))
    [finding] = of(audit(packed), "LOOP-16")
    assert finding["step"] == 1 and finding["evidence"]["rows"][0]["samples"] == 4
    # Packed with restarting positions (padding-free): kept apart.
    apart = recorded_rows_loop(tmp_path / "apart", tokenizer_cache, lambda d: with_flash_kwargs(doubled_bos(d)))
    assert of(audit(apart), "LOOP-16") == []
