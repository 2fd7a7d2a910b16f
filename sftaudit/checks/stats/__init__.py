"""Statistics the checks share: rolling robust levels, text metrics."""
