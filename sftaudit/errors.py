"""Errors the CLI turns into one line on stderr and exit code 2 ("could not judge")."""


class InputError(Exception):
    """Missing, corrupt or hostile input: the audit cannot judge the run."""


class UnsupportedVersion(Exception):
    """An installed library older than the oldest release sftaudit supports lacks what a check needs: that
    check is not run (saying which version and what to upgrade); the others still judge the run. Not an
    InputError: a check that tells a template without turns from a bad one must not take it for either."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's text collapsed to one line (library messages often span several)."""
    return " ".join(str(exc).split())[:limit]
