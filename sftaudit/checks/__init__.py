"""The registered checks: every module ``loopNN_*.py`` in this package holds one check class.

Adding a check is one new file here (plus its tests); nothing else changes.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

from .base import AuditContext, Check, Finding

_MODULE = re.compile(r"loop\d\d_\w+")
# The checks that judge a dataset with its tokenizer and template before any training (`sftaudit preflight`);
# the others judge training.
DATASET_CHECKS = ("LOOP-01", "LOOP-02", "LOOP-03", "LOOP-04")


def registered_checks() -> list[type[Check]]:
    """All check classes, ordered by code."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if _MODULE.fullmatch(info.name):
            module = importlib.import_module(f"{__name__}.{info.name}")
            found += [
                obj
                for obj in vars(module).values()
                if inspect.isclass(obj)
                and issubclass(obj, Check)
                and obj is not Check
                and obj.__module__ == module.__name__
            ]
    return sorted(found, key=lambda c: c.code)


__all__ = ["DATASET_CHECKS", "AuditContext", "Check", "Finding", "registered_checks"]
