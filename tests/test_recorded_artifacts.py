"""What the shim records on a real plain-loop run, read back through DuckDB."""

import json

import duckdb

from sftaudit.core.artifacts import SCHEMA_VERSION, rank_dir, series_dir
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect, database_path


def test_manifest_describes_model_tokenizer_and_dataset(clean_run):
    manifest = json.loads((rank_dir(clean_run, 0) / "manifest.jsonl").read_text().splitlines()[0])
    assert manifest["schema_version"] == SCHEMA_VERSION == 2 and manifest["rank"] == 0 and manifest["world_size"] == 1
    names = [p["name"] for p in manifest["params"]]
    assert "lm_head.weight" in names and names[0] == "model.embed_tokens.weight"
    tok = manifest["tokenizer"]
    assert tok["fingerprint"].startswith("v2:") and set(tok["identity"]) >= {"vocabulary", "special_tokens"}
    assert "generation" in tok["chat_template"]
    assert tok["special_tokens"]["pad"]["id"] != tok["special_tokens"]["eos"]["id"]
    assert manifest["dataset"]["message_fields"] == ["content", "role"]
    assert len(manifest["probe_prompts"]) == 3 and manifest["eval_set"][0]["reference"]


def test_every_step_has_loss_lr_and_one_norm_per_tensor(clean_run):
    ingest(clean_run)
    con = connect(clean_run, read_only=True)
    steps = con.execute("SELECT step, loss, lr, grad_norm, tokens FROM steps ORDER BY step").fetchall()
    assert [s[0] for s in steps] == list(range(1, 31))
    assert all(s[1] > 0 and s[2] > 0 and s[3] > 0 and s[4] > 0 for s in steps)
    n_params = con.execute("SELECT count(*) FROM params WHERE idx IS NOT NULL").fetchall()[0][0]
    per_step = con.execute("SELECT count(*) FROM grad_norms GROUP BY step").fetchall()
    assert {c for (c,) in per_step} == {n_params}
    # The global norm is the L2 norm of the per-tensor norms.
    diff = con.execute("""SELECT max(abs(s.grad_norm - g.total)) FROM steps s JOIN
        (SELECT step, sqrt(sum(norm * norm)) total FROM grad_norms GROUP BY step) g USING (step)""").fetchall()[0][0]
    assert diff < 1e-4
    # The norms live in the columnar series (a part once the recorder closed), not in steps.jsonl.
    assert "grad_norms" not in (rank_dir(clean_run, 0) / "steps.jsonl").read_text()
    parts = list(series_dir(clean_run, 0).rglob("part-*.parquet"))
    assert parts and not list(series_dir(clean_run, 0).rglob("journal-*"))
    values = len(steps) * n_params
    print(f"series: {sum(p.stat().st_size for p in parts) / values:.2f} bytes per recorded value ({values} values)")


def test_batches_samples_probes_evals_and_checkpoints(clean_run):
    ingest(clean_run)
    con = connect(clean_run, read_only=True)
    ids, lengths, labels = con.execute(
        "SELECT sample_ids, lengths, label_tokens FROM batches WHERE step = 1"
    ).fetchall()[0]
    assert len(ids) == 8 and all(i.startswith("s") for i in ids)
    assert all(0 < lab < n for lab, n in zip(labels, lengths))
    # Evidence rows: labels are -100 exactly where the collator masked them.
    row = con.execute("SELECT input_ids, labels, attention_mask FROM samples WHERE step = 3 AND row = 0").fetchall()[0]
    assert len(row[0]) == len(row[1]) == len(row[2])
    assert all(label == -100 or label == i for i, label in zip(row[0], row[1]))
    probes = con.execute("SELECT step, prompt, entropy, len(top_probs) FROM probes ORDER BY step, prompt").fetchall()
    assert [p[0] for p in probes] == [10] * 3 + [20] * 3 + [30] * 3
    assert all(p[2] > 0 and p[3] == 32 for p in probes)
    hists = con.execute("SELECT DISTINCT step, reason FROM grad_hists").fetchall()
    assert hists == [] or all(r == "scheduled" for _, r in hists)
    ckpts = con.execute(
        "SELECT step, path, training_state FROM checkpoints WHERE event='saved' ORDER BY step"
    ).fetchall()
    assert [(c[0], c[1]) for c in ckpts] == [(10, "checkpoint-10"), (20, "checkpoint-20"), (30, "checkpoint-30")]
    state = json.loads(ckpts[0][2])
    assert state["step"] == 10 and set(state) >= {"optimizer", "scheduler", "rng_states", "data_position", "collator"}
    hashed = con.execute("SELECT count(*) FROM checkpoints WHERE event='hashed'").fetchall()[0][0]
    assert hashed == 3


def test_plain_duckdb_reads_the_artifacts_without_sftaudit(clean_run):
    """The format is documented well enough that plain SQL can query it."""
    path = rank_dir(clean_run, 0) / "steps.jsonl"
    n, first = duckdb.sql(f"SELECT count(*), min(step) FROM read_json_auto('{path}')").fetchall()[0]
    assert (n, first) == (30, 1)
    assert database_path(clean_run).name == "audit.duckdb"
