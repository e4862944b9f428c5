"""The cost model: pure functions from (config, model, cluster[, profile]) to an Estimate."""
