"""Errors the CLI turns into one line on stderr and exit code 2 ("could not judge")."""


class InputError(Exception):
    """Missing, corrupt or hostile input: the audit cannot judge the run."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's text collapsed to one line (library messages often span several)."""
    return " ".join(str(exc).split())[:limit]
