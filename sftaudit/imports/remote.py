"""Runs named by a remote address (a URL, a bucket, a tracker's run URI): sftaudit never reaches the network, so each
gets one line saying how to bring it onto the disk first."""

from __future__ import annotations

import re

# A URI's scheme: letters, then letters, digits, "+", "-" or "."; then ":" (a Windows drive letter is one letter).
SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")

# scheme -> (what it names, how to copy it locally)
REMOTE = {
    "http": (
        "a web address",
        "download it first (`curl -LO URL`; a Hub repository: `hf download REPO --local-dir DIR`)",
    ),
    "https": (
        "a web address",
        "download it first (`curl -LO URL`; a Hub repository: `hf download REPO --local-dir DIR`)",
    ),
    "s3": ("an S3 location", "copy it first: `aws s3 sync s3://BUCKET/PATH DIR`"),
    "gs": ("a Cloud Storage location", "copy it first: `gcloud storage cp -r gs://BUCKET/PATH DIR`"),
    "az": ("an Azure Storage location", "copy it first: `azcopy copy URL DIR --recursive`"),
    "abfs": ("an Azure Storage location", "copy it first: `azcopy copy URL DIR --recursive`"),
    "hf": ("a Hugging Face Hub path", "download it first: `hf download REPO --local-dir DIR`"),
    "wandb": (
        "a W&B run",
        "audit the folder the run wrote on its machine (wandb/run-*/ or wandb/offline-run-*/), or export its "
        'history to a file with `wandb.Api().run("ENTITY/PROJECT/RUN_ID").history()`',
    ),
    "runs": (
        "an MLflow run",
        "audit the tracking store it was logged to (an mlruns/ folder or an mlflow.db file), or export its metrics "
        "with `MlflowClient().get_metric_history(RUN_ID, KEY)`",
    ),
    "models": ("an MLflow model", "download it first: `mlflow artifacts download -u URI -d DIR`"),
    "mlflow": (
        "an MLflow run",
        "audit the tracking store it was logged to (an mlruns/ folder or an mlflow.db file), or export its metrics "
        "with `MlflowClient().get_metric_history(RUN_ID, KEY)`",
    ),
}


def remote_scheme(text: str) -> str | None:
    """The scheme of a run given by a URI (``s3://...``, ``runs:/...``), None for a local path."""
    found = SCHEME.match(text)
    return found.group(1).lower() if found else None


def remote_hint(text: str) -> str | None:
    """One line for a run given by a remote address: what it is and how to copy it locally; None for a local path."""
    scheme = remote_scheme(text)
    if scheme is None:
        return None
    what, how = REMOTE.get(scheme, ("a remote address", "copy it onto this machine first"))
    return (
        f"{text} is {what}: sftaudit reads runs from the local disk only and never fetches one; {how}, then audit that"
    )
