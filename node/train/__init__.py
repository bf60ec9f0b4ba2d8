"""The daemon's loop around the outer round: inner steps, LR schedule, round records and held-out evals, checkpoints."""
