"""The dataset path: chat templates rendered as transformers does, batches collated and described, the preflight preview."""
