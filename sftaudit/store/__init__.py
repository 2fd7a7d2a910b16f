"""The run database: artifacts ingested into DuckDB."""
