"""Training machinery shared by the training workloads: model, batches, state, reporting, export."""
