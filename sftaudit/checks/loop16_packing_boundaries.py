"""LOOP-16 packing boundaries."""

from __future__ import annotations

from .base import AuditContext, Check, Finding, count

# Attention implementations that turn position_ids restarts or cu_seq_lens into per-sample (varlen) attention.
VARLEN_FROM_POSITIONS = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn")
NO_RESTART = "positions do not restart"
MASK_GIVEN = "attention_mask given"
CACHE_BUILT = "a KV cache was built (use_cache=True): pass use_cache=False"


class PackingBoundaries(Check):
    """Packing boundaries (trigger point: after collate).

    What it detects:
        Rows that hold several samples (packing) while causal attention runs across them:
        no 4-D or block mask separates them, and the positions do not restart at each sample in a
        forward that honours the restarts. Each sample then attends to the ones packed before it.
    Why it matters:
        Later samples are conditioned on unrelated earlier text: the loss is lower than it should
        be and the model learns to continue other people's conversations. In transformers, sdpa
        and eager attention keep restarted positions apart only when the model gets no 2-D
        attention_mask and builds no KV cache (a training forward with use_cache=False); flash
        attention reads the restarts or `cu_seq_lens` unless a padded 2-D mask is given.
    Statistic:
        Per row, the shim counts attended BOS tokens (one per packed sample; templates without a
        BOS token are not judged; a BOS right after another, the double BOS of LOOP-02, starts no
        sample: counted on the recorded rows, and halved on the others when every recorded row
        doubles its BOS) and, when the batch gives `position_ids`, their restarts at 0;
        per micro-batch whether varlen keys were given, the attention mask the model got (none, a
        2-D padding mask, a custom 4-D / block mask) and whether its forward built a KV cache; the
        manifest names the attention implementation. A row with k > 1 samples is isolated by a
        custom mask; under flash attention by varlen keys or k - 1 restarts, unless a 2-D mask with
        padding was given; under other implementations by k - 1 restarts with no 2-D mask and no
        cache. Runs recorded before the mask and cache were recorded keep the older rule: varlen
        keys, or k - 1 restarts under flash attention.
    Threshold:
        Any contaminated row: fail at the first step with one.
    Evidence:
        The first rows (sample ids, samples per row, position restarts, the causes), the attention
        implementation, the number of steps and rows affected.
    """

    code = "LOOP-16"
    name = "packing boundaries"
    rules = {
        "cross-sample-attention": "packed samples attend to each other",
    }
    needs = ("batches",)
    source_needs = ("collator",)
    defaults = {"rows_listed": count(5)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        if not ctx.has_rows("batches"):
            return []
        attn = (ctx.manifest.get("model") or {}).get("attn_implementation")
        flash = "true" if attn in VARLEN_FROM_POSITIONS else "false"

        def cause(condition: str, text: str) -> str:
            return "CASE WHEN " + condition + " THEN ['" + text.replace("'", "''") + "'] ELSE [] END"

        # Runs recorded without the mask and cache: varlen keys, or restarts under flash attention.
        old_rule = (
            f"CASE WHEN coalesce(varlen, false) OR ({flash} AND NOT no_restart) THEN [] "
            f"ELSE {cause('no_restart', NO_RESTART)} || {cause('NOT no_restart', f'positions restart but {attn} ignores them')} END"
        )
        flash_rule = (
            f"{cause('mask = $$padding$$ AND padded', MASK_GIVEN + ' (with padding)')} || "
            f"{cause('no_restart AND NOT coalesce(varlen, false)', NO_RESTART)}"
        )
        other_rule = (
            f"{cause('no_restart', NO_RESTART)} || {cause('mask = $$padding$$', MASK_GIVEN)} || "
            f"{cause('coalesce(cache_built, true)', CACHE_BUILT)}"
        )
        bos = (((ctx.manifest.get("tokenizer") or {}).get("special_tokens") or {}).get("bos") or {}).get("id")
        # A BOS right after another attended BOS starts no sample (the template wrote one and the tokenizer added
        # another: LOOP-02's double BOS). Counted on the recorded rows; a row not recorded, in a run whose
        # recorded rows double every BOS they hold, holds half as many samples as BOS tokens.
        rows = ctx.frame(
            f"""
            WITH tokens AS (
                SELECT rank, seg, step, micro, row, unnest(input_ids) AS id, unnest(attention_mask) <> 0 AS attended,
                       unnest(generate_series(1, len(input_ids))) AS pos
                FROM samples WHERE $bos IS NOT NULL),
            starts AS (
                SELECT *, id = $bos AND attended AS is_bos FROM tokens),
            doubled AS (
                SELECT rank, seg, step, micro, row, count(*) FILTER (WHERE is_bos AND after_bos) AS pairs,
                       count(*) FILTER (WHERE is_bos) AS bos_count
                FROM (SELECT *, coalesce(lag(is_bos) OVER (PARTITION BY rank, seg, step, micro, row ORDER BY pos), false)
                                AS after_bos FROM starts)
                GROUP BY ALL),
            run_doubles AS (
                SELECT count(*) > 0 AND bool_and(2 * pairs = bos_count) AS every FROM doubled WHERE bos_count > 0),
            counted AS (
                SELECT b.step, b.micro, b.sample_ids[b.i] AS sample_id, b.i,
                       CASE WHEN d.pairs IS NOT NULL THEN b.bos_starts[b.i] - d.pairs
                            WHEN (SELECT every FROM run_doubles) THEN b.bos_starts[b.i] // 2
                            ELSE b.bos_starts[b.i] END AS samples,
                       coalesce(b.position_resets[b.i], 0) AS resets, b.varlen, b.attention_mask_kind AS mask,
                       b.cache_built, list_min(b.lengths) < b.seq_len AS padded
                FROM (SELECT *, generate_subscripts(bos_starts, 1) AS i FROM batches
                      WHERE rank = 0 AND bos_starts IS NOT NULL) b
                LEFT JOIN doubled d ON d.rank = b.rank AND d.seg = b.seg AND d.step = b.step AND d.micro = b.micro
                                       AND d.row = b.i - 1),
            packed AS (
                SELECT *, resets < samples - 1 AS no_restart FROM counted WHERE samples > 1),
            judged AS (
                SELECT *, CASE WHEN mask IS NULL THEN {old_rule}
                               WHEN mask = 'custom' THEN []
                               WHEN {flash} THEN {flash_rule}
                               ELSE {other_rule} END AS causes
                FROM packed)
            SELECT step, micro, sample_id, samples, resets, varlen, causes FROM judged
            WHERE len(causes) > 0 ORDER BY step, micro, i
            """,
            {"bos": bos},
        )
        if rows.height == 0:
            return []
        first = rows.row(0, named=True)
        steps = rows["step"].n_unique()
        ignored = " (cu_seq_lens are read by flash attention only)" if first["varlen"] and flash == "false" else ""
        return [
            self.finding(
                "cross-sample-attention",
                "fail",
                f"from step {first['step']} rows hold several samples ({first['samples']} in row {first['sample_id']}) that "
                f"attend to each other under {attn} attention: {'; '.join(first['causes'])}{ignored} "
                f"({rows.height} row(s) in {steps} step(s)); give each sample restarting position_ids with no 2-D "
                f"attention_mask and use_cache=False (DataCollatorWithFlattening / TRL padding_free), a block mask, "
                f"or stop packing",
                step=int(first["step"]),
                attn_implementation=attn,
                rows_affected=rows.height,
                steps_affected=steps,
                rows=rows.drop("varlen").head(self.params["rows_listed"]).to_dicts(),
            )
        ]
