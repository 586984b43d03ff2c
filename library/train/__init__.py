"""The training loop and what it runs: the loss of a batch, noise, the guarded update, schedules, validation, logs."""
