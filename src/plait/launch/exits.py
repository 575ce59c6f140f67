"""The exit statuses a worker ends with when it has explained the failure itself, which the launcher passes on.

A module of its own so that the launchers (plait.launch.torchrun) need not import the package's __init__, which
starts them: that was an import cycle (plait.launch -> plait.launch.torchrun -> plait.launch).
"""

USER_ERROR_EXIT = 2  # a PlaitError: the message says what to change (the CLI's exit status for it, too)
DISTRIBUTED_FAILURE_EXIT = 3  # a hang or mismatched collectives, explained by the worker (plait.train.watchdog)
