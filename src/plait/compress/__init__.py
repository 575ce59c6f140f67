"""`plait compress RUN_DIR`: low-rank factorisation (SVD) or int8 weights (torchao) of a trained model, after training.

    from plait.compress.core import compress_low_rank, compress_int8   # (imports torch)

This package's top level imports nothing heavy: `plait.compress.cli` adds the verb to `plait --help`.
See docs/finetune.md.
"""
