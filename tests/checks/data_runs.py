"""The real runs the data-layer checks (LOOP-01..04) are proven on: short, probes off.

Faults that do not interfere share a run, each starting at its own step."""

from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

QUIET = dict(probe_every=0, generate_every=0, eval_every=0)
DATA_RUNS = {
    # loss mask: one answer dropped at 2, off-by-one boundary from 3, padding trained at 4, pads attended at 5
    "data_mask": dict(
        steps=5,
        checkpoint_every=0,
        **QUIET,
        faults={"assistant_masked_at": 2, "prompt_off_by_one_at": 3, "padding_trained_at": 4, "pads_attended_at": 5},
    ),
    # template and tokenizer identity: tokenized with truncation from 1 (the same tokenizer), empty answer
    # at 2, lopsided batches from 3, second template from 4, tokenizer gains tokens at 5; checkpoints at 3
    # (before) and 6 (after)
    "data_template": dict(
        steps=6,
        checkpoint_every=3,
        **QUIET,
        faults={
            "truncated_tokenize_from": 1,
            "empty_assistant_at": 2,
            "length_variance_at": 3,
            "second_template_at": 4,
            "tokenizer_swap_at": 5,
        },
    ),
    # from the start: capitalised message keys, a marker that splits, pad == eos with pads masked,
    # generation stopping on the base model's eos, the end-of-turn marker's rows zero and frozen
    "data_tokens": dict(
        steps=3,
        checkpoint_every=0,
        **QUIET,
        faults={
            "field_case": True,
            "split_marker": True,
            "pad_is_eos": True,
            "base_model_eos": True,
            "untrained_markers": True,
        },
    ),
}
_verdicts: dict = {}


def audited(runs, name):
    """(run_dir, verdict) of a named data run, audited once per session."""
    run_dir = runs(name, **DATA_RUNS[name])
    if name not in _verdicts:
        _verdicts[name] = audit(run_dir)
    return run_dir, _verdicts[name]


def findings(verdict, code, severity=None):
    return [f for f in verdict["findings"] if f["code"] == code and (severity is None or f["severity"] == severity)]


def batch_ids(run_dir, step):
    """The sample ids the shim recorded for a step's batch."""
    con = connect(run_dir, read_only=True)
    try:
        return con.execute("SELECT sample_ids FROM batches WHERE step = ?", [step]).fetchall()[0][0]
    finally:
        con.close()


def clean_data_findings(verdict):
    return [
        f
        for f in verdict["findings"]
        if f["code"] in ("LOOP-01", "LOOP-02", "LOOP-03", "LOOP-04") and f["severity"] != "info"
    ]
