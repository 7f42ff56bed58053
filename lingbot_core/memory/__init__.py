"""Where weights live: the offload modes' hooks (offload), the block ring and its staging (block_streaming),
pinned host memory, component placement, the RAM budget.

Imports lingbot_core.files and lingbot_core.model; never the pipeline.
"""
