"""A finding as the JSON body of a chat webhook: one payload that Slack's and Discord's incoming webhooks both take.

Slack reads ``text`` (mrkdwn: ``&``, ``<`` and ``>`` escaped as its docs ask, so run text cannot open a link or a
``<!channel>`` mention); Discord reads ``content`` (at most 2,000 characters) and ``allowed_mentions`` (none: run
text pings nobody). In both, each ``@`` is followed by a zero-width space, so ``@channel``, ``@here`` and
``@everyone`` in a run's own strings stay plain text; control and bidi characters are written as their visible
escapes. The sending (a worker thread, retries, a bounded queue) is the `watch` command's.
"""

from __future__ import annotations

from typing import Any

from ..core.terminal import shown

DISCORD_CONTENT_LIMIT = 2000  # characters: Discord refuses a longer `content`
MESSAGE_LIMIT = 1500  # characters of the finding's message kept, so the whole line fits Discord's limit
_NO_MENTION = "@\u200b"


def alert_line(finding: dict[str, Any], run: str) -> str:
    """One line: severity, code, step, run and the finding's message (cut to MESSAGE_LIMIT), safe to print."""
    where = "the run" if finding.get("step") is None else f"step {finding['step']}"
    message = " ".join(shown(finding.get("message") or "").split())
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 1] + "…"
    return f"sftaudit {finding['severity'].upper()} {finding['code']} at {where} of run {shown(run)[:200]}: {message}"


def slack_text(line: str) -> str:
    """`line` as Slack mrkdwn takes it literally: its three control characters escaped, no mention."""
    return line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("@", _NO_MENTION)


def discord_content(line: str) -> str:
    """`line` as Discord shows it: no mention, within its length limit."""
    text = line.replace("@", _NO_MENTION)
    return text if len(text) <= DISCORD_CONTENT_LIMIT else text[: DISCORD_CONTENT_LIMIT - 1] + "…"


def payload(finding: dict[str, Any], run: str) -> dict[str, Any]:
    """The POST body for one finding (a verdict's finding: code, severity, step, message)."""
    line = alert_line(finding, run)
    return {"text": slack_text(line), "content": discord_content(line), "allowed_mentions": {"parse": []}}
