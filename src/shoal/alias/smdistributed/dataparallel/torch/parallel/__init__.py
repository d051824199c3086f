"""``smdistributed.dataparallel.torch.parallel`` under the import switch."""
