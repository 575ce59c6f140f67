"""`plait tune`: hyperparameter search over real plait runs (Optuna underneath; pruning by preemption)."""
