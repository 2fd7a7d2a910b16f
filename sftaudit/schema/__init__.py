"""The published contracts: the artifact records (`records`), a finding and its evidence (`findings`), verdict.json
(`verdict`, from which ``verdict.schema.json`` is generated) and the golden file `diff` compares against (`golden`,
``golden.schema.json``)."""
