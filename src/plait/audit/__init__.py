"""Data at scale, the verbs: `plait data pack` (plait.data.packed) and `plait data audit` (cross-validated models
trained with plait's own trainer, then cleanlab, duplicates, outliers and class balance)."""
