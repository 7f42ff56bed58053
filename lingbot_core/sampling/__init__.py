"""How the denoising loop steps: sigma grids and timesteps, the samplers, the step cache, speed options.

Imports lingbot_core.model only (speed options set its attention backend and compiled blocks).
"""
