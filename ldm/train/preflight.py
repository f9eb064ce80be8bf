"""What both paths settle once the batches have started and before the first write: where the run began (its
lineage), the FLOPs of one training sample, and, resuming, the configuration the checkpoint recorded."""

from __future__ import annotations

import logging

from ldm.checkpoint.resume import Resume
from ldm.config.record import compare_resume
from ldm.models.buckets import bucket_name
from ldm.models.flops import SampleFlops
from ldm.runtime.distributed import Distributed
from ldm.train.batches import TimedBatches
from ldm.train.objective import Objective

logger = logging.getLogger("ldm.train")


def count_flops(objective: Objective, batches: TimedBatches, record: dict) -> SampleFlops | None:
    """FLOPs of one training sample of `objective` (on the batches' kind), at `--resolution` and, with aspect-ratio
    buckets, at each bucket's shape (MFU is counted at the shapes trained), logged and added to the run's record
    (`record["model"]["flops_per_sample"]`, `...["flops_per_sample_by_bucket"]`); None when not counted."""
    flops = objective.flops_per_sample(batches.on_latents)
    if not flops:
        return None
    record.setdefault("model", {})["flops_per_sample"] = flops
    logger.info("FLOPs per training sample (forward and backward): %.4g G (%s)", flops["total"] / 1e9,
                ", ".join(f"{part} {value / 1e9:.4g} G" for part, value in flops.items() if part != "total"))
    by_bucket = {bucket_name(bucket): objective.flops_per_sample(batches.on_latents, shape=bucket)["total"]
                 for bucket in objective.buckets or ()}
    if by_bucket:
        record["model"]["flops_per_sample_by_bucket"] = by_bucket
        logger.info("FLOPs per training sample by bucket: %s", ", ".join(f"{name} {value / 1e9:.4g} G"
                                                                          for name, value in by_bucket.items()))
    return SampleFlops(flops["total"], by_bucket)


def check_before_writing(objective: Objective, batches: TimedBatches, record: dict, resume: Resume | None, *,
                         allow_config_change: bool, dist: Distributed) -> SampleFlops | None:
    """What both paths check once the batches have started and before the first write: the held-out data,
    the FLOPs per sample (returned) and, resuming, the configuration the checkpoint recorded. The caller
    stops the loader workers, which are running already, when this fails."""
    lineage = objective.initialise() if not resume else resume.lineage
    if lineage:
        record["lineage"] = lineage  # a resumed stage's checkpoints keep naming where it began
    objective.prepare_validation(dist)
    flops = count_flops(objective, batches, record)
    if resume:
        compare_resume(resume.path, resume.record, record, allow_change=allow_config_change, log=dist.is_main)
    return flops
