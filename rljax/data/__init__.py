"""Host-side data layer (numpy): the validated :class:`StepBatch`, its validation, SkyRL
``GeneratorOutput`` conversion, step-wise advantages, filters, prefix-aware merging, packing
and the preparation pipeline that turns a rollout's batch into training samples."""

from rljax.data.batch import StepBatch

__all__ = ["StepBatch"]
