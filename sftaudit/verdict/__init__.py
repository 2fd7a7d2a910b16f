"""From findings to a verdict: the audit pipeline, the logging resolution, attribution to checkpoints, the rollback; the audit configuration."""
