"""Names of the per-rank checks of a distributed step (see ``distributed_checks``)."""

DISTRIBUTED_CHECKS: dict[str, str] = {
    "distributed.replica_masks_identical": "tensor- and context-parallel replicas keep identical masks",
    "distributed.global_selection": "the mask assembled over the DP ranks is an outcome of Algorithm 1 on the whole optimizer batch",
    "distributed.loss_sum": "the rank losses of one replica set add up to the global loss",
    "distributed.shard_gradient": "each rank's gradient is the analytic gradient (global N) on its rows and CP shard, zero elsewhere",
    "distributed.metrics": "every rank reports the global metrics and counts",
}
