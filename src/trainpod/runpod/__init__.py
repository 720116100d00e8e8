"""Everything that talks to RunPod: one REST client (client.py), and above it, never touching HTTP,
deploy (template, volume, pod), the spot supervisor, and the pod's own finish (stop itself, crash loops).

    trainpod deploy configs/deploy/pretrain-spot.yaml --dry-run
    trainpod supervise RUN --config configs/deploy/pretrain-spot.yaml
"""
