"""Tensor parallelism: a model's weights split over the ranks of a group (``layers``,
``sharding``), the group's processes and collectives (``group``, ``symmetric``) and the step plans
rank 0 sends the others (``step_plan``)."""

ALL_REDUCES = ["auto", "nccl"]  # a group's all-reduces on CUDA (--tp-all-reduce)
