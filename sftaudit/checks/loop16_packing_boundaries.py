"""LOOP-16 packing boundaries."""

from __future__ import annotations

from .base import AuditContext, Check, Finding

# Attention implementations that turn position_ids restarts into per-sample (varlen) attention.
VARLEN_FROM_POSITIONS = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn")


class PackingBoundaries(Check):
    """Packing boundaries (trigger point: after collate).

    What it detects:
        Rows that hold several samples (packing) while causal attention runs across them: no
        per-sample boundaries reach the model (no `cu_seq_lens`/`seq_lens`, no 4-D or block mask),
        and the positions do not restart at each sample under a flash-attention varlen path
        (zoo Z16). Each sample then attends to the ones packed before it.
    Why it matters:
        Later samples are conditioned on unrelated earlier text: the loss is lower than it should
        be and the model learns to continue other people's conversations. SDPA and eager attention
        ignore position_ids boundaries; only a varlen path or a segment mask honours them.
    Statistic:
        Per row, the shim counts attended BOS tokens (one per packed sample; templates without a
        BOS token are not judged) and, when the batch gives `position_ids`, their restarts at 0;
        per micro-batch whether varlen boundaries were given; the manifest names the attention
        implementation. A row with k > 1 samples is contaminated unless varlen boundaries were given,
        or its positions restart k - 1 times under a flash-attention implementation.
    Threshold:
        Any contaminated row: fail at the first step with one.
    Evidence:
        The first rows (sample ids, samples per row, position restarts), the attention
        implementation, the number of steps and rows affected.
    """

    code = "LOOP-16"
    name = "packing boundaries"
    needs = ("batches",)
    defaults = {"rows_listed": 5}

    def run(self, ctx: AuditContext) -> list[Finding]:
        if not ctx.has_rows("batches"):
            return []
        attn = (ctx.manifest.get("model") or {}).get("attn_implementation")
        varlen_positions = attn in VARLEN_FROM_POSITIONS
        rows = ctx.frame(
            f"""
            SELECT step, micro, sample_ids[i] AS sample_id, bos_starts[i] AS samples,
                   position_resets[i] AS resets
            FROM (SELECT *, generate_subscripts(bos_starts, 1) AS i FROM batches
                  WHERE rank = 0 AND bos_starts IS NOT NULL AND NOT coalesce(varlen, false))
            WHERE bos_starts[i] > 1
              AND NOT ({'true' if varlen_positions else 'false'} AND coalesce(position_resets[i], 0) >= bos_starts[i] - 1)
            ORDER BY step, micro, i
            """
        )
        if rows.height == 0:
            return []
        first = rows.row(0, named=True)
        steps = rows["step"].n_unique()
        return [self.finding(
            "fail",
            f"from step {first['step']} rows hold several samples ({first['samples']} in row {first['sample_id']}) that "
            f"attend to each other: no varlen boundaries were given and the positions "
            f"{'do not restart' if not first['resets'] else 'restart but ' + str(attn) + ' ignores them'} "
            f"({rows.height} row(s) in {steps} step(s)); pass position_ids per sample with flash-attention varlen "
            f"(DataCollatorWithFlattening / padding_free) or a block mask, or stop packing",
            step=int(first["step"]), attn_implementation=attn, rows_affected=rows.height, steps_affected=steps,
            rows=rows.head(self.params["rows_listed"]).to_dicts())]
