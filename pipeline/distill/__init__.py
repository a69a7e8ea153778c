"""`train-draft`: a draft model distilled from the target's own outputs (draft_init, dataset, train, cli)."""
