"""Where weights live: offload hooks and the block ring, pinned host memory, component placement, the RAM budget.

Imports lingbot_core.files and lingbot_core.model; never the pipeline.
"""
