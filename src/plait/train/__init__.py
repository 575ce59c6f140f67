"""Trainer loop, optimizers and schedules, checkpoints, metrics."""
