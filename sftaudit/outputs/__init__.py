"""What the verdict is rendered into: the HTML report, SARIF, Markdown, GitHub Actions annotations."""
