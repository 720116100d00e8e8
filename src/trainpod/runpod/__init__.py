"""Everything that talks to RunPod: one REST client (client.py), and above it, never touching HTTP,
deploy (template, volume, pod; or an Instant Cluster, cluster.py), the supervisor of a pod or a cluster
(supervise.py, units.py), and the pod's own finish (stop itself or delete its cluster, crash loops).

    trainpod deploy configs/deploy/pretrain-spot.yaml --dry-run
    trainpod supervise RUN --config configs/deploy/pretrain-spot.yaml
    trainpod deploy configs/deploy/pretrain-cluster.yaml --dry-run   # nodes: 2 -> POST /v2/clusters
"""
