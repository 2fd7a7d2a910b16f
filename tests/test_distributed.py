"""2-rank CPU runs (gloo, one torchrun launch: the `distributed_runs` fixture): every rank records its
local pieces with no extra collective, the analyzer reduces them to the whole model's per-tensor
gradient norms, and a clean run of every framework audits PASS."""

import json
from pathlib import Path

import pytest

from sftaudit.core.artifacts import rank_dir
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

pytestmark = pytest.mark.slow  # torchrun launches

CLEAN = {
    "ddp": 6,
    "fsdp1": 6,
    "fsdp1_flat": 6,
    "fsdp2": 6,
    "trainer_ddp": 4,
    "zero1": 6,
    "zero2": 6,
    "zero3": 6,
}  # run -> steps

PLAIN_LOOPS = ("ddp", "fsdp1", "fsdp1_flat", "fsdp2")  # the same model, data and optimizer as the reference
ZERO = ("zero1", "zero2", "zero3")  # the same too, DeepSpeed's default clipping switched off as the reference has none


def manifests(run):
    return [json.loads((rank_dir(run, r) / "manifest.jsonl").read_text().splitlines()[0]) for r in (0, 1)]


@pytest.mark.parametrize("name", CLEAN)
def test_clean_run_passes_with_every_step_of_every_rank(distributed_runs, name):
    run = distributed_runs / name
    verdict = audit(run)
    assert verdict["verdict"] == "pass", [f["message"] for f in verdict["findings"] if f["severity"] != "info"]
    steps = CLEAN[name]
    assert verdict["evidence"]["ranks"] == [
        {"rank": r, "steps": steps, "first_step": 1, "last_step": steps} for r in (0, 1)
    ]
    assert verdict["evidence"]["components_off"] == []
    con = connect(run, read_only=True)
    n_params = con.execute("SELECT count(*) FROM params WHERE rank = 0 AND idx IS NOT NULL").fetchall()[0][0]
    # Every rank has the whole model's norm of every tensor at every step.
    assert con.execute("SELECT count(*) FROM grad_norms").fetchall()[0][0] == 2 * steps * n_params
    con.close()


def test_trainer_under_torchrun_ran_ddp_over_two_processes(distributed_runs):
    measured = json.loads((distributed_runs / "trainer_ddp.json").read_text())
    # Without use_cpu=True each process would train alone while torchrun reports two.
    assert measured["num_processes"] == 2 and measured["distributed_type"] == "DistributedType.MULTI_CPU"
    assert {m["world_size"] for m in manifests(distributed_runs / "trainer_ddp")} == {2}
    # Read at the end of backward, after DDP's reduction, the total is the Trainer's own pre-clip grad_norm; the
    # post-clip one beside it is that clipped at max_grad_norm 1.0.
    ingest(distributed_runs / "trainer_ddp")
    con = connect(distributed_runs / "trainer_ddp", read_only=True)
    pairs = con.execute("""SELECT m.value, s.grad_norm, s.grad_norm_post_clip FROM metrics m JOIN steps s USING (rank, step)
                           WHERE m.name = 'grad_norm'""").fetchall()
    con.close()
    assert len(pairs) == 8 and all(
        abs(logged / pre - 1) < 1e-5 and abs(min(logged, logged / (logged + 1e-6)) / post - 1) < 1e-5
        for logged, pre, post in pairs
    )


@pytest.mark.parametrize("name", PLAIN_LOOPS + ZERO)
def test_reduced_norms_equal_one_process_on_the_concatenated_batch(distributed_runs, name):
    reference = json.loads((distributed_runs / "reference.json").read_text())
    ingest(distributed_runs / name)
    con = connect(distributed_runs / name, read_only=True)
    rows = con.execute("SELECT rank, step, tensor, norm FROM grad_norms").fetchall()
    total = con.execute("SELECT step, grad_norm FROM steps WHERE rank = 1 ORDER BY step").fetchall()
    con.close()
    assert {t for _, _, t, _ in rows} == set(reference["1"])
    assert max(abs(norm / reference[str(step)][tensor] - 1) for _, step, tensor, norm in rows) < 1e-5
    for step, norm in total:  # the step's total is the whole model's on every rank, sharded or not
        whole = sum(v * v for v in reference[str(step)].values()) ** 0.5
        assert abs(norm / whole - 1) < 1e-5


