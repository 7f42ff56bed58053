"""What the pack reads and writes on disk: safetensors and GGUF checkpoints, fp8 scales, the Wan 2.1 VAE layout, mp4.

Readers return tensors and bytes, never model classes. Imports nothing else of lingbot_core.
"""
