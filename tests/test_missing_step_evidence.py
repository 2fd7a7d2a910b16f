"""The steps recorded without their per-step evidence, on a database built by hand: repeated and unordered step
records, a step record without a step, batches past the last step or without their step record, a component off."""

import duckdb

from sftaudit.verdict.audit import PER_STEP_EVIDENCE, missing_step_evidence

BATCHES, GRADIENTS = (words for _, _, words in PER_STEP_EVIDENCE)


def test_gaps_per_rank_and_kind():
    con = duckdb.connect()
    rows = {
        # rank 0 logs step 2 twice, out of order; rank 1 has a step record without a step
        "steps": [(0, 5), (0, 2), (0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3), (1, None)],
        # rank 0: step 3 lacks its batches, step 4's batches lack their step record, step 6's were in flight
        "batches": [(0, 1), (0, 2), (0, 4), (0, 5), (0, 6), (0, 6), (1, 3), (1, 1), (1, 2)],
        # rank 0: step 5 lacks its norms; rank 1 switched gradients off from step 2
        "grad_piece_steps": [(0, 3), (0, 1), (0, 2), (1, 1)],
    }
    for table, values in rows.items():
        con.execute(f"CREATE TABLE {table} (rank INTEGER, step BIGINT)")
        con.executemany(f"INSERT INTO {table} VALUES (?, ?)", values)
    off = [{"rank": 1, "component": "gradients", "from_step": 2, "error": "x"}]
    assert missing_step_evidence(con, off) == [
        {"rank": 0, "evidence": BATCHES, "steps": 2, "of": 4, "first_step": 3},
        {"rank": 1, "evidence": BATCHES, "steps": 1, "of": 4, "first_step": None},
        {"rank": 0, "evidence": GRADIENTS, "steps": 1, "of": 4, "first_step": 5},
    ]
    # Gradients off from the start (no step given): none of rank 1's steps is a gap, the stepless one neither.
    off = [{"rank": 1, "component": "gradients", "from_step": None, "error": "x"}]
    assert [m["rank"] for m in missing_step_evidence(con, off) if m["evidence"] == GRADIENTS] == [0]
