"""Text from a run folder made inert for each place an output puts it: one module per target.

`markdown` (step summary, model card, SARIF messages), `html` (the report), `xml` (JUnit), `uri` (SARIF artifact
locations). The terminal's is `sftaudit.core.terminal` (the CLI's error line and layers below use it too); every
target here starts from it, so a control, bidi or format character is shown as its escape (``\\x1b``, ``\\u202e``)
wherever the run's text lands.
"""
