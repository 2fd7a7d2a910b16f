"""The published contracts: the artifact records (`records`) and verdict.json (``verdict.schema.json``)."""
