"""A LoRA group's input projection `x A^T` for its few (rank) output columns."""