@pytest.mark.parametrize("name", ZERO)
def test_deepspeed_zero_pieces_reduce_to_deepspeeds_own_gradients(distributed_runs, name):
    """ZeRO-1/2 fragments (read after engine.backward) and ZeRO-3 partitions (read inside the ZeRO
    optimizer's step, as the Trainer's callback does) reduce to the per-tensor norms of DeepSpeed's
    own whole gradients (`safe_get_full_grad`) at every step (and to the one-process reference:
    the test above). DeepSpeed's own total (`get_global_grad_norm`, logged) is the reduced one
    (LOOP-17 in the PASS)."""
    ingest(distributed_runs / name)
    con = connect(distributed_runs / name, read_only=True)
    rows = con.execute("SELECT rank, step, tensor, norm FROM grad_norms").fetchall()
    assert con.execute("SELECT count(*) FROM metrics WHERE name = 'grad_norm'").fetchall() == [(12,)]
    con.close()
    deepspeed = json.loads((distributed_runs / f"{name}.json").read_text())["deepspeed_norms"]
    assert len(rows) == 2 * 6 * len(deepspeed["1"])
    assert max(abs(norm / deepspeed[str(step)][tensor] - 1) for _, step, tensor, norm in rows) < 1e-5
    layouts = manifests(distributed_runs / name)
    assert {m["framework"] for m in layouts} == {"deepspeed"}
    for p0, p1 in zip(layouts[0]["params"], layouts[1]["params"]):  # disjoint element ranges tiling the tensor
        assert p0["kind"] == p1["kind"] == "sharded" and p0["local_numel"] + p1["local_numel"] == p0["numel"]
        assert p0["stop"] == p1["start"] or p1["stop"] == p0["start"] or 0 in (p0["local_numel"], p1["local_numel"])


def records(run, rank, kind):
    path = rank_dir(run, rank) / f"{kind}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("name", ["fsdp1", "fsdp1_flat", "fsdp2", "zero3"])
def test_sharded_runs_probe_on_every_rank_as_ddp_does(distributed_runs, name):
    """Probe rows are split across the ranks (rank r: rows r, r + 2, ...), each rank writing its own.
    With sharded weights every rank runs each probe's forward and generate (synced_gpus) together,
    rank 1 on a stand-in row for the one eval item it does not hold; the records are the DDP run's
    (the same weights and split) row for row. Before, sharded runs had no probes, and FSDP1 probed
    from rank 0 alone, which stalled the other rank's next collective."""
    run = distributed_runs / name
    held = {"probes": {0: [0], 1: [1]}, "generations": {0: [0, 0], 1: [1, 1]}, "evals": {0: [0], 1: []}}
    for kind, row, text in (
        ("probes", "prompt", None),
        ("generations", "sample", "text"),
        ("evals", "item", "prediction"),
    ):
        for rank in (0, 1):
            ddp, sharded = records(distributed_runs / "ddp", rank, kind), records(run, rank, kind)
            assert (
                [r[row] for r in sharded if r["step"] == 6]
                == [r[row] for r in ddp if r["step"] == 6]
                == held[kind][rank]
            )
            assert [r["step"] for r in sharded] == [r["step"] for r in ddp]
            if text:
                assert [r[text] for r in sharded] == [r[text] for r in ddp]
            else:  # top-k probabilities (ids may swap on near-ties of the tiny model)
                assert (
                    max(abs(a - b) for r, q in zip(sharded, ddp) for a, b in zip(r["top_probs"], q["top_probs"])) < 1e-4
                )
    assert not [
        e for rank in (0, 1) for e in records(run, rank, "events") if e["kind"] in ("shim_error", "probe_disabled")
    ]


def test_an_eval_item_trained_on_rank_1_only_is_found(distributed_runs, tmp_path):
    """LOOP-08 looks for the eval items in every rank's training samples: the clean DDP run with its eval
    set swapped for the text of a sample only rank 1 trained (rank r trains its own rows) fails,
    naming that sample; before, only rank 0's samples were searched and the run passed."""
    import shutil

    from tokenizers import Tokenizer

    from sftaudit.core.artifacts import TOKENIZER_DIR, artifact_root

    run = Path(shutil.copytree(distributed_runs / "ddp", tmp_path / "ddp", ignore=shutil.ignore_patterns("*.duckdb*")))
    sample = records(run, 1, "samples")[0]
    assert sample["sample_id"] not in {s["sample_id"] for s in records(run, 0, "samples")}
    text = Tokenizer.from_file(str(artifact_root(run) / TOKENIZER_DIR / "tokenizer.json")).decode(
        sample["input_ids"], skip_special_tokens=True
    )
    manifest = rank_dir(run, 0) / "manifest.jsonl"
    first = json.loads(manifest.read_text().splitlines()[0])
    first["eval_set"] = [{"id": "leaked", "messages": [{"role": "user", "content": text}], "reference": text}]
    manifest.write_text(json.dumps(first) + "\n")
    leak = [f for f in audit(run)["findings"] if f["code"] == "LOOP-08"]
    assert len(leak) == 1 and leak[0]["severity"] == "fail", leak
    assert leak[0]["evidence"]["sample_ids"] == [sample["sample_id"]]


