"""Where a batch runs: the typed seam between the service and whatever holds the model.

It owns the task and result types that cross processes (`tasks`: Infer, Generate, their outputs and the replica
messages), the dynamic batcher (`batcher`), the in-process executor and the batch runner every executor shares
(`runner`), and whole-batch generation with a contiguous KV cache (`generate`, --scheduler static).
"""
