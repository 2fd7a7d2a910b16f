"""Training-side shim: needs torch only, never the analyzer (DuckDB, scipy, plotly)."""

from .profiles import PROFILES, Schedule
from .recorder import Recorder

__all__ = ["PROFILES", "Recorder", "Schedule"]
