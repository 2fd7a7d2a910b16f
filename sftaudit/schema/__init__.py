"""The published contracts: the artifact records (`records`), a finding and its evidence (`findings`) and
verdict.json (`verdict`, from which ``verdict.schema.json`` is generated)."""
