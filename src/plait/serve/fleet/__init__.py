"""The processes behind one served model: replicas, their routing and autoscaling, and pipeline stages.

It owns `--replicas N` (`replicas`: the pool and its least-loaded router; `replica_worker` and `coldstart`: the
replica's side), `--autoscale MIN:MAX` (`autoscale`: a pure policy and its controller) and `--pp K` (`pipeline`).
Each is an executor of plait.serve.executor.tasks' protocol.
"""
