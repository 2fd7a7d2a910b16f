"""The real multi-epoch runs resumes are proven on (LOOP-11, replay): 10 rows in batches of 4, so
epochs end mid-batch (cyclic) or on a partial batch (sampler, dataloader), over 6+ epochs.

Each order gets a clean run, resumed correctly twice: after dying a step past checkpoint-4, and
exactly at checkpoint-8 (it then dies a step past it); then a copy of it is resumed from
checkpoint-8 on with one planted fault per resume, each segment dying a step past its next
checkpoint. Checkpoints every 2 steps; the data faults resume mid-epoch, in the 4th epoch."""

import shutil

from sftaudit.fixtures.train import train_plain

from sftaudit.verdict.audit import audit

from ..shared import shared_dir

ORDERS = ("cyclic", "sampler", "dataloader")
RUN = dict(
    dataset_rows=10, batch_size=4, max_length=64, checkpoint_every=2, probe_every=0, generate_every=0, eval_every=0
)
# The dataloader run also passes no sample ids: the shim content-hashes its rows.
ORDER_FAULTS = {"dataloader": {"ids_not_given": True}}
# (checkpoint resumed from, last step run)
CLEAN = [(None, 5), (4, 8), (8, 9)]
FAULTS = {
    9: "resume_rereads_data",
    11: "resume_reshuffles",
    13: "resume_restarts_warmup",
    15: "resume_fresh_weights",
    17: "resume_fresh_optimizer",
}  # resume step -> fault
LAST_STEP = {9: 11, 11: 13, 13: 15, 15: 17, 17: 18}

_made: dict = {}


def resume_runs(order, tmp_path_factory, tokenizer_cache):
    """(clean run, its verdict, faulty run, its verdict) of an order: trained once per invocation, audited once
    per worker (on its copy)."""
    if order not in _made:
        base = ORDER_FAULTS.get(order, {})

        def build(folder):
            clean = folder / "clean"
            for source, last in CLEAN:
                train_plain(
                    clean,
                    steps=last,
                    order=order,
                    tokenizer_cache=tokenizer_cache,
                    faults=base,
                    resume_from=clean / f"checkpoint-{source}" if source else None,
                    **RUN,
                )
            faulty = folder / "faulty"
            shutil.copytree(clean, faulty, ignore=shutil.ignore_patterns("audit.duckdb*"))
            for first, fault in FAULTS.items():
                train_plain(
                    faulty,
                    steps=LAST_STEP[first],
                    order=order,
                    tokenizer_cache=tokenizer_cache,
                    faults={**base, fault: True},
                    resume_from=faulty / f"checkpoint-{first - 1}",
                    **RUN,
                )

        folder = shared_dir(tmp_path_factory, f"resume-{order}", build)
        _made[order] = (folder / "clean", audit(folder / "clean"), folder / "faulty", audit(folder / "faulty"))
    return _made[order]
