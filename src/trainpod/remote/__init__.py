"""Reaching a network volume from a laptop, with no pod: RunPod's S3-compatible API (s3.py is the one
place that talks S3), `trainpod push`, `pull`, `ls` and the S3 view of `status`."""
