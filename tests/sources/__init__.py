"""Tests of the log sources (`sftaudit.imports.sources`): each module ``test_<source module>.py`` here tests one source
and defines ``write_example(folder) -> list[Path]``, the source's files of the contract run every source must read
alike (`tests/test_imports_sources.py`): training logs at steps 1..10 with ``example_loss(step)`` and a learning rate
of 1e-4."""

EXAMPLE_STEPS = range(1, 11)


def example_loss(step: int) -> float:
    return 2.0 - 0.125 * step  # exact in float32 (TensorBoard stores float32)
