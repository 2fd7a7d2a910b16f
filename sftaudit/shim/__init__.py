"""Training-side shim: needs torch only, never the analyzer (DuckDB, scipy, plotly)."""

from .guard import Halt, TrainingHalted
from .profiles import PROFILES, Schedule
from .recorder import Recorder

__all__ = ["PROFILES", "Halt", "Recorder", "Schedule", "TrainingHalted"]
