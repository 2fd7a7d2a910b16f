"""A prelude for subprocesses that must run as on a machine without torch installed.

The import system's path finder is wrapped so that torch is not found at all (import fails,
`importlib.util.find_spec("torch")` is None, so transformers sees no torch either).
`sys.modules['torch'] = None` would not do: libraries probing `sys.modules` (scipy) trip on it.
"""

BLOCKED = ("torch",)

PRELUDE = f"""
import sys, importlib.machinery
class _PathFinderWithout(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            return None
        return super().find_spec(name, path, target)
sys.meta_path[:] = [_PathFinderWithout if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""
