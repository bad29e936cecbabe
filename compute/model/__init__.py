"""The model path on the device: the transformers model with paged attention over the kvstore's
pool (``attention``, ``fused``, ``models``), the runner that packs a step and replays CUDA graphs
(``runner``, ``graphs``, ``mixed_graphs``, ``block_tables``) and the start-up profiles that price
recompute for the kvstore's cost model (``profile``, ``profile_cache``). Imports no other wing."""