@pytest.mark.parametrize("name", ["zero2_spike", "zero3_spike"])
def test_a_spike_under_deepspeed_gets_histograms_of_that_steps_gradients(distributed_runs, name):
    """x100 in the whole embedding gradient at step 10 of 12, DeepSpeed's default clipping on (its update
    is clipped). The spike's histograms are taken after the optimizer step, where ZeRO-1/2 have dropped
    their fragments: every one written is of the rank's piece of DeepSpeed's own pre-clip gradient at
    that step (`safe_get_full_grad`), not the clipped or the unspiked one; none is missing."""
    import torch
    from sftaudit.fixtures.distributed import SPIKE_AT, ZERO_SPIKED

    from sftaudit.shim.gradients import histograms as _histograms

    run = distributed_runs / name
    full = torch.load(run / "spiked_grads.pt", weights_only=True)
    clip = 1.0 / (float(torch.stack([g.double().norm() for g in full.values()]).norm()) + 1e-6)
    spiked_ranks = []
    for rank, manifest in enumerate(manifests(run)):
        assert not [e for e in records(run, rank, "events") if e["kind"] == "grad_hists_not_recorded"]
        rows = [h for h in records(run, rank, "grad_hists") if h["step"] == SPIKE_AT]
        if rows:
            spiked_ranks.append(rank)
        assert {h["reason"] for h in rows} <= {"spike"} and not [
            h for h in records(run, rank, "grad_hists") if h["step"] != SPIKE_AT
        ]
        ranges = {p["name"]: (p["start"], p["stop"]) for p in manifest["params"]}
        for h in rows:
            start, stop = ranges[h["tensor"]]
            piece = full[h["tensor"]].reshape(-1)[start:stop]
            expected = _histograms([piece]).numpy().astype("int64")[0].tolist()
            assert [h["zeros"], h["nonfinite"], *h["counts"]] == expected, h["tensor"]
            if h["tensor"] == ZERO_SPIKED:  # what reading the clipped or the unspiked gradient would have written
                assert all(
                    _histograms([piece * k]).numpy().astype("int64")[0].tolist() != expected for k in (clip, 0.01)
                )
    assert spiked_ranks == ([0, 1] if name == "zero3_spike" else [0])  # the ranks holding the spiked tensor
    assert ZERO_SPIKED in {h["tensor"] for h in records(run, 0, "grad_hists")}


def test_a_spike_whose_gradients_deepspeed_clipped_in_place_gets_them_scaled_back(distributed_runs):
    """bf16 weights with fp32 gradient accumulation: ZeRO-2 clips its accumulation buffer, which the
    fragments are views of, in place in the optimizer step. Every piece is then one multiple of what
    was recorded: the recorder divides it back, so the spike's histograms are of DeepSpeed's own
    pre-clip gradient (`safe_get_full_grad` before the step), not of the clipped one."""
    import torch
    from sftaudit.fixtures.distributed import SPIKE_AT, ZERO_SPIKED

    from sftaudit.shim.gradients import histograms as _histograms

    run = distributed_runs / "zero2_bf16_spike"
    full = torch.load(run / "spiked_grads.pt", weights_only=True)
    clip = 1.0 / (float(torch.stack([g.double().norm() for g in full.values()]).norm()) + 1e-6)
    assert not [e for e in records(run, 0, "events") if e["kind"] == "grad_hists_not_recorded"]
    rows = [h for h in records(run, 0, "grad_hists") if h["step"] == SPIKE_AT]
    assert ZERO_SPIKED in {h["tensor"] for h in rows} and {h["reason"] for h in rows} == {"spike"}
    ranges = {p["name"]: (p["start"], p["stop"]) for p in manifests(run)[0]["params"]}
    for h in rows:  # bins of log10|g|: a value on a bin edge may move by one once the clip is undone
        start, stop = ranges[h["tensor"]]
        piece = full[h["tensor"]].reshape(-1)[start:stop].float()
        expected = _histograms([piece]).numpy().astype("int64")[0].tolist()
        got = [h["zeros"], h["nonfinite"], *h["counts"]]
        assert sum(abs(a - b) for a, b in zip(got, expected)) <= 2 + piece.numel() // 10_000, h["tensor"]
        if h["tensor"] == ZERO_SPIKED:
            assert got != _histograms([piece * clip]).numpy().astype("int64")[0].tolist()


