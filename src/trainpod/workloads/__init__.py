"""One module per workload; each exposes `run(request)` called by the CLI's `trainpod run WORKLOAD`."""
