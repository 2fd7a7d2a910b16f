"""Errors the CLI turns into one line on stderr and exit code 2 ("could not judge")."""


class InputError(Exception):
    """Missing, corrupt or hostile input: the audit cannot judge the run."""
