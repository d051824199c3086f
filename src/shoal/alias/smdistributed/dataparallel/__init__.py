"""``smdistributed.dataparallel`` under the import switch."""
