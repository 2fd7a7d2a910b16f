"""The published contracts: the artifact records (`records`), verdict.json (``verdict.schema.json``) and the golden
file `diff` compares against (`golden`, ``golden.schema.json``)."""
