"""What computes: the DiT (dense and MoE) and its attention, the latent video and VAE helpers, the refiner's start,
LoRA, precision choices, and the DiT, text-encoder and VAE modules built from single files.

Imports only lingbot_core.files.
"""
