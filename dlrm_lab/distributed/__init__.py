"""Process groups, sharding plans and DistributedModelParallel wrapping."""