@pytest.mark.parametrize("after_backward", ["kept", "clipped", "zeroed"])
def test_histograms_of_a_spike_are_of_the_steps_gradients_or_not_taken(tmp_path, tokenizer_cache, after_backward):
    """A spike's histograms are taken at `on_step_end`, after the optimizer step. Gradients the loop
    clipped in place since `on_backward` (`clip_grad_norm_`: every piece times one factor) are scaled
    back: the histograms are of the step's pre-clip gradients. Gradients it zeroed no longer have the
    step's norms: an event says the histograms were not taken, instead of histograms of zeros."""
    import torch
    from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset

    from sftaudit.shim import Recorder
    from sftaudit.shim.gradients import histograms as _histograms

    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    rows = load_dataset()[:4]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(tmp_path, model, tok, profile="prod") as rec:
        for step in (1, 2, 3, 4):
            batch = collate(tok, rows)
            rec.on_batch(step, batch)
            loss = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
            ).loss
            loss.backward()
            if step == 4:
                torch._foreach_mul_([p.grad for p in model.parameters()], 100.0)
                spiked = {
                    name: _histograms([p.grad]).numpy().astype("int64")[0].tolist()
                    for name, p in model.named_parameters()
                }
            rec.on_backward(step, loss)
            if after_backward == "clipped":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if after_backward == "zeroed":
                opt.zero_grad(set_to_none=False)
            rec.on_step_end(step, lr=0.01)
            opt.zero_grad()
    missing = [e for e in records(tmp_path, 0, "events") if e["kind"] == "grad_hists_not_recorded"]
    hists = records(tmp_path, 0, "grad_hists")
    if after_backward == "zeroed":
        assert [e["step"] for e in missing] == [4] and "spike step" in missing[0]["error"] and hists == []
        from sftaudit.outputs.report.tables import run_summary

        ingest(tmp_path)
        con = connect(tmp_path, read_only=True)
        assert [(e["rank"], e["step"]) for e in run_summary(con)["hists_not_taken"]] == [(0, 4)]  # the report's row
        con.close()
        return
    assert missing == [] and {h["step"] for h in hists} == {4} and {h["reason"] for h in hists} == {"spike"}
    assert len(hists) == len(spiked)
    for h in hists:  # bins of log10|g|: a value on a bin edge may move by one after the clip is undone
        got = [h["zeros"], h["nonfinite"], *h["counts"]]
        assert got[:2] == spiked[h["tensor"]][:2] and sum(abs(a - b) for a, b in zip(got, spiked[h["tensor"]])) <= 2


def test_layouts_say_how_each_rank_holds_each_tensor(distributed_runs):
    ddp, fsdp1, flat, fsdp2 = (manifests(distributed_runs / n) for n in PLAIN_LOOPS)
    assert {m["framework"] for m in ddp} == {"plain"} and {m["framework"] for m in fsdp2} == {"fsdp2"}
    assert {p["kind"] for m in ddp for p in m["params"]} == {"replicated"}
    assert [p["replica"] for m in ddp for p in m["params"][:1]] == [0, 1]
    for run in (fsdp1, flat, fsdp2):
        assert {m["framework"] for m in run} <= {"fsdp1", "fsdp2"}
        assert [p["name"] for p in run[0]["params"]] == [p["name"] for p in run[1]["params"]]
        assert {p["name"] for p in run[0]["params"]} == {p["name"] for p in ddp[0]["params"]}
        for p0, p1 in zip(run[0]["params"], run[1]["params"]):
            # Two disjoint pieces that tile the whole tensor (an element range per rank).
            assert p0["kind"] == p1["kind"] == "sharded" and p0["shape"] == p1["shape"]
            assert p0["local_numel"] + p1["local_numel"] == p0["numel"]
            assert sorted([(p0["start"], p0["stop"]), (p1["start"], p1["stop"])]) in (
                [(0, p0["local_numel"]), (p0["local_numel"], p0["numel"])],
                [(0, 0), (0, p0["numel"])],
            )
    assert any(p["local_numel"] == 0 for m in fsdp1 for p in m["params"])  # FSDP1 shards the flat parameter


