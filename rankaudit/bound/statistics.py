"""Which normalisations read the batch's statistics (they couple the samples of a batch), and which of them update
running statistics a client may send with its update (each channel's batch mean and variance of the norm's input)."""

from __future__ import annotations

from rankaudit.trace.records import TracedModel

# Normalisations whose statistics are each sample's own: InstanceNorm's mean and variance are over one sample's
# channel, GroupNorm's over one sample's group (in eval mode an InstanceNorm with running statistics reads those,
# which do not depend on the batch either). Their Jacobian depends on the input (the norm family says so), but
# they carry no sample into another's gradient.
_PER_SAMPLE_NORMS = ("instancenorm", "instance_norm", "groupnorm", "group_norm", "native_group_norm")
# aten spellings that state they normalise with running statistics.
_RUNNING_STATISTICS_OPS = ("_native_batch_norm_legit_no_training", "_batch_norm_no_update")
# Function spellings of a batch normalisation: their `training` argument is not recorded, so they count as reading
# the batch's statistics in eval mode too (the worst case).
_FUNCTIONAL_BATCH_NORMS = ("batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update")


def batch_statistics(traced: TracedModel, bn_mode: str) -> list[str]:
    """The records that normalise with the batch's mean and variance (method.md: the round): in training mode every
    normalisation of the norm family that is not per sample (BatchNorm1d/2d/3d, SyncBatchNorm, their subclasses,
    F.batch_norm); in eval mode the BatchNorms without running statistics and the functional calls."""
    found = []
    for node_id in traced.order:
        record = traced.record(node_id)
        op = record.op.lower()
        # Another library's normalisation module is traced as one op (the layer_norm family, per sample); one named
        # for batch normalisation is taken at its word, except a frozen one (fixed statistics by construction).
        if record.family == "script_module":
            # Compiled code whose inside is not known: it may normalise with the batch's statistics in any mode
            # (torch.jit.trace fixes a BatchNorm's training flag as it was when traced). The worst case.
            found.append(node_id)
            continue
        other_library = record.family == "layer_norm" and "batch" in op and not op.startswith("frozen")
        if record.family != "norm" and not other_library:
            continue
        if op.startswith(_PER_SAMPLE_NORMS) or op in _RUNNING_STATISTICS_OPS:
            continue
        if bn_mode == "train" or node_id in traced.eval_batch_statistics or op in _FUNCTIONAL_BATCH_NORMS:
            found.append(node_id)
    return found


# The buffers a batch normalisation updates from each batch it trains on: (1-m)·old + m·(the batch's mean) and
# the same with its unbiased variance, one value per channel each.
RUNNING_BUFFERS = ("running_mean", "running_var")


def running_statistics(traced: TracedModel, bn_mode: str) -> list[tuple[str, str, int]]:
    """(node, buffer key, values) for every running statistic a step updates from the batch (method.md: the bound):
    the batch normalisations that read the batch's statistics and keep running ones (a BatchNorm without running
    statistics updates none); a functional call, a compiled module or another library's batch norm is taken to
    update its own (the worst case). A module called twice updates the same buffers: one key. The values are the
    channels (traced at batch size 1: (1, C, ...)); a shape not known counts every value of the output."""
    found = []
    for node_id in batch_statistics(traced, bn_mode):
        if node_id in traced.eval_batch_statistics:
            continue
        record = traced.record(node_id)
        shape = record.output_shape
        channels = shape[1] if record.family == "norm" and shape and len(shape) >= 2 else record.output_numel
        module = record.name.split("#")[0]
        found += [(node_id, f"{module}.{buffer}", channels) for buffer in RUNNING_BUFFERS]
    return found
