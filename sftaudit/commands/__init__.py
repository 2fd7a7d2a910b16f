"""One module per CLI subcommand (each runs as `run(args)`), and the notebook API (`sftaudit.open`)."""