def test_fsdp2_recording_adds_no_collective_to_a_step(distributed_runs):
    counts = json.loads((distributed_runs / "fsdp2.json").read_text())["collectives"]
    recorded, alone = [c for c in counts if c["recorded"]], [c for c in counts if not c["recorded"]]
    assert len(recorded) == 2 and len(alone) == 1  # steps 1-2 recorded, step 7 without the recorder
    assert all(c["recorder"] == 0 for c in counts)
    assert {c["total"] for c in counts} == {alone[0]["total"]} and alone[0]["total"] > 0  # FSDP2's own


def test_a_rank_that_stopped_leaves_sharded_norms_incomplete_never_smaller(distributed_runs):
    ingest(distributed_runs / "fsdp2_stop")
    con = connect(distributed_runs / "fsdp2_stop", read_only=True)
    steps = con.execute("SELECT step, grad_norm FROM steps WHERE rank = 0 ORDER BY step").fetchall()
    reduced_steps = con.execute("SELECT DISTINCT step FROM grad_norms ORDER BY step").fetchall()
    con.close()
    assert [s for s, n in steps if n is None] == [5, 6]  # rank 1's pieces of steps 5 and 6 are missing
    assert reduced_steps == [(s,) for s in range(1, 5)]


def write_rank(run, rank, params, steps):
    """A rank's artifacts as the shim writes them: a manifest with layouts, one steps record per step."""
    folder = rank_dir(run, rank)
    folder.mkdir(parents=True)
    manifest = {
        "schema_version": 1,
        "seg": 0,
        "rank": rank,
        "world_size": 4,
        "profile": "prod",
        "params": params,
        "tied": {},
        "grad_norm_source": "pre_clip",
    }
    (folder / "manifest.jsonl").write_text(json.dumps(manifest) + "\n")
    (folder / "steps.jsonl").write_text(
        "".join(
            json.dumps({"seg": 0, "step": s, "loss": 1.0, "grad_norm": None, "grad_norms": norms}) + "\n"
            for s, norms in steps.items()
        )
    )


def test_reduction_over_one_replica_group_with_coverage(tmp_path):
    """HSDP on 4 ranks: two replica groups of two shards each. `w` (6 elements) is sharded 4 + 2;
    `b` is replicated; `p` has a Partial placement (no norm can be reduced from it). At step 2 rank 1
    (group 0) has no piece of `w`: group 0 does not cover it, and group 1 is not used instead."""

    def params(rank):
        start = 0 if rank % 2 == 0 else 4
        return [
            {
                "name": "w",
                "shape": [6],
                "dtype": "float32",
                "numel": 6,
                "requires_grad": True,
                "kind": "sharded",
                "start": start,
                "stop": start + (4 if rank % 2 == 0 else 2),
                "local_numel": 4 if rank % 2 == 0 else 2,
                "replica": rank // 2,
            },
            {
                "name": "b",
                "shape": [2],
                "dtype": "float32",
                "numel": 2,
                "requires_grad": True,
                "kind": "replicated",
                "start": 0,
                "stop": 2,
                "local_numel": 2,
                "replica": rank,
            },
            {
                "name": "p",
                "shape": [2],
                "dtype": "float32",
                "numel": 2,
                "requires_grad": True,
                "kind": "partial",
                "start": None,
                "stop": None,
                "local_numel": 2,
                "replica": rank,
            },
        ]

    run = tmp_path / "hsdp"
    for rank in range(4):
        shard = 3.0 if rank % 2 == 0 else 4.0
        write_rank(run, rank, params(rank), {1: [shard, 2.0, 1.0], 2: [None if rank == 1 else shard, 2.0, 1.0]})
    ingest(run)
    con = connect(run, read_only=True)
    rows = con.execute("SELECT rank, step, tensor, norm FROM grad_norms ORDER BY step, tensor, rank").fetchall()
    totals = con.execute("SELECT step, list(grad_norm ORDER BY rank) FROM steps GROUP BY step ORDER BY step").fetchall()
    con.close()
    assert rows == [(r, 1, "b", 2.0) for r in range(4)] + [(r, 1, "w", 5.0) for r in range(4)] + [
        (r, 2, "b", 2.0) for r in range(4)
    ]  # w at step 2: incomplete, no row; p: never
    assert totals == [(1, [None] * 4), (2, [None] * 4)]  # p has no reducible norm: no step total
